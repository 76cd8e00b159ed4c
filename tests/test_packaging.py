"""The sidecar and the on-call tools run without torch or diffusers (the sidecar extra does not carry them)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_NO_TORCH = textwrap.dedent(
    """
    import sys
    for name in ("torch", "diffusers", "transformers"):
        sys.modules[name] = None  # any import of these now fails
    import stepwatch.exporter
    from stepwatch.exporter.sidecar import capture, main, nvml, prober, quality
    from stepwatch.alerts import generate, rulegen, stack
    from stepwatch.runbooks import parse
    from stepwatch import catalog, promapi
    from stepwatch.cli import main as cli
    for argv in (["sidecar", "--help"], ["baseline", "capture", "--help"], ["rules", "generate", "--help"]):
        try:
            cli(argv)
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
    print("ok")
    """
)


def test_sidecar_and_rules_import_without_torch() -> None:
    p = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().endswith("ok")


def test_catalog_names_follow_the_convention() -> None:
    from stepwatch.catalog import METRICS, validate

    validate()
    assert len({m.name for m in METRICS}) == len(METRICS)
    assert all(m.name.startswith("stepwatch_") for m in METRICS)
