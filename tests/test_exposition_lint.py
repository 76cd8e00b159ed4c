"""`promtool check metrics` on the live expositions: the practice service's /metrics and the sidecar's.

Prometheus' own linter rejects what a scrape would still accept but queries would misread (a gauge with a
`quantile` label, a counter without `_total`, ...).  promtool is not optional here: a missing one fails the test
(./dev setup installs Debian's prometheus package, which ships it) rather than skipping it.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge, Summary, generate_latest

from stepwatch import httpclient
from stepwatch.catalog import METRICS
from stepwatch.exporter.sidecar.capture import capture_baseline
from stepwatch.exporter.sidecar.config import load_probe_set
from tests.fakes import StandIn
from tests.promtext import absent, samples, value
from tests.servicefixture import ServiceProc

PROBES = {"name": "lint", "gate": "lossy_ii", "size": "32x32", "steps": 2, "prompts": ["a fox", "a boat"],
          "seeds": [0, 1]}
QUANTILE_ON_A_GAUGE = 'non-summary metrics should not have "quantile" label'


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is not on PATH: it comes with Debian's prometheus package "
                    "(`./dev setup` installs it: apt-get install prometheus)", pytrace=False)
    return found


def check_metrics(text: str) -> tuple[int, str]:
    """``promtool check metrics`` on an exposition (text format): its exit status and its output, both streams."""
    r = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    return r.returncode, (r.stdout + r.stderr).strip()


def assert_lint_clean(text: str, what: str) -> None:
    rc, out = check_metrics(text)
    assert (rc, out) == (0, ""), f"promtool check metrics on {what}: exit {rc}\n{out}"


# --- the lint itself can fail ------------------------------------------------------------------------------

def test_the_lint_rejects_a_gauge_with_a_quantile_label() -> None:
    """The quality gauges' former layout (`quantile` = p50/p10/min on a gauge) is what promtool refused."""
    reg = CollectorRegistry()
    g = Gauge("stepwatch_quality_psnr_decibels", "PSNR.", ("probe_set", "instance_id", "quantile"), registry=reg)
    for q, v in (("p50", math.inf), ("p10", 31.5), ("min", 29.0)):
        g.labels("default", "svc-a", q).set(v)
    rc, out = check_metrics(generate_latest(reg).decode())
    assert rc != 0 and QUANTILE_ON_A_GAUGE in out, (rc, out)


def test_the_lint_accepts_the_stat_label_and_real_summaries() -> None:
    reg = CollectorRegistry()
    g = Gauge("stepwatch_quality_psnr_decibels", "PSNR.", ("probe_set", "instance_id", "stat"), registry=reg)
    for q, v in (("p50", math.inf), ("p10", 31.5), ("min", 29.0)):
        g.labels("default", "svc-a", q).set(v)
    Summary("stepwatch_example_seconds", "A summary.", registry=reg).observe(0.5)
    assert_lint_clean(generate_latest(reg).decode(), "a registry with the stat label")


def test_no_catalog_metric_but_a_summary_declares_a_quantile_label() -> None:
    wrong = [m.name for m in METRICS if "quantile" in m.labels and m.kind != "summary"]
    assert not wrong, f"{wrong}: name the label otherwise (the quality gauges use `stat`)"


# --- the live expositions -----------------------------------------------------------------------------------

@pytest.mark.heavy
def test_practice_service_metrics_pass_promtool(tmp_path: Path) -> None:
    """The service's /metrics after a generation, so the exporter's per-shape series exist."""
    promtool()  # fail before starting anything when it is missing
    svc = ServiceProc(tmp_path / "svc", {"compile": {"enabled": False}})
    try:
        st, body, _ = svc.generate(size="256x256", steps=4, seed=1)
        assert st == 200, body
        st, text, _ = svc.get("/metrics")
        assert st == 200
    finally:
        svc.close()
    shape = body["stepwatch"]["shape"]
    data = samples(text)
    assert value(data, "stepwatch_pipeline_step_duration_seconds_count", shape=shape) == 4
    assert_lint_clean(text, "the practice service's /metrics")


def _read_lines(stream: IO[str], lines: list[str]) -> None:
    for line in stream:
        lines.append(line)


def test_sidecar_metrics_pass_promtool(standin: StandIn, tmp_path: Path) -> None:
    """The sidecar process' /metrics once its prober has exported PSNR/SSIM (finite and +Inf)."""
    promtool()
    ps = tmp_path / "ps.yaml"
    ps.write_text(yaml.safe_dump(PROBES))
    capture_baseline(standin.url, load_probe_set(ps), tmp_path / "b")
    # One probe of four now differs from its baseline: finite p10 and min, +Inf p50 (identical images).
    standin.sigma, standin.perturb_seeds, standin.perturb_prompts = 8.0, {1}, {"a fox"}
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(yaml.safe_dump({"probe_set": "ps.yaml", "baseline_dir": "b", "interval_s": 0.5}))
    proc = subprocess.Popen([sys.executable, "-m", "stepwatch.cli", "sidecar", "--target", standin.url,
                             "--port", "0", "--config", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    assert proc.stderr is not None
    threading.Thread(target=_read_lines, args=(proc.stderr, lines), daemon=True).start()
    try:
        deadline = time.monotonic() + 30
        port = None
        while port is None:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            m = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", "".join(lines))
            port = int(m.group(1)) if m else None
            time.sleep(0.05)
        lab = {"probe_set": "lint", "instance_id": "standin-0"}
        text = ""
        while absent(samples(text), "stepwatch_quality_psnr_decibels", **lab, stat="p10"):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.1)
            text = httpclient.request("GET", f"http://127.0.0.1:{port}/metrics").text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    data = samples(text)
    assert math.isfinite(value(data, "stepwatch_quality_psnr_decibels", **lab, stat="p10"))
    assert value(data, "stepwatch_quality_psnr_decibels", **lab, stat="p50") == math.inf
    assert not absent(data, "stepwatch_quality_ssim_ratio", **lab, stat="min")
    assert_lint_clean(text, "the sidecar's /metrics")
