"""The quality prober against the real practice service (issue 4's end-to-end bar)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from stepwatch import cli
from stepwatch.exporter.sidecar.capture import capture_baseline
from stepwatch.exporter.sidecar.config import default_probe_set, parse_probe_set
from stepwatch.exporter.sidecar.prober import Prober
from stepwatch.thresholds import load
from tests.promtext import scrape, total, value
from tests.servicefixture import ServiceProc

Q = load().quality
# The default 20 prompt x seed probes at the service's cheap shape.
PROBES = default_probe_set(size="256x256", steps=8)


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProc]:
    s = ServiceProc(tmp_path_factory.mktemp("svc-q"))
    yield s
    s.close()


@pytest.mark.heavy
def test_baseline_degrades_past_the_gate_and_recovers(svc: ServiceProc, tmp_path: Path) -> None:
    cap = capture_baseline(svc.url, PROBES, tmp_path)
    assert cap.probes == 20 and cap.repeat_psnr_db == math.inf
    registry = CollectorRegistry()
    p = Prober(svc.url, registry=registry, baseline_dir=tmp_path, probe_set=PROBES)
    try:
        res = p.run_once()
        assert res.status == "ok" and len(res.scored) == 20
        assert res.psnr["p10"] == math.inf or res.psnr["p10"] >= 60  # deterministic at the baseline config
        # Push the cache threshold past the quality gate: every middle step reuses the cache.
        st, body, _ = svc.knobs(cache_threshold=5.0)
        assert st == 200, body
        res = p.run_once()
        gate = Q.gate("lossy_ii")
        assert res.status == "ok" and res.gate_db == gate
        assert res.psnr["p10"] < gate - Q.alert_margin_db, res.psnr
        assert res.below_alert
        d = scrape(registry)
        inst = res.per_instance and next(iter(res.per_instance))
        assert value(d, "stepwatch_quality_psnr_decibels", probe_set="default", instance_id=str(inst),
                     stat="p10") == pytest.approx(res.psnr["p10"])
        assert value(d, "stepwatch_quality_gate_decibels", probe_set="default") == gate
        assert value(d, "stepwatch_quality_baseline_stale", probe_set="default") == 0
        # Restore: it recovers.
        svc.knobs(cache_threshold=0.5)
        res = p.run_once()
        assert res.psnr["p10"] == math.inf or res.psnr["p10"] >= 60
    finally:
        svc.knobs(cache_threshold=0.5)
        p.close()


@pytest.mark.heavy
def test_fingerprint_change_reads_as_stale_not_low_psnr(svc: ServiceProc, tmp_path: Path) -> None:
    capture_baseline(svc.url, PROBES, tmp_path)
    registry = CollectorRegistry()
    p = Prober(svc.url, registry=registry, baseline_dir=tmp_path, probe_set=PROBES)
    try:
        st, body, _ = svc.knobs(compile=False)  # compile mode is part of the deployment fingerprint
        assert st == 200 and body["fingerprint"]["compile"] == "off"
        res = p.run_once()
        assert res.status == "stale"
        d = scrape(registry)
        assert value(d, "stepwatch_quality_baseline_stale", probe_set="default") == 1
        assert total(d, "stepwatch_quality_psnr_decibels") == 0  # no PSNR series: no false quality alert
        assert not [k for k in d if k[0] == "stepwatch_quality_psnr_decibels"]
    finally:
        svc.knobs(compile=True)
        p.close()


@pytest.mark.heavy
def test_service_killed_mid_probe_sidecar_survives(tmp_path: Path) -> None:
    s = ServiceProc(tmp_path / "svc", {"compile": {"enabled": False}})
    capture_baseline(s.url, PROBES, tmp_path / "base")
    registry = CollectorRegistry()
    # Killed for good, not restarted: no not-ready grace (prober.NOT_READY_GRACE_S; a restart gets one, below).
    p = Prober(s.url, registry=registry, baseline_dir=tmp_path / "base", probe_set=PROBES, timeout_s=5,
               not_ready_grace_s=0)
    served0 = total(s.metrics(), "stepwatch_service_requests_total", code="200")

    def kill_after_three() -> None:  # mid-set: after the service has answered three probes of the run
        deadline = time.time() + 60
        while time.time() < deadline and total(s.metrics(), "stepwatch_service_requests_total",
                                               code="200") < served0 + 3:
            time.sleep(0.05)
        s.close()

    killer = threading.Thread(target=kill_after_three, daemon=True)
    try:
        killer.start()
        res = p.run_once()  # the service goes away part-way through the set
        assert res.status == "partial", res
        assert 3 <= len(res.scored) < 20
        # The shutting-down service's 503 or the first refused connection ends the set: exactly one failure.
        assert sum(res.failures.values()) == 1 and set(res.failures) <= {"connect", "http_503"}, res.failures
        assert "rest of the set skipped" in (res.error or ""), res.error
        d = scrape(registry)
        assert total(d, "stepwatch_quality_probe_failures_total") == sum(res.failures.values())
        killer.join(timeout=70)  # closed: no longer answering 503 "shutting down" but refusing connections
        t = time.time()
        res2 = p.run_once()  # the target is down: counted, bounded, no exception
        assert res2.status == "failed" and time.time() - t < 30
        d2 = scrape(registry)
        assert total(d2, "stepwatch_quality_probe_failures_total", reason="connect") >= 1
        # With the grace, the same refused connections are a restart in progress: nothing failed yet.
        q = Prober(s.url, registry=CollectorRegistry(), baseline_dir=tmp_path / "base", probe_set=PROBES, timeout_s=5)
        res3 = q.run_once()
        assert res3.status == "not_ready" and res3.failures == {}, res3
        q.close()
    finally:
        killer.join(timeout=70)
        s.close()
        p.close()


@pytest.mark.heavy
def test_capture_cli_timeouts_and_a_real_507(svc: ServiceProc, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """What the stand-in tests cover, against the real service: the capture command, timeouts, an HTTP error."""
    import yaml

    two = {"name": "two", "gate": "lossy_ii", "size": "256x256", "steps": 4, "prompts": ["a fox"], "seeds": [0, 1]}
    ps_path = tmp_path / "two.yaml"
    ps_path.write_text(yaml.safe_dump(two))
    rc = cli.main(["baseline", "capture", "--target", svc.url, "--out", str(tmp_path / "b"),
                   "--probe-set", str(ps_path)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    fid = svc.get("/v1/stepwatch/info")[1]["fingerprint_id"]
    assert f"stored 2 probes for fingerprint {fid}" in out.out
    assert (tmp_path / "b" / "two" / fid / "manifest.json").is_file()

    registry = CollectorRegistry()
    p = Prober(svc.url, registry=registry, baseline_dir=tmp_path / "b", probe_set=parse_probe_set(two),
               timeout_s=0.005)  # far below a real 256^2 x 4 request
    try:
        res = p.run_once()
        assert res.status == "failed" and res.failures == {"timeout": 2}
        assert value(scrape(registry), "stepwatch_quality_probe_failures_total", probe_set="two",
                     reason="timeout") == 2
    finally:
        p.close()

    # Untiled 2048^2 runs out of memory in the real worker: the capture fails with the 507 and stores nothing.
    st, body, _ = svc.knobs(vae_tiling=False)
    assert st == 200, body
    try:
        big = tmp_path / "big.yaml"
        big.write_text(yaml.safe_dump({**two, "name": "big", "size": "2048x2048", "steps": 1}))
        rc = cli.main(["baseline", "capture", "--target", svc.url, "--out", str(tmp_path / "b"),
                       "--probe-set", str(big)])
        err = capsys.readouterr().err
        assert rc == 1 and "HTTP 507" in err and "out of memory in vae_decode" in err, err
        assert not (tmp_path / "b" / "big").exists()
    finally:
        svc.knobs(vae_tiling=True)
