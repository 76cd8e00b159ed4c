"""The built wheel is a working stepwatch on its own: every subpackage and data file the commands read is in it.

The repository's own venv has stepwatch installed editable, so a missing ``package-data`` pattern or a
subpackage left out of ``packages`` would pass every other test.  This builds the wheel, installs it with
``--no-deps`` into a fresh venv whose dependencies come from the repository's venv by a ``.pth`` line (so no
network: the wheel's own contents are what is tested, not PyPI), and runs commands that read the data files:
the thresholds, the metric catalog, the service's default config, the runbooks, the dashboards and the rules.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> str:
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)} -> {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return p.stdout


@pytest.mark.heavy
def test_the_wheel_installed_alone_runs_the_commands(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
          str(ROOT)], tmp_path)
    wheels = list(dist.glob("stepwatch-*.whl"))
    assert len(wheels) == 1, wheels
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env)
    py = env / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).strip())
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheels[0])],
         tmp_path)
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # after the wheel's own files
    where = _run([str(py), "-c", "import stepwatch.runbooks, stepwatch.service.app_videos as v; print(v.__file__)"],
                 tmp_path)
    assert where.startswith(str(site)), where  # the wheel's copy, not the repository's
    cli = [str(py), str(site / "bin" / "stepwatch")]
    assert "triage" in _run([*cli, "--help"], tmp_path)
    _run([*cli, "rules", "generate", "--check"], tmp_path)  # thresholds, catalog, rules, runbooks in the wheel
    out = tmp_path / "board"
    _run([*cli, "dashboards", "generate", "--out", str(out)], tmp_path)
    assert list(out.glob("*.json")), "no dashboard written"
    listed = _run([str(py), "-c", "from stepwatch.service.config import load; c = load(); print(c.video.sizes)"],
                  tmp_path)
    assert "128x128" in listed
