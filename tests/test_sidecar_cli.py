"""`stepwatch sidecar` and `stepwatch baseline capture` from the command line, one as a real process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from stepwatch import cli
from stepwatch.exporter.sidecar.capture import capture_baseline
from stepwatch.exporter.sidecar.config import ConfigError, load_config, load_probe_set
from tests.fakes import StandIn
from tests.promtext import absent, samples, value

TINY = {"name": "tiny", "gate": "lossy_ii", "size": "32x32", "steps": 2, "prompts": ["a fox", "a boat"],
        "seeds": [0, 1]}


def write(path: Path, data: object) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_commands_are_registered() -> None:
    # The CLI imports only the chosen command's module, so the parser is built for the argv it parses.
    argv = ["sidecar", "--target", "http://x:1"]
    ns = cli.build_parser(argv).parse_args(argv)
    assert ns.port == 9465 and ns.host == "127.0.0.1" and callable(ns._run)
    argv = ["baseline", "capture", "--target", "http://x:1"]
    ns = cli.build_parser(argv).parse_args(argv)
    assert ns.out is None and callable(ns._run)


def test_capture_cli(standin: StandIn, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ps = write(tmp_path / "ps.yaml", TINY)
    rc = cli.main(["baseline", "capture", "--target", standin.url, "--out", str(tmp_path / "b"),
                   "--probe-set", str(ps)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert f"stored 4 probes for fingerprint {standin.fingerprint_id}" in out.out
    assert "at 1% budget the cadence is every 4 s" in out.out  # 4 x 0.01 s / 0.01
    assert (tmp_path / "b" / "tiny" / standin.fingerprint_id / "manifest.json").is_file()


def test_capture_cli_errors(standin: StandIn, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ps = write(tmp_path / "ps.yaml", {**TINY, "sedes": [1]})
    assert cli.main(["baseline", "capture", "--target", standin.url, "--probe-set", str(ps)]) == 2
    assert "probe_set.sedes: unknown key" in capsys.readouterr().err
    ps = write(tmp_path / "ps.yaml", TINY)
    standin.fail_code = 507
    rc = cli.main(["baseline", "capture", "--target", standin.url, "--out", str(tmp_path / "b"),
                   "--probe-set", str(ps)])
    assert rc == 1 and "HTTP 507" in capsys.readouterr().err
    assert not (tmp_path / "b" / "tiny" / standin.fingerprint_id).exists()
    assert cli.main(["baseline", "capture", "--target", "http://127.0.0.1:9", "--probe-set", str(ps)]) == 1
    assert "cannot read the deployment fingerprint" in capsys.readouterr().err


@pytest.mark.parametrize(("config", "message"), [
    ({"intervall_s": 10}, "intervall_s: unknown key"),
    ({"timeout_s": -1}, "timeout_s: -1 must be above 0"),
    ({"gate": "lossy_iii"}, "gate: 'lossy_iii' is not a gate kind"),
    ({"probe_set": {"size": "100x100"}}, "probe_set.size: '100x100' must be positive multiples of 16"),
    ({"probe_set": {"prompts": []}}, "probe_set.prompts: expected a non-empty list"),
    ({"budget_ratio": 2}, "budget_ratio: 2 is above 1.0"),
    ({"nvml": "yes"}, "nvml: 'yes' is not true or false"),
    ({"target": "localhost:8000"}, "target: 'localhost:8000' is not an http(s) URL"),
    ({"probe_set": "missing.yaml"}, "cannot read"),
    ({"baseline_dir": "b"}, "target: missing"),
])
def test_bad_config_exits_nonzero_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                config: dict[str, object], message: str) -> None:
    cfg = write(tmp_path / "sidecar.yaml", config)
    target = [] if message == "target: missing" else ["--target", "http://127.0.0.1:1"]
    rc = cli.main(["sidecar", "--config", str(cfg), "--port", "0", *target])
    err = capsys.readouterr().err
    assert rc == 2
    assert "bad config" in err and message in err


def test_config_file_resolves_relative_paths(tmp_path: Path) -> None:
    write(tmp_path / "ps.yaml", TINY)
    cfg = load_config(write(tmp_path / "sidecar.yaml", {"target": "http://127.0.0.1:8000/", "probe_set": "ps.yaml",
                                                        "baseline_dir": "b", "interval_s": 30}))
    assert cfg.target == "http://127.0.0.1:8000" and cfg.baseline_dir == tmp_path / "b"
    assert cfg.probe_set.name == "tiny" and len(cfg.probe_set.items) == 4 and cfg.interval_s == 30
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)


def _read_lines(stream: object, lines: list[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.append(line)


def test_sidecar_process_serves_metrics_and_stops_on_sigterm(standin: StandIn, tmp_path: Path) -> None:
    ps = write(tmp_path / "ps.yaml", TINY)
    capture_baseline(standin.url, load_probe_set(ps), tmp_path / "b")
    cfg = write(tmp_path / "sidecar.yaml", {"probe_set": "ps.yaml", "baseline_dir": "b", "interval_s": 0.5,
                                                   "not_ready_grace_s": 2})
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "stepwatch.cli", "sidecar", "--target", standin.url,
                             "--port", "0", "--config", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=_read_lines, args=(proc.stderr, lines), daemon=True).start()
    try:
        deadline = time.monotonic() + 30
        port = None
        while port is None:
            assert time.monotonic() < deadline, "".join(lines)
            assert proc.poll() is None, "".join(lines)
            for line in lines:
                m = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", line)
                if m:
                    port = int(m.group(1))
            time.sleep(0.05)
        data: dict = {}
        runs = ("stepwatch_quality_probe_runs_total", {"probe_set": "tiny"})
        while absent(data, runs[0], **runs[1]) or value(data, runs[0], **runs[1]) < 2:
            assert time.monotonic() < deadline, "".join(lines)
            data = samples(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
            time.sleep(0.1)
        lab = {"probe_set": "tiny", "instance_id": "standin-0"}
        assert value(data, "stepwatch_quality_psnr_decibels", **lab, stat="p10") == float("inf")
        assert value(data, "stepwatch_quality_gate_decibels", probe_set="tiny") == 30.0
        assert not absent(data, "stepwatch_nvml_up")  # 0 here (no NVML), 1 on a GPU node
        # The target dies: the sidecar keeps serving, and counts the failure once the 2-s restart grace is over.
        standin.stop()
        fails = ("stepwatch_quality_probe_failures_total", {"probe_set": "tiny", "reason": "connect"})
        while absent(data, fails[0], **fails[1]) or value(data, fails[0], **fails[1]) < 1:
            assert time.monotonic() < deadline, "".join(lines)
            data = samples(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines)
    assert "probe cadence fixed at every 0.5 s (set explicitly)" in text
    assert "stopped" in text
    assert "Traceback" not in text


_NO_HEAVY_IMPORTS = """
import sys
from stepwatch.exporter.sidecar import (baseline, capture, cli_capture, cli_sidecar, client, config, main, nvml,
                                        nvml_check, prober, quality)
from stepwatch.cli import build_parser
for argv in (["sidecar", "--target", "http://x:1"], ["baseline", "capture", "--target", "http://x:1"]):
    build_parser(argv).parse_args(argv)
print("heavy:", sorted(n for n in ("torch", "diffusers", "transformers") if n in sys.modules))
"""


def test_the_sidecar_never_imports_torch() -> None:
    """Every sidecar module and both sidecar commands load without even trying torch, diffusers or transformers
    (a stronger check than test_packaging's, which makes them unimportable: a guarded import would pass there)."""
    p = subprocess.run([sys.executable, "-c", _NO_HEAVY_IMPORTS], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "heavy: []"
