"""The prober against the stand-in service: baseline -> inf, perturbation -> below the gate,
stale fingerprints, target down or slow, per-instance quantiles, cadence from the budget."""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from stepwatch.exporter.sidecar.capture import CaptureError, capture_baseline
from stepwatch.exporter.sidecar.config import DEFAULT_PROMPTS, ProbeSet, default_probe_set, parse_probe_set
from stepwatch.exporter.sidecar.prober import Prober
from stepwatch.thresholds import load
from tests.fakes import StandIn
from tests.promtext import absent, scrape, total, value

Q = load().quality
SMALL = default_probe_set(size="64x64", steps=4)  # the default 20 probes, small images for speed


def make(s: StandIn, registry: CollectorRegistry, base: Path, probe_set: ProbeSet = SMALL, **kw: Any) -> Prober:
    return Prober(s.url, registry=registry, baseline_dir=base, probe_set=probe_set, **kw)


def psnr_series(d: dict[Any, float], probe_set: str = "default") -> dict[tuple[str, str], float]:
    out = {}
    for (name, labels), v in d.items():
        ls = dict(labels)
        if name == "stepwatch_quality_psnr_decibels" and ls["probe_set"] == probe_set:
            out[(ls["instance_id"], ls["stat"])] = v
    return out


def test_baseline_then_probe_is_infinite_psnr(standin: StandIn, registry: CollectorRegistry, tmp_path: Path) -> None:
    cap = capture_baseline(standin.url, SMALL, tmp_path)
    assert cap.probes == 20 and cap.repeat_psnr_db == math.inf
    assert cap.path == tmp_path / "default" / standin.fingerprint_id
    p = make(standin, registry, tmp_path)
    res = p.run_once()
    assert res.status == "ok" and len(res.scored) == 20
    assert res.psnr == {"p50": math.inf, "p10": math.inf, "min": math.inf}
    assert res.ssim["min"] == pytest.approx(1.0)
    assert not res.below_alert and res.gate_db == Q.gate("lossy_ii")
    d = scrape(registry)
    lab = {"probe_set": "default", "instance_id": "standin-0"}
    for q in ("p50", "p10", "min"):
        assert value(d, "stepwatch_quality_psnr_decibels", **lab, stat=q) == math.inf
        assert value(d, "stepwatch_quality_ssim_ratio", **lab, stat=q) == pytest.approx(1.0)
    assert value(d, "stepwatch_quality_gate_decibels", probe_set="default") == Q.gate("lossy_ii")
    assert value(d, "stepwatch_quality_baseline_ok", probe_set="default") == 1
    assert value(d, "stepwatch_quality_baseline_stale", probe_set="default") == 0
    assert value(d, "stepwatch_quality_probe_runs_total", probe_set="default") == 1
    assert value(d, "stepwatch_quality_probe_duration_seconds_count", probe_set="default") == 1
    assert value(d, "stepwatch_quality_last_success_timestamp_seconds", probe_set="default") > time.time() - 60
    assert total(d, "stepwatch_quality_probe_failures_total") == 0
    # The requests are the documented shape.
    body = standin.requests[-1]
    assert body["response_format"] == "b64_json" and body["size"] == "64x64" and body["steps"] == 4
    assert {"prompt", "seed", "n"} <= set(body)


def test_perturbation_drops_p10_below_gate_and_recovers(standin: StandIn, registry: CollectorRegistry,
                                                        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    capture_baseline(standin.url, SMALL, tmp_path)
    p = make(standin, registry, tmp_path)
    alert_below = Q.gate("lossy_ii") - Q.alert_margin_db
    # Mild loss on every image: visible on a close look but above the gate, no alert.
    standin.sigma = 2.0
    res = p.run_once()
    assert res.status == "ok" and not res.below_alert
    assert res.psnr["p10"] > Q.gate("lossy_ii")
    # Heavy loss on 4 of 20 (two prompts, both seeds): p50 stays, p10 crosses gate - 3 dB.
    standin.sigma, standin.perturb_prompts = 18.0, set(DEFAULT_PROMPTS[:2])
    with caplog.at_level(logging.WARNING, logger="stepwatch.sidecar.prober"):
        res = p.run_once()
    assert res.below_alert
    assert res.psnr["p50"] == math.inf
    assert res.psnr["p10"] < alert_below and res.psnr["min"] < alert_below
    assert sum(1 for i in res.scored if i.psnr != math.inf) == 4
    d = scrape(registry)
    p10 = value(d, "stepwatch_quality_psnr_decibels", probe_set="default", instance_id="standin-0", stat="p10")
    gate = value(d, "stepwatch_quality_gate_decibels", probe_set="default")
    assert p10 < gate - Q.alert_margin_db  # exactly the QualityDrop expression
    assert value(d, "stepwatch_quality_ssim_ratio", probe_set="default", instance_id="standin-0",
                 stat="p10") < Q.ssim_gate["image"]
    assert any("BELOW the quality gate" in r.getMessage() for r in caplog.records)
    # Restore: recovers.
    standin.sigma, standin.perturb_prompts = 0.0, None
    res = p.run_once()
    assert res.psnr["p10"] == math.inf and not res.below_alert
    d = scrape(registry)
    assert value(d, "stepwatch_quality_psnr_decibels", probe_set="default", instance_id="standin-0",
                 stat="p10") == math.inf
    assert value(d, "stepwatch_quality_probe_runs_total", probe_set="default") == 3


def test_fingerprint_change_is_stale_with_no_psnr(standin: StandIn, registry: CollectorRegistry,
                                                  tmp_path: Path) -> None:
    capture_baseline(standin.url, SMALL, tmp_path)
    p = make(standin, registry, tmp_path)
    assert p.run_once().status == "ok"
    assert psnr_series(scrape(registry))
    standin.fingerprint = {**standin.fingerprint, "torch": "2.14.0"}  # a library upgrade
    standin.sigma = 30.0  # and the images differ, as they may across deployments
    n = len(standin.requests)
    res = p.run_once()
    assert res.status == "stale" and res.stale and res.psnr == {}
    assert len(standin.requests) == n  # no GPU time spent on probes that cannot be compared
    d = scrape(registry)
    assert value(d, "stepwatch_quality_baseline_stale", probe_set="default") == 1
    assert value(d, "stepwatch_quality_baseline_ok", probe_set="default") == 1  # the stored one is intact
    assert psnr_series(d) == {}  # no PSNR -> no false quality alert
    assert not any(n == "stepwatch_quality_ssim_ratio" for n, _ in d)
    assert total(d, "stepwatch_quality_probe_failures_total") == 0
    # A new capture for the new deployment clears it.
    capture_baseline(standin.url, SMALL, tmp_path)
    res = p.run_once()
    assert res.status == "ok" and res.psnr["p10"] == math.inf
    assert value(scrape(registry), "stepwatch_quality_baseline_stale", probe_set="default") == 0


def test_a_warming_service_is_neither_scored_nor_stale(standin: StandIn, registry: CollectorRegistry,
                                                     tmp_path: Path) -> None:
    """A restart's warm-up answers an empty fingerprint and ready false: the run measures nothing and concludes
    nothing (no stale baseline, no failure, the last PSNR kept); once ready, the same baseline scores again."""
    capture_baseline(standin.url, SMALL, tmp_path)
    p = make(standin, registry, tmp_path)
    assert p.run_once().status == "ok"
    before = psnr_series(scrape(registry))
    fingerprint, standin.fingerprint, standin.ready = standin.fingerprint, {}, False
    n = len(standin.requests)
    res = p.run_once()
    assert res.status == "not_ready" and not res.stale and len(standin.requests) == n
    d = scrape(registry)
    assert value(d, "stepwatch_quality_baseline_stale", probe_set="default") == 0
    assert total(d, "stepwatch_quality_probe_failures_total") == 0
    assert value(d, "stepwatch_quality_probe_runs_total", probe_set="default") == 1
    assert psnr_series(d) == before
    standin.fingerprint, standin.ready = fingerprint, True
    assert p.run_once().status == "ok"


def test_target_down_counts_failures_and_survives(standin: StandIn, registry: CollectorRegistry,
                                                  tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    capture_baseline(standin.url, SMALL, tmp_path)
    p = make(standin, registry, tmp_path, not_ready_grace_s=0)  # down at once: no restart grace
    assert p.run_once().status == "ok"
    standin.stop()
    with caplog.at_level(logging.WARNING, logger="stepwatch.sidecar.prober"):
        r1 = p.run_once()
        r2 = p.run_once()
    assert r1.status == r2.status == "failed"
    assert r1.failures == {"connect": 1}
    d = scrape(registry)
    assert value(d, "stepwatch_quality_probe_failures_total", probe_set="default", reason="connect") == 2
    assert value(d, "stepwatch_quality_probe_runs_total", probe_set="default") == 1
    # The last measured values stay (their age shows in last_success); the log says it once.
    assert value(d, "stepwatch_quality_psnr_decibels", probe_set="default", instance_id="standin-0",
                 stat="p10") == math.inf
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1


def test_a_restart_is_no_failure_and_no_staleness_within_the_grace(standin: StandIn, registry: CollectorRegistry,
                                                                   tmp_path: Path) -> None:
    """Nothing listening is a restart until the grace runs out: no failure counted, the not-ready time exported
    (the probe-failing alert's no-success arm waits on it); past the grace it counts as failing."""
    capture_baseline(standin.url, SMALL, tmp_path)
    now = [1000.0]
    p = make(standin, registry, tmp_path, not_ready_grace_s=60, wallclock=lambda: now[0])
    assert p.run_once().status == "ok"
    standin.stop()
    now[0] = 1010.0
    r = p.run_once()
    assert r.status == "not_ready" and r.failures == {}
    d = scrape(registry)
    assert total(d, "stepwatch_quality_probe_failures_total") == 0
    assert value(d, "stepwatch_quality_target_not_ready_timestamp_seconds", probe_set="default") >= 1010.0
    now[0] = 1069.0
    assert p.run_once().status == "not_ready"
    now[0] = 1071.0
    r = p.run_once()
    assert r.status == "failed" and r.failures == {"connect": 1}
    assert value(scrape(registry), "stepwatch_quality_probe_failures_total", probe_set="default",
                 reason="connect") == 1


def test_a_warm_up_past_the_grace_fails_and_ready_starts_a_new_spell(standin: StandIn, registry: CollectorRegistry,
                                                                     tmp_path: Path) -> None:
    capture_baseline(standin.url, SMALL, tmp_path)
    now = [1000.0]
    p = make(standin, registry, tmp_path, not_ready_grace_s=60, wallclock=lambda: now[0])
    standin.ready = False
    assert p.run_once().status == "not_ready"
    now[0] = 1061.0
    assert p.run_once().failures == {"not_ready": 1}
    standin.ready = True
    assert p.run_once().status == "ok"
    standin.ready = False
    now[0] = 1100.0
    assert p.run_once().status == "not_ready"  # a new spell: its grace counts from now


def test_a_set_cut_by_a_restart_is_no_failure(standin: StandIn, registry: CollectorRegistry, tmp_path: Path) -> None:
    """The service goes away mid-set and then refuses connections (a restart): the cut probe is no failure,
    nothing is exported as measured (the partial set is dropped).  Past the grace the same cut counts (below);
    a 503 from a service that still answers ready counts at once (the bounded-reasons test)."""
    capture_baseline(standin.url, SMALL, tmp_path)
    p = make(standin, registry, tmp_path)
    standin.die_after = 5
    res = p.run_once()
    assert res.status == "not_ready" and res.failures == {} and len(res.scored) == 5
    d = scrape(registry)
    assert total(d, "stepwatch_quality_probe_failures_total") == 0
    assert value(d, "stepwatch_quality_probe_runs_total", probe_set="default") == 0


def test_service_killed_mid_set_counts_the_failure(standin: StandIn, registry: CollectorRegistry,
                                                   tmp_path: Path) -> None:
    capture_baseline(standin.url, SMALL, tmp_path)
    p = make(standin, registry, tmp_path, not_ready_grace_s=0)  # killed for good: no restart grace
    standin.die_after = 5
    res = p.run_once()
    assert res.status == "partial" and len(res.scored) == 5
    assert res.failures == {"connect": 1}  # the rest of the set is skipped, not counted 15 times
    d = scrape(registry)
    assert value(d, "stepwatch_quality_probe_failures_total", probe_set="default", reason="connect") == 1
    assert value(d, "stepwatch_quality_probe_runs_total", probe_set="default") == 1
    assert p.run_once().status == "failed"  # and the next run finds it down, without raising


def test_slow_target_times_out_bounded(standin: StandIn, registry: CollectorRegistry, tmp_path: Path) -> None:
    capture_baseline(standin.url, SMALL, tmp_path)
    p = make(standin, registry, tmp_path, timeout_s=0.3)
    standin.delay_s = 1.5
    t0 = time.monotonic()
    res = p.run_once()
    assert time.monotonic() - t0 < 3.0  # three timeouts in a row end the set
    assert res.status == "failed" and res.failures == {"timeout": 3}
    d = scrape(registry)
    assert value(d, "stepwatch_quality_probe_failures_total", probe_set="default", reason="timeout") == 3


def test_http_errors_and_bad_answers_have_bounded_reasons(standin: StandIn, registry: CollectorRegistry,
                                                          tmp_path: Path) -> None:
    ps = parse_probe_set({"name": "two", "size": "32x32", "steps": 2, "prompts": ["a"], "seeds": [0, 1]})
    capture_baseline(standin.url, ps, tmp_path)
    p = make(standin, registry, tmp_path, probe_set=ps)
    standin.fail_code = 503
    assert p.run_once().failures == {"http_503": 1}  # unavailable: the rest of the set is skipped
    standin.fail_code = 418
    assert p.run_once().failures == {"http_other": 2}
    standin.fail_code, standin.garbage = None, True
    assert p.run_once().failures == {"bad_response": 2}
    d = scrape(registry)
    for reason, n in (("http_503", 1), ("http_other", 2), ("bad_response", 2), ("connect", 0)):
        assert value(d, "stepwatch_quality_probe_failures_total", probe_set="two", reason=reason) == n


def test_missing_or_corrupted_baseline_is_an_error_state(standin: StandIn, registry: CollectorRegistry,
                                                         tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = make(standin, registry, tmp_path)
    with caplog.at_level(logging.WARNING, logger="stepwatch.sidecar.prober"):
        res = p.run_once()
    assert res.status == "baseline_error" and "no baseline for probe set 'default'" in (res.error or "")
    d = scrape(registry)
    assert value(d, "stepwatch_quality_baseline_ok", probe_set="default") == 0
    assert value(d, "stepwatch_quality_probe_failures_total", probe_set="default", reason="baseline") == 1
    cap = capture_baseline(standin.url, SMALL, tmp_path)
    assert p.run_once().status == "ok"
    victim = cap.path / "images" / "007.png"
    victim.write_bytes(victim.read_bytes()[:-10])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stepwatch.sidecar.prober"):
        res = p.run_once()
    assert res.status == "baseline_error"
    d = scrape(registry)
    assert value(d, "stepwatch_quality_baseline_ok", probe_set="default") == 0
    assert psnr_series(d) == {}  # old values dropped: nothing to alert on from a broken baseline
    msgs = [r.getMessage() for r in caplog.records]
    assert any(str(victim) in m and "checksum mismatch" in m for m in msgs)


def test_per_instance_quantiles_behind_a_balancer(standin: StandIn, registry: CollectorRegistry,
                                                  tmp_path: Path) -> None:
    capture_baseline(standin.url, SMALL, tmp_path)
    standin.instances = ("pod-a", "pod-b")
    standin.sigma, standin.perturb_instances = 20.0, {"pod-b"}  # one bad instance (an FP8 scale, say)
    p = make(standin, registry, tmp_path)
    res = p.run_once()
    assert set(res.per_instance) == {"pod-a", "pod-b"}
    assert res.per_instance["pod-a"]["psnr"]["p10"] == math.inf
    assert res.per_instance["pod-b"]["psnr"]["p10"] < Q.alert_below("lossy_ii")
    s = psnr_series(scrape(registry))
    assert s[("pod-a", "p10")] == math.inf and s[("pod-b", "p10")] < Q.alert_below("lossy_ii")
    assert ("standin-0", "p10") not in s
    # An instance answering with another deployment's fingerprint is stale, not a quality loss.
    standin.response_fingerprints = {"pod-b": "0123456789abcdef"}
    res = p.run_once()
    assert res.status == "partial" and res.stale
    d = scrape(registry)
    assert set(psnr_series(d)) == {("pod-a", q) for q in ("p50", "p10", "min")}
    assert value(d, "stepwatch_quality_baseline_stale", probe_set="default") == 1


def test_video_probe_reports_the_worst_frame(standin: StandIn, registry: CollectorRegistry, tmp_path: Path) -> None:
    ps = parse_probe_set({"name": "clips", "size": "32x32", "steps": 4, "frames": 5, "prompts": ["a wave"],
                          "seeds": [0, 1]})
    capture_baseline(standin.url, ps, tmp_path)
    p = make(standin, registry, tmp_path, probe_set=ps)
    assert p.gate_kind == "video" and p.gate_db == Q.video_psnr_gate_db
    assert p.ssim_gate == Q.ssim_gate["video"]
    # Video probes travel as H.264 (crf 18), which smooths part of the noise: sigma 40 lands below the gate.
    standin.sigma, standin.perturb_seeds, standin.perturb_frames = 40.0, {1}, {3}
    res = p.run_once()
    worst = min(res.scored, key=lambda i: i.psnr or 0.0)
    assert worst.item_id == "001" and worst.frames == 5 and worst.worst_frame == 3
    assert res.psnr["min"] == worst.psnr < Q.video_psnr_gate_db
    assert value(scrape(registry), "stepwatch_quality_gate_decibels", probe_set="clips") == Q.video_psnr_gate_db


def test_video_probes_are_jobs_scored_frame_by_frame(standin: StandIn, registry: CollectorRegistry,
                                                     tmp_path: Path) -> None:
    """A video probe runs as a job (POST /v1/videos, poll, download the MP4); the set's stats are over frames: 2
    videos x 5 frames, one frame perturbed -> min and p10 are that frame, p50 far above it; the SSIM gate
    the alert reads is the video gate (an image set's is 0: gated on PSNR only)."""
    ps = parse_probe_set({"name": "clips", "size": "32x32", "steps": 4, "frames": 5, "prompts": ["a wave"],
                          "seeds": [0, 1]})
    capture_baseline(standin.url, ps, tmp_path)
    assert all(r.get("frames") == 5 for r in standin.requests) and len(standin.videos) >= 2
    p = make(standin, registry, tmp_path, probe_set=ps)
    standin.sigma, standin.perturb_seeds, standin.perturb_frames = 40.0, {1}, {2}
    res = p.run_once()
    assert res.status == "ok" and len(res.scored) == 2
    worst = min(res.scored, key=lambda i: i.ssim or 0.0)
    assert worst.item_id == "001" and worst.worst_ssim_frame == 2 and len(worst.frame_ssim) == 5
    assert res.ssim["min"] == res.ssim["p10"] == worst.frame_ssim[2] < Q.ssim_gate["video"]
    # The codec carries a little of the noisy frame into the frames that reference it; the median stays far up.
    assert res.psnr["p50"] > Q.video_psnr_gate_db + 5 and res.psnr["min"] == worst.frame_psnr[2]
    d = scrape(registry)
    assert value(d, "stepwatch_quality_ssim_ratio", probe_set="clips", instance_id="standin-0", stat="min") \
        == pytest.approx(worst.frame_ssim[2])
    assert value(d, "stepwatch_quality_ssim_gate_ratio", probe_set="clips") == Q.ssim_gate["video"]
    other = CollectorRegistry()
    make(standin, other, tmp_path / "img")
    assert value(scrape(other), "stepwatch_quality_ssim_gate_ratio", probe_set="default") == 0


def test_cadence_follows_the_budget(standin: StandIn, registry: CollectorRegistry, tmp_path: Path) -> None:
    standin.seconds_per_image = 0.16  # 20 probes = 3.2 s of service time
    capture_baseline(standin.url, SMALL, tmp_path)
    p = make(standin, registry, tmp_path)
    assert p.cadence().source == "unknown"
    p.run_once()
    cad = p.cadence()
    assert cad.source == "budget"
    assert cad.interval_s == pytest.approx(3.2 / Q.probe_budget_ratio)  # 320 s at 1%
    assert "probe set 'default' costs 3.2 GPU-s" in cad.text
    assert f"at {Q.probe_budget_ratio * 100:g}% budget the cadence is every 320 s" in cad.text
    # Timeout: a few seconds beyond the slowest request seen.
    slowest = max(i.wall_seconds or 0 for i in p.last_result.images)
    assert p.request_timeout() == pytest.approx(slowest + 5.0)
    fixed = make(standin, CollectorRegistry(), tmp_path, interval_s=10.0)
    fixed.run_once()
    assert fixed.cadence().interval_s == 10.0 and "above the 1% budget" in fixed.cadence().text


def test_run_forever_stops_promptly(standin: StandIn, registry: CollectorRegistry, tmp_path: Path) -> None:
    capture_baseline(standin.url, SMALL, tmp_path)
    p = make(standin, registry, tmp_path, interval_s=0.05, min_interval_s=0.01)
    stop = threading.Event()
    t = threading.Thread(target=p.run_forever, args=(stop,))
    try:
        t.start()
        deadline = time.monotonic() + 10
        runs = "stepwatch_quality_probe_runs_total"
        while absent(d := scrape(registry), runs, probe_set="default") or value(d, runs, probe_set="default") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        stop.set()
        t.join(timeout=5)
        assert not t.is_alive()
        # The cadence in force is exported for the "no success for 3 intervals" alert.
        assert value(scrape(registry), "stepwatch_quality_probe_interval_seconds", probe_set="default") == 0.05
    finally:
        stop.set()
        t.join(timeout=5)
        p.close()


def test_capture_refuses_a_nondeterministic_or_unready_service(standin: StandIn, tmp_path: Path) -> None:
    ps = parse_probe_set({"name": "one", "size": "32x32", "prompts": ["a"], "seeds": [0]})
    standin.ready = False
    with pytest.raises(CaptureError, match="not ready"):
        capture_baseline(standin.url, ps, tmp_path)
    standin.ready = True
    original = standin.generate
    calls = [0]

    def drifting(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        calls[0] += 1
        standin.sigma = 5.0 if calls[0] > 1 else 0.0
        return original(body)

    standin.generate = drifting  # type: ignore[method-assign]
    with pytest.raises(CaptureError, match="not deterministic"):
        capture_baseline(standin.url, ps, tmp_path)
    assert not (tmp_path / "one").exists() or not any((tmp_path / "one").iterdir())
