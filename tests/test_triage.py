"""Triage engine units: alert formats, flow and ranking, grouping, reports, and Prometheus down.

A stub Prometheus answers each runbook query by the series it names, so these
run in well under a second; tests/test_triage_replay.py runs the engine on
real recorded data in a real Prometheus.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from stepwatch import httpclient
from stepwatch.alerts import rulegen
from stepwatch.procs import free_port
from stepwatch.promapi import PromError, Sample
from stepwatch.runbooks.parse import CAUSES, load_all
from stepwatch.thresholds import load
from stepwatch.triage import render
from stepwatch.triage.alert import Alert, alerts_from_webhook, webhook_payload
from stepwatch.triage.cli_run import parse_time
from stepwatch.triage.diagnosis import Diagnosis, mitigation_for
from stepwatch.triage.engine import SYMPTOM_QUERY_PREFIX, Engine, triage
from stepwatch.triage.incidents import group
from stepwatch.triage.receiver import TriageServer

TH = load()


# What Prometheus answers for the OOM runbook's kv_stage check of an alert of another stage (two different
# stage matchers): nothing.  First in a rule list, before the alert's own stage's rule, which would match too.
KV_STAGE_EMPTY: tuple[str, float | None] = (r'stage="kv_cache"', None)


class StubProm:
    """Answers a query with the value of the first rule whose pattern it matches (no match: no samples).

    A rule's value is a number (one sample without labels), a Sample (labels too) or None (no samples).
    The alert's own condition (the engine's symptom query) holds unless ``symptom`` is False.
    """

    url = "http://stub:9090"

    def __init__(self, rules: Sequence[tuple[str, float | Sample | None]], symptom: bool = True) -> None:
        self.rules = rules
        self.symptom = symptom
        self.queries: list[tuple[str, float | None]] = []

    def query(self, expr: str, at: float | None = None) -> list[Sample]:
        self.queries.append((expr, at))
        if expr == "vector(1)":
            return [Sample({}, 1.0)]
        if expr.startswith(SYMPTOM_QUERY_PREFIX):
            return [Sample({}, 3.0)] if self.symptom else []
        for pattern, value in self.rules:
            if re.search(pattern, expr, re.S):
                return [] if value is None else [value if isinstance(value, Sample) else Sample({}, value)]
        return []


def _alert(key: str, profile: str = "drill", **labels: str) -> Alert:
    spec = TH.alert(key)
    ann = rulegen.alert_annotations(TH, spec, profile)
    return Alert(spec.name, {"alertname": spec.name, "job": "stepwatch-service",
                             **rulegen.alert_labels(spec, profile), **labels}, ann, "2026-01-01T00:00:00Z")


STRAGGLER = [
    (r"ratio_to_fastest_rate1m", 0.62),  # step-time-regression #1: busy-time skew
    (r"rate\(stepwatch_rank_busy_seconds_total\{[^}]*rank=", 0.58),  # rank-skew: still slow now (recent busy time)
    (r"stepwatch_gpu_", None),  # no NVML on this host
    (r"stepwatch_quality_baseline_stale", 0.0),
    (r"compile=~", None),
]


def test_alert_formats_parse_alike() -> None:
    labels = {"alertname": "StepwatchRankSkew", "instance": "10.0.0.1:8000", "rank": "1", "severity": "warning"}
    webhook = {"status": "firing", "labels": labels, "annotations": {"panel": "p"}, "startsAt": "t0"}
    am_v2 = {"status": {"state": "active"}, "labels": labels, "annotations": {"panel": "p"}, "startsAt": "t0"}
    prom = {"state": "firing", "labels": labels, "annotations": {"panel": "p"}, "activeAt": "t0", "value": "1.6"}
    parsed = [Alert.parse(x) for x in (webhook, am_v2, prom)]
    assert parsed[0] == parsed[1] == parsed[2]
    a = parsed[0]
    assert (a.name, a.host, a.severity, a.status) == ("StepwatchRankSkew", "10.0.0.1", "warning", "firing")
    assert a.short() == "StepwatchRankSkew{instance=10.0.0.1:8000, rank=1}"
    resolved = {**webhook, "status": "resolved"}
    assert alerts_from_webhook({"alerts": [webhook, resolved]}) == [a]
    assert webhook_payload([a])["alerts"][0]["labels"] == labels


def test_straggler_alerts_share_one_incident_with_evidence() -> None:
    skew = _alert("rank_skew", instance="127.0.0.1:8000", rank="1")
    step = _alert("step_time_regression", instance="127.0.0.1:8000", shape="512x512_8s")
    other_host = _alert("rank_skew", instance="10.9.9.9:8000", rank="0")
    prom = StubProm(STRAGGLER)
    report = Engine(prom, TH, at=1_700_000_000.0).run([skew, step, other_host])  # type: ignore[arg-type]
    assert report.status == "incidents"
    assert all(at == 1_700_000_000.0 for _, at in prom.queries)  # replay time reaches every query
    assert len(report.incidents) == 2  # same cause, two hosts: two incidents
    inc = report.incident_for("StepwatchStepTimeRegression")
    assert inc is not None and inc is report.incident_for("StepwatchRankSkew")
    assert inc.cause == "straggler_rank" and inc.confidence == "high"
    assert {a.key for a in inc.alerts} == {skew.key, step.key}
    assert inc.primary.alert.name == "StepwatchRankSkew"  # equal severity: the more certain first
    ev = inc.evidence(4)
    assert [(c.runbook, c.id, c.outcome) for c in ev[:2]] == [("rank-skew.md", "still_slow", "unhealthy"),
                                                              ("step-time-regression.md", "rank_skew", "unhealthy")]
    assert ev[0].value_text() == "0.58" and ev[0].condition == "<= 0.1"
    assert 'rank="1"' in ev[0].query and 'instance="127.0.0.1:8000"' in ev[0].query
    skew_diag = next(d for d in inc.diagnoses if d.alert.name == "StepwatchRankSkew")
    assert skew_diag.path == ["throttled", "clock_low", "still_slow"]
    assert [c.id for c in skew_diag.no_data()] == ["throttled", "clock_low"]
    step_diag = next(d for d in inc.diagnoses if d.alert.name == "StepwatchStepTimeRegression")
    assert step_diag.path == ["gpu_throttle", "rank_skew"] and step_diag.cause == "straggler_rank"
    assert "Straggler" in step_diag.next_step()
    assert inc.to_json()["runbook_url"].endswith("rank-skew.md#stepwatchrankskew")
    assert inc.to_json()["panel"] == TH.alert("rank_skew").panel


def test_oom_and_memory_pressure_group_and_error_ratio_joins_them() -> None:
    rules: list[tuple[str, float | None]] = [
        (r'stage="vae_decode".*/ on \(\)', 3.5),  # memory-pressure #1: the decode peak over the denoise peak
        KV_STAGE_EMPTY,
        (r'stepwatch_oom_total.*stage="vae_decode"', 1.0),
        (r'vae_tiling=~', 1.0),
        (r'code="507"', 1.0),
    ]
    mem = _alert("memory_pressure", instance="127.0.0.1:8000", device="cpu")
    oom = _alert("oom", instance="127.0.0.1:8000", shape="other", stage="vae_decode")
    err = _alert("error_ratio", pool="large")
    report = Engine(StubProm(rules), TH).run([mem, oom, err])  # type: ignore[arg-type]
    assert len(report.incidents) == 1
    inc = report.incidents[0]
    assert inc.cause == "vae_tiling_off"
    assert [a.name for a in inc.alerts] == ["StepwatchMemoryPressure", "StepwatchOutOfMemory",
                                            "StepwatchRequestErrorRatio"]
    assert inc.severity == "critical" and inc.primary.alert.name == "StepwatchOutOfMemory"
    # The error ratio's own runbook says "mostly OOMs"; the OOM incident says why.
    assert [d.alert.name for d in inc.followers] == ["StepwatchRequestErrorRatio"]
    err_diag = inc.followers[0]
    assert err_diag.cause == "out_of_memory" and err_diag.path == ["mostly_oom"]
    assert report.incident_for("StepwatchRequestErrorRatio") is inc


def test_ranking_weighs_checks_for_and_against() -> None:
    # Quality drop: fingerprint fine, instances alike, hits up -> the cache; the other causes ruled out.
    rules: list[tuple[str, float | None]] = [
        (r"baseline_stale", 0.0), (r"max\(\s*stepwatch_quality_psnr_decibels[\s\S]*- min", 0.4),
        (r"hit_ratio_rate1m", 2.1), (r"histogram_quantile", 0.6), (r'knob="cache_threshold"', 1.0),
        (r'knob="cache"', 0.0)]
    qd = _alert("quality_drop", instance="127.0.0.1:9465", probe_set="default", instance_id="svc", stat="p10")
    report = triage([qd], StubProm(rules), thresholds=TH)  # type: ignore[arg-type]
    d = report.incidents[0].diagnoses[0]
    assert d.cause == "cache_threshold_too_high" and d.confidence == "high"
    assert d.path == ["fingerprint", "one_instance", "rolled_out", "hits_up"]
    top = d.candidates[0]
    assert top.cause == "cache_threshold_too_high" and top.reached
    assert [c.id for c in top.support] == ["hits_up", "cache_knob"]  # late_hits healthy: 0.6
    assert [c.id for c in top.against] == ["late_hits"]
    assert top.score == 3 + 2 - 1
    assert {c: by.id for c, by in d.ruled_out()} == {"fingerprint_changed": "fingerprint",
                                                      "bad_instance": "one_instance",
                                                      "config_changed": "cache_kind"}


def test_no_data_is_not_evidence() -> None:
    # Nothing answers: every check is "no data"; the flow may still reach a cause through the
    # healthy branches, but only with low confidence, and no check counts for or against it.
    rec = _alert("recompile", instance="127.0.0.1:8000", shape="other", phase="serving")
    rules: list[tuple[str, float | None]] = [(r"phase=\"warmup\"", None)]
    d = triage([rec], StubProm(rules), thresholds=TH).incidents[0].diagnoses[0]
    # warmed_up says "empty: healthy": a shape never compiled in warm-up is the usual case.
    assert d.cause == "recompile_unwarmed_shape" and d.checks[0].outcome == "healthy"
    qd = _alert("quality_drop", instance="h:1", probe_set="default", instance_id="x", stat="p10")
    d = triage([qd], StubProm([]), thresholds=TH).incidents[0].diagnoses[0]
    assert d.cause is None and d.flow_end == "end" and d.confidence == "none"
    assert all(not c.support for c in d.candidates)
    assert not any(c.against for c in d.candidates)  # no check of quality-drop.md reads "empty" as healthy
    assert "escalate" in d.next_step()


def test_unknown_alert_and_all_clear() -> None:
    foreign = Alert("NodeDiskFull", {"alertname": "NodeDiskFull", "instance": "n1:9100", "severity": "warning"})
    report = triage([foreign], StubProm([]), thresholds=TH)  # type: ignore[arg-type]
    inc = report.incidents[0]
    assert inc.cause is None and inc.primary.error == "no runbook for NodeDiskFull"
    assert "NO CAUSE FOUND" in render.terminal(report)
    clear = triage([], StubProm([]), thresholds=TH)  # type: ignore[arg-type]
    assert clear.status == "all_clear" and render.terminal(clear).startswith("ALL CLEAR")


def test_prometheus_down_could_not_check() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # free: nothing listens there
    skew = _alert("rank_skew", instance="127.0.0.1:8000", rank="1")
    report = triage([skew], url, thresholds=TH)
    assert report.status == "could_not_check" and report.prometheus_error
    inc = report.incidents[0]
    assert inc.could_not_check and inc.cause is None
    assert all(c.outcome == "error" and c.value_text() == "could not check" for c in inc.diagnoses[0].checks)
    text = render.terminal(report)
    assert text.startswith("COULD NOT CHECK: Prometheus at") and "LIKELY CAUSE" not in text
    assert json.loads(render.as_json(report))["status"] == "could_not_check"


@pytest.mark.parametrize("fmt", ["terminal", "json"])
def test_cli_run_prometheus_down_exits_3_without_traceback(fmt: str) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # free: nothing listens there
    r = subprocess.run([sys.executable, "-m", "stepwatch.cli", "triage", "run", "--prometheus", url, "--format", fmt],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    if fmt == "json":
        assert json.loads(r.stdout)["status"] == "could_not_check"
    else:
        assert r.stdout.startswith("COULD NOT CHECK: Prometheus did not answer")


def test_terminal_output_cause_first_no_color_off_tty() -> None:
    skew = _alert("rank_skew", instance="127.0.0.1:8000", rank="1")
    report = Engine(StubProm(STRAGGLER), TH).run([skew])  # type: ignore[arg-type]
    text = render.terminal(report)
    lines = text.splitlines()
    assert lines[2].startswith("LIKELY CAUSE: straggler_rank") and "[WARNING]" in lines[2]
    assert lines[3].strip() == CAUSES["straggler_rank"]
    assert any(line.startswith("  next: Straggler without throttling") for line in lines)
    assert any(line.startswith("  runbook: https://") for line in lines)
    assert "\033[" not in text
    assert "\033[31m" in render.terminal(report, color=True) or "\033[33m" in render.terminal(report, color=True)
    md = render.markdown(report)
    assert md.startswith("# stepwatch triage: incidents") and "`straggler_rank`" in md and "| ✗ |" in md


def test_every_runbook_cause_has_a_mitigation_line() -> None:
    for rb in load_all().values():
        for cause in rb.causes():
            line = mitigation_for(rb.sections["Mitigation"], cause)
            assert f"(`{cause}`" in line or f", `{cause}`" in line, (rb.file, cause)  # tagged bullets
    qd = load_all()["StepwatchQualityDrop"].sections["Mitigation"]
    assert mitigation_for(qd, "end").startswith("Nothing found (end): FP8")
    assert mitigation_for(qd, "host_down") == ""


def test_parse_time() -> None:
    assert parse_time("1700000000.5") == 1700000000.5
    assert parse_time("2023-11-14T22:13:20Z") == 1700000000.0
    assert parse_time("-10m", now=1000.0) == 400.0
    with pytest.raises(ValueError, match="not unix seconds"):
        parse_time("yesterday")


def test_query_errors_are_contained() -> None:
    class Broken(StubProm):
        def query(self, expr: str, at: float | None = None) -> list[Sample]:
            if expr == "vector(1)":
                return [Sample({}, 1.0)]
            raise PromError("query: bad_data: parse error")

    skew = _alert("rank_skew", instance="127.0.0.1:8000", rank="1")
    report = Engine(Broken([]), TH).run([skew])  # type: ignore[arg-type]
    d = report.incidents[0].diagnoses[0]
    assert d.could_not_check and d.error is not None and "parse error" in d.error
    assert report.status == "could_not_check"



# ----- a failing probe joined to the incident that explains it (quality-probe-failing.md #3-#6) -----

SVC = "127.0.0.1:8000"  # the service; its sidecar (the prober) runs on the same host, port 9465


def _probe(reason: str = "timeout") -> Alert:
    return _alert("probe_failing", job="stepwatch-sidecar", instance="127.0.0.1:9465", probe_set="default",
                  reason=reason)


def _probe_world(stall: float | None, *, answers: float | None = 1.0, ranks: float | None = None,
                 restarts: float = 0.0, ready: float = 1.0, timeouts: float = 0.0,
                 rewarm: float = 0.0) -> list[tuple[str, Any]]:
    """The host as the probe runbook and the stall runbook read it: ``stall`` is the worker's time on its
    generation over the stall limit (None: a service without the gauges); ``rewarm`` its warm-up compiles
    in the window."""
    return [
        (r'phase="warmup"', rewarm),
        (r"max_over_time\(\(\s*stepwatch_worker_busy_seconds",
         None if stall is None else Sample({"instance": SVC, "pool": "small"}, stall)),
        (r"stepwatch_exporter_build_info", answers),
        (r"stepwatch_rank_steps_total", ranks),
        (r"stepwatch_worker_restarts_total", restarts),
        (r"stepwatch_worker_up", 1.0),
        (r"stepwatch_service_ready", ready),
        (r'reason="timeout"', timeouts),
        (r'reason="baseline"', 0.0),
        (r"^min\(up\{", 1.0),
    ]


def test_probe_timeouts_behind_a_stalled_worker_follow_the_stall() -> None:
    # Frozen worker (its metrics gone), the stall alert firing: the probe's timeouts are the stall's, not a queue's.
    stall = _alert("worker_stalled", instance=SVC, pool="small")
    rules = _probe_world(1.75, answers=None, timeouts=3.0)
    report = Engine(StubProm(rules), TH).run([_probe(), stall])  # type: ignore[arg-type]
    assert len(report.incidents) == 1 and report.causes == ["worker_hung"]
    inc = report.incidents[0]
    assert inc.primary.alert.name == "StepwatchWorkerStalled" and inc.primary.path == ["alive", "answers"]
    assert [(d.alert.name, d.cause) for d in inc.followers] == [("StepwatchQualityProbeFailing", "worker_hung")]
    probe = inc.followers[0]
    assert probe.path == ["service_up", "baseline", "stalled", "stall_answers"]
    assert next(c for c in probe.checks if c.id == "timeouts").outcome == "unhealthy"  # off the path
    join = probe.explained_by
    assert join is not None and join.alert == "StepwatchWorkerStalled" and join.firing == stall.short()
    assert join.labels == {"instance": SVC, "pool": "small"} and join.check.id == "stalled"
    text = render.terminal(report)
    assert "queue_backlog" not in text
    assert ("follows from it: StepwatchQualityProbeFailing{instance=127.0.0.1:9465, probe_set=default, "
            "reason=timeout} (worker_hung; explained by StepwatchWorkerStalled{instance=127.0.0.1:8000, pool=small} "
            "(firing: the same incident; quality-probe-failing.md #3 stalled = 1.75))") in text
    j = report.to_json()["incidents"][0]
    assert [(x["symptom"], x["alert"], x["firing"]) for x in j["explained_by"]] == [
        (probe.alert.short(), "StepwatchWorkerStalled", stall.short())]
    assert "is explained by StepwatchWorkerStalled" in render.markdown(report)


@pytest.mark.parametrize(("starved", "cause"), [(0.8, "cpu_contention"), (0.1, "worker_hung"), (None, "worker_hung")])
def test_a_worker_slowed_past_the_stall_limit_by_a_neighbour_is_contention_not_a_hang(
        starved: float | None, cause: str) -> None:
    """A worker behind busy loops on its cores read 1.47x the stall limit, still answering and still stepping,
    and the stall flows called it hung.  Its waits per second run tell it apart; a frozen or collective-bound
    worker waits for nothing, and an exporter without the run counter leaves the flow as it was."""
    stall = _alert("worker_stalled", instance=SVC, pool="small")
    rules = [(r"cpu_run_seconds_total", starved), *_probe_world(1.5, timeouts=2.0)]
    report = Engine(StubProm(rules), TH).run([_probe(), stall])  # type: ignore[arg-type]
    assert report.causes == [cause] and len(report.incidents) == 1
    assert report.incidents[0].primary.path == ["alive", "answers", "ranks", "cpu_starved"]
    probe = triage([_probe()], StubProm(rules), thresholds=TH).incidents[0].primary  # type: ignore[arg-type]
    assert probe.cause == cause and "stall_cpu" in probe.path


def test_a_stall_of_several_ranks_is_not_asked_about_the_cpu() -> None:
    """Two ranks on two cores wait for each other's threads (0.28 s per second run at a frozen rank's stall in
    the two-rank stall drill, named cpu_contention if the question comes first): with 2+ ranks the rank is the
    answer."""
    rules = [(r"cpu_run_seconds_total", 0.8), *_probe_world(1.5, ranks=2.0, timeouts=2.0)]
    probe = triage([_probe()], StubProm(rules), thresholds=TH).incidents[0].primary  # type: ignore[arg-type]
    assert probe.cause == "collective_hang" and "stall_cpu" not in probe.path


def test_probe_failures_after_a_stall_name_it_when_its_alert_has_resolved() -> None:
    # The service restarted the worker at twice the limit (the stall alert resolved) and it warms up again:
    # the stall in the window still explains the probe, ahead of the restart and the warm-up it caused.
    rules = _probe_world(2.0, ranks=2.0, restarts=1.0, ready=0.0, timeouts=2.0)
    report = triage([_probe()], StubProm(rules), thresholds=TH)  # type: ignore[arg-type]
    inc = report.incidents[0]
    assert report.causes == ["collective_hang"] and inc.primary.path == [
        "service_up", "baseline", "stalled", "stall_answers", "stall_ranks"]
    join = inc.primary.explained_by
    assert join is not None and join.firing == ""
    assert join.short() == "StepwatchWorkerStalled{instance=127.0.0.1:8000, pool=small}"
    lines = render.terminal(report).splitlines()
    assert ("  StepwatchQualityProbeFailing{instance=127.0.0.1:9465, probe_set=default, reason=timeout} is explained "
            "by StepwatchWorkerStalled{instance=127.0.0.1:8000, pool=small} (not firing at the evaluation time; "
            "quality-probe-failing.md #3 stalled = 2)") in lines
    assert inc.to_json()["diagnoses"][0]["explained_by"]["labels"] == {"instance": SVC, "pool": "small"}


def test_probe_restart_without_a_stall_is_the_crash() -> None:
    """A restart with no stall in the window (a crash) is the crash's, ahead of the warm-up it causes."""
    prom = StubProm(_probe_world(0.02, restarts=1.0, ready=0.0))
    report = triage([_probe("http_503")], prom, thresholds=TH)  # type: ignore[arg-type]
    d = report.incidents[0].primary
    assert d.cause == "worker_crashed" and d.path[-2:] == ["stalled", "restarted"] and d.explained_by is None


def test_probe_timeouts_with_a_healthy_worker_are_still_the_queue() -> None:
    """Control: a real backlog (timeouts) behind a worker well within its limit stays ``queue_backlog``."""
    report = triage([_probe()], StubProm(_probe_world(0.08, timeouts=4.0)), thresholds=TH)  # type: ignore[arg-type]
    d = report.incidents[0].primary
    assert d.cause == "queue_backlog" and d.explained_by is None
    assert d.path == ["service_up", "baseline", "stalled", "restarted", "service_ready", "pipeline_errors",
                      "serving_compiles", "rewarmed", "slower", "timeouts"]
    assert "explained by" not in render.terminal(report)


@pytest.mark.parametrize("stall", [None, 0.0])  # a service without the stall gauges; an idle worker
def test_probe_failures_with_nothing_else_wrong_end_as_before(stall: float | None) -> None:
    """Control: bad answers and nothing else wrong end the walk without a cause, as without the stall checks."""
    report = triage([_probe("bad_response")], StubProm(_probe_world(stall)), thresholds=TH)  # type: ignore[arg-type]
    d = report.incidents[0].primary
    assert d.cause is None and d.flow_end == "end" and d.explained_by is None
    assert d.path == ["service_up", "baseline", "stalled", "restarted", "service_ready", "pipeline_errors",
                      "serving_compiles", "rewarmed", "slower", "timeouts"]
    assert "escalate" in d.next_step() and "sidecar log" in d.next_step()


# ----- a high queue wait joined to the worker stall that built it (queue-wait-high.md #1-#5) -----------

def _queue(pool: str = "small") -> Alert:
    return _alert("queue_wait", instance=SVC, pool=pool)


def _queue_world(stall: float | None, *, answers: float | None = 1.0, ranks: float | None = None,
                 pool_wide: float = 0.9, slower: float = 1.0, restarts: float = 0.0,
                 ready: float = 1.0) -> list[tuple[str, Any]]:
    """The service as the queue runbook and the stall runbook read it: ``stall`` is the worker's time on its
    generation over the stall limit (None: a service without the gauges); ``pool_wide`` the pool's least
    estimated wait / SLO (over the alert's threshold: every instance of the pool is over the line)."""
    return [
        (r"max_over_time\(\(\s*stepwatch_worker_busy_seconds",
         None if stall is None else Sample({"instance": SVC, "pool": "small"}, stall)),
        (r"stepwatch_exporter_build_info", answers),
        (r"stepwatch_rank_steps_total", ranks),
        (r"stepwatch_queue_estimated_wait_seconds:slo_ratio", pool_wide),
        (r"stepwatch_pipeline_step_duration_seconds_sum", slower),
        (r"stepwatch_worker_restarts_total", restarts),
        (r"stepwatch_worker_up", 1.0),
        (r"stepwatch_service_ready", ready),
    ]


def test_queue_behind_a_stalled_worker_follows_the_stall() -> None:
    # Frozen worker (its metrics gone), the stall alert firing, every instance of the pool over the line: the
    # queue grew behind the stuck generation, not for lack of capacity (not under_provisioned).
    stall = _alert("worker_stalled", instance=SVC, pool="small")
    rules = _queue_world(1.75, answers=None)
    report = Engine(StubProm(rules), TH).run([_queue(), stall])  # type: ignore[arg-type]
    assert len(report.incidents) == 1 and report.causes == ["worker_hung"]
    inc = report.incidents[0]
    assert inc.primary.alert.name == "StepwatchWorkerStalled" and inc.primary.path == ["alive", "answers"]
    assert [(d.alert.name, d.cause) for d in inc.followers] == [("StepwatchQueueWaitHigh", "worker_hung")]
    queue = inc.followers[0]
    assert queue.path == ["stalled", "stall_compiled", "stall_answers"] and queue.confidence == "high"
    assert next(c for c in queue.checks if c.id == "pool_wide").outcome == "unhealthy"  # off the path
    join = queue.explained_by
    assert join is not None and join.alert == "StepwatchWorkerStalled" and join.firing == stall.short()
    assert join.labels == {"instance": SVC, "pool": "small"} and join.check.id == "stalled"
    text = render.terminal(report)
    assert ("follows from it: StepwatchQueueWaitHigh{instance=127.0.0.1:8000, pool=small} (worker_hung; explained "
            "by StepwatchWorkerStalled{instance=127.0.0.1:8000, pool=small} (firing: the same incident; "
            "queue-wait-high.md #1 stalled = 1.75))") in text
    j = report.to_json()["incidents"][0]
    assert [(x["symptom"], x["alert"], x["firing"]) for x in j["explained_by"]] == [
        (queue.alert.short(), "StepwatchWorkerStalled", stall.short())]


def test_queue_after_a_stall_names_it_when_its_alert_has_resolved() -> None:
    # The service restarted the two-rank worker at twice the limit (the stall alert resolved) and the backlog
    # still drains: the stall in the lookback explains the queue, ahead of the restart it caused (not
    # worker_crashed).
    rules = _queue_world(2.0, ranks=2.0, restarts=1.0)
    report = triage([_queue()], StubProm(rules), thresholds=TH)  # type: ignore[arg-type]
    inc = report.incidents[0]
    assert report.causes == ["collective_hang"]
    assert inc.primary.path == ["stalled", "stall_compiled", "stall_answers", "stall_ranks"]
    assert next(c for c in inc.primary.checks if c.id == "restarts").outcome == "unhealthy"  # off the path
    join = inc.primary.explained_by
    assert join is not None and join.firing == ""
    assert join.short() == "StepwatchWorkerStalled{instance=127.0.0.1:8000, pool=small}"
    lines = render.terminal(report).splitlines()
    assert ("  StepwatchQueueWaitHigh{instance=127.0.0.1:8000, pool=small} is explained by "
            "StepwatchWorkerStalled{instance=127.0.0.1:8000, pool=small} (not firing at the evaluation time; "
            "queue-wait-high.md #1 stalled = 2)") in lines
    assert "Worker stalled" in inc.primary.next_step()


def test_queue_behind_a_long_compile_is_the_recompiles_not_a_hang() -> None:
    """A generation past the queue's line that compiled while serving: the recompile explains the wait (its
    own incident), not a hung worker."""
    recompile = _alert("recompile", instance=SVC, shape="512x512_8s", phase="serving")
    rules = [*_queue_world(1.5), (r"stepwatch_compile_total", 2.0)]
    report = Engine(StubProm(rules), TH).run([_queue(), recompile])  # type: ignore[arg-type]
    assert len(report.incidents) == 1 and report.causes == ["recompile_unwarmed_shape"]
    assert ("also firing (no cause of their own): StepwatchQueueWaitHigh{instance=127.0.0.1:8000, pool=small}"
            in render.terminal(report))
    alone = triage([_queue()], StubProm(rules), thresholds=TH).incidents[0].primary  # type: ignore[arg-type]
    assert alone.path == ["stalled", "stall_compiled"] and alone.cause is None and alone.flow_end == "end"


def test_queue_restart_without_a_stall_is_still_the_crash() -> None:
    """A restart with no stall in the lookback (a crash) stays ``worker_crashed``, as without the stall checks."""
    report = triage([_queue()], StubProm(_queue_world(0.02, restarts=1.0)), thresholds=TH)  # type: ignore[arg-type]
    d = report.incidents[0].primary
    assert (d.cause, d.confidence, d.explained_by) == ("worker_crashed", "high", None)
    assert d.path == ["stalled", "pool_short", "pool_wide", "slower", "restarts"]


@pytest.mark.parametrize("stall, pool_wide, cause, confidence, path", [
    # a real backlog behind a worker well within its limit: the whole pool short of capacity, or one instance
    # (the capacity rules have no series here: pool_short reads "not short" and the queues decide)
    (0.08, 0.9, "under_provisioned", "medium", ["pool_short", "pool_wide", "slower", "restarts", "not_ready"]),
    (0.08, 0.3, "queue_backlog", "medium", ["pool_short", "pool_wide"]),
    # nothing else wrong: a service without the stall gauges, an idle worker
    (None, 0.9, "under_provisioned", "medium", ["pool_short", "pool_wide", "slower", "restarts", "not_ready"]),
    (0.0, 0.9, "under_provisioned", "medium", ["pool_short", "pool_wide", "slower", "restarts", "not_ready"]),
])
def test_queue_with_a_healthy_worker_is_unchanged(stall: float | None, pool_wide: float, cause: str,
                                                  confidence: str, path: list[str]) -> None:
    """Controls: with no stall the queue runbook names what it named before the stall checks (the same cause,
    confidence and walk after the first check), and nothing is joined to the stall alert."""
    rules = _queue_world(stall, pool_wide=pool_wide)
    report = triage([_queue()], StubProm(rules), thresholds=TH)  # type: ignore[arg-type]
    d = report.incidents[0].primary
    assert (d.cause, d.confidence, d.explained_by) == (cause, confidence, None)
    assert d.path == ["stalled", *path]
    assert "explained by" not in render.terminal(report)


@pytest.mark.parametrize("needed, ready, cause", [
    (1.4, 3.0, "under_provisioned"),  # the pool short by the capacity formula: the first queue over is its
    (0.8, 3.0, "queue_backlog"),  # enough instances: the one queue over the line is a backlog in one place
    (1.4, 1.0, "queue_backlog"),  # a pool of one has nothing to size (the capacity alert's floor): a backlog
])
def test_queue_over_the_line_on_some_instances_of_a_short_pool_is_the_pool(needed: float, ready: float,
                                                                         cause: str) -> None:
    """Behind a balancer a short pool's queues cross the line one after another: only this instance over it
    (pool_wide healthy) is still the pool's shortage when its instances needed exceed those ready."""
    rules = [(r"needed_rate.*>= 2", None if ready < 2 else needed), *_queue_world(0.0, pool_wide=0.3)]
    d = triage([_queue()], StubProm(rules), thresholds=TH).incidents[0].primary  # type: ignore[arg-type]
    assert d.cause == cause
    assert d.path[:2] == ["stalled", "pool_short"]


# ----- the webhook receiver (triage serve) without a real Prometheus -------------------------------

def _prometheus_and_sink(forwarded: list[dict[str, Any]]) -> httpx.MockTransport:
    """In-process Prometheus (every query answers 1, no alert fires) and --forward target."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/reports":
            forwarded.append(json.loads(request.content))
            return httpx.Response(204)
        if request.url.path == "/api/v1/alerts":
            return httpx.Response(200, json={"status": "success", "data": {"alerts": []}})
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {}, "value": [0, "1"]}]}})

    return httpx.MockTransport(handler)


def _local_port(r: httpx.Response) -> int:
    return int(r.extensions["network_stream"].get_extra_info("client_addr")[1])


def test_receiver_answers_as_before_and_documents_itself(tmp_path: Path) -> None:
    server = TriageServer(f"http://127.0.0.1:{free_port()}", tmp_path, port=0)  # not started: no triage runs
    try:
        with TestClient(server.app) as c:
            assert (c.get("/healthz").status_code, c.get("/healthz").text) == (200, "ok\n")
            r = c.get("/latest")
            assert (r.status_code, r.json()) == (404, {})
            r = c.post("/alerts", content=b"[1,2")
            assert r.status_code == 400 and r.text.startswith("bad payload: ")
            r = c.post("/alerts", content=b'{"alerts": {}}')
            assert (r.status_code, r.text) == (400, "bad payload: not an Alertmanager webhook payload\n")
            assert (c.post("/alerts/", content=b"{}").text, server.queue.qsize()) == ("queued\n", 1)
            assert (c.post("/elsewhere").status_code, c.post("/elsewhere").text) == (
                404, "POST Alertmanager webhooks to /alerts\n")
            assert c.get("/nothing").text == "not found\n"
            r = c.put("/alerts")
            assert r.status_code == 405 and r.headers["allow"] == "POST"
            schema = c.get("/openapi.json").json()
            assert {"/alerts", "/healthz", "/latest"} <= set(schema["paths"])
            body = schema["paths"]["/alerts"]["post"]["requestBody"]["content"]["application/json"]["schema"]
            assert "alerts" in body["properties"]
    finally:
        server.stop()


def test_receiver_serves_triages_and_forwards_over_keep_alive(tmp_path: Path) -> None:
    forwarded: list[dict[str, Any]] = []
    with httpclient.use_transport(_prometheus_and_sink(forwarded)):  # Prometheus and the sink in-process
        server = TriageServer("http://prom.test:9090", tmp_path, port=0, forward="http://sink.test/reports")
    server.start()
    try:
        skew = _alert("rank_skew", instance="127.0.0.1:8000", rank="1")
        with httpclient.client(base_url=server.url, timeout=5.0) as c:
            queued = c.post("/alerts", json=webhook_payload([skew]))
            assert queued.text == "queued\n"
            deadline = time.time() + 10
            while not forwarded and time.time() < deadline:
                time.sleep(0.01)
            latest = c.get("/latest")
            assert latest.status_code == 200 and _local_port(latest) == _local_port(queued)  # one connection
        assert forwarded and forwarded[0] == latest.json() == json.loads((tmp_path / "latest.json").read_text())
        assert forwarded[0]["notification"]["alerts"] == [skew.short()]
        assert [w["status"] for w in server.written] == [forwarded[0]["status"]]
        for name in forwarded[0]["files"]:
            assert (tmp_path / name).is_file()
    finally:
        server.stop()


# ----- a false alarm: the alert's own condition is not in the data -----------------------------------

def test_an_alert_whose_condition_never_held_gets_no_cause() -> None:
    """On quiet data the runbook checks still find something (a 0/0, a wandering ratio); no cause may be named."""
    skew = _alert("rank_skew", instance="127.0.0.1:8000", rank="1")
    prom = StubProm(STRAGGLER, symptom=False)  # the checks alone would say straggler_rank, high
    report = Engine(prom, TH, at=1_700_000_000.0).run([skew])  # type: ignore[arg-type]
    assert report.status == "incidents" and report.causes == []
    d = report.incidents[0].primary
    assert d.symptom_not_seen and d.cause is None and d.confidence == "none"
    assert d.path == ["symptom"] and [c.id for c in d.checks] == ["symptom"]
    symptom_queries = [q for q, _ in prom.queries if q.startswith(SYMPTOM_QUERY_PREFIX)]
    assert len(symptom_queries) == 1 and len(prom.queries) == 2  # vector(1), the symptom: no runbook check ran
    q = symptom_queries[0]
    assert "instance_rank:stepwatch_rank_busy_seconds:ratio_to_fastest_rate1m > 1.1" in q
    assert q.endswith("[25s:1s])")  # for: 10s + three 5 s evaluations (drill profile), by the second
    assert "false alarm" in (d.error or "") and "rules generate" in d.next_step()
    text = render.terminal(report)
    assert "NO CAUSE FOUND" in text and "LIKELY CAUSE" not in text
    assert report.to_json()["incidents"][0]["diagnoses"][0]["symptom"]["outcome"] == "healthy"


def test_the_symptom_must_carry_the_alerts_labels() -> None:
    """Rank 0 over the line says nothing about an alert on rank 1."""
    class OtherRank(StubProm):
        def query(self, expr: str, at: float | None = None) -> list[Sample]:
            if expr.startswith(SYMPTOM_QUERY_PREFIX):
                return [Sample({"instance": "127.0.0.1:8000", "rank": "0", "job": "stepwatch-service"}, 4.0)]
            return super().query(expr, at)

    skew = _alert("rank_skew", instance="127.0.0.1:8000", rank="1")
    assert Engine(OtherRank(STRAGGLER), TH).run([skew]).causes == []  # type: ignore[arg-type]
    skew0 = _alert("rank_skew", instance="127.0.0.1:8000", rank="0")
    assert Engine(OtherRank(STRAGGLER), TH).run([skew0]).causes == ["straggler_rank"]  # type: ignore[arg-type]


def test_a_symptom_query_that_fails_does_not_stop_the_runbook() -> None:
    class NoSymptom(StubProm):
        def query(self, expr: str, at: float | None = None) -> list[Sample]:
            if expr.startswith(SYMPTOM_QUERY_PREFIX):
                raise PromError("query: execution: too many samples")
            return super().query(expr, at)

    skew = _alert("rank_skew", instance="127.0.0.1:8000", rank="1")
    report = Engine(NoSymptom(STRAGGLER), TH).run([skew])  # type: ignore[arg-type]
    assert report.causes == ["straggler_rank"]
    assert report.incidents[0].primary.symptom is not None
    assert report.incidents[0].primary.symptom.outcome == "error"


# ----- rival causes behind one alert: the checks, not the alert's name, decide ------------------------

STEP = ("step_time_regression", {"instance": "127.0.0.1:8000", "shape": "512x512_8s"})


@pytest.mark.parametrize(("rules", "cause"), [
    ([(r"ratio_to_fastest_rate1m", 0.4)], "straggler_rank"),
    ([(r'compile=~"\(\?i\)false"', 1.0), (r"stepwatch_quality_baseline_stale", 1.0)], "compile_disabled"),
    ([(r'cache="none"', 1.0), (r"stepwatch_quality_baseline_stale", 0.0)], "cache_disabled"),
    ([(r"stepwatch_quality_baseline_stale", 1.0)], "fingerprint_changed"),
    ([(r"stepwatch_pipeline_cpu_wait_seconds_total", 1.4), (r"stepwatch_quality_baseline_stale", 1.0)],
     "cpu_contention"),
    # Waits under the line, but long for each second the process ran: starved, not merely busy.
    ([(r"cpu_run_seconds_total", 0.6), (r"stepwatch_pipeline_cpu_wait_seconds_total", 0.3)], "cpu_contention"),
    ([(r"cpu_run_seconds_total", 0.1), (r"stepwatch_pipeline_cpu_wait_seconds_total", 0.3)], None),
    # A deployment that never compiled, its step time up on CPU noise: compile reads off, but it was never
    # turned off (no override), so the compile question is empty and nothing is named, not compile_disabled.
    ([(r'knob="compile"', None), (r'compile=~"\(\?i\)false"', 1.0),
      (r"stepwatch_pipeline_cpu_wait_seconds_total", 0.1)], None),
])
def test_step_time_rivals(rules: list[tuple[str, float | None]], cause: str | None) -> None:
    """Compile off also makes the baseline stale (the compile mode is in the fingerprint): compile is asked first."""
    key, labels = STEP
    d = triage([_alert(key, **labels)], StubProm(rules), thresholds=TH).incidents[0].primary
    assert d.cause == cause, d.path


@pytest.mark.parametrize(("rules", "cause"), [
    ([(r"/ on \(job, instance, shape\)", 1.6), (r"stepwatch_baseline_cache_hit_ratio", 0.37),
      (r'knob="cache_threshold"', 1.0), (r'knob="cache"', 0.0)], "cache_threshold_too_high"),
    ([(r"/ on \(job, instance, shape\)", 1.6), (r"stepwatch_baseline_cache_hit_ratio", 0.37),
      (r'knob="cache_threshold"', 0.0), (r'knob="cache"', 1.0)], "config_changed"),
    ([(r"/ on \(job, instance, shape\)", 1.6), (r"stepwatch_baseline_cache_hit_ratio", 0.37),
      (r"knob_override_active", 0.0)], "prompt_mix_shift"),
    ([(r"/ on \(job, instance, shape\)", 0.0), (r"sum\(rate\(stepwatch_cache_decisions_total", 2.5),
      (r'knob=~"cache\|cache_threshold"', 1.0)], "config_changed"),
    ([(r"/ on \(job, instance, shape\)", 0.5), (r"sum\(rate\(stepwatch_cache_decisions_total", 0.0)],
     "cache_disabled"),
])
def test_cache_hit_rate_rivals(rules: list[tuple[str, float | None]], cause: str) -> None:
    """A threshold raised, the kind switched (either way), the prompts changed, the cache off: five stories."""
    a = _alert("cache_hit_rate_shift", instance="127.0.0.1:8000", shape="512x512_8s")
    d = triage([a], StubProm(rules), thresholds=TH).incidents[0].primary
    assert d.cause == cause, d.path


def test_a_knob_set_and_restored_is_no_change() -> None:
    """The info metric had two label sets in the lookback; the knob's value is what it started with."""
    a = _alert("cache_hit_rate_shift", instance="127.0.0.1:8000", shape="512x512_8s")
    rules: list[tuple[str, float | None]] = [
        (r"/ on \(job, instance, shape\)", 1.6), (r"stepwatch_baseline_cache_hit_ratio", 0.37),
        (r"count_over_time\(stepwatch_service_config_info", 2.0), (r"knob_override_active", 0.0)]
    assert triage([a], StubProm(rules), thresholds=TH).incidents[0].primary.cause == "prompt_mix_shift"


def test_a_warmed_resolution_recompiling_is_an_eviction() -> None:
    """Warm-up ran 512x512_2s; traffic runs 512x512_8s: the same compiled graph, so it was warmed."""
    a = _alert("recompile", instance="127.0.0.1:8000", shape="512x512_8s", phase="serving")
    prom = StubProm([(r'shape=~"512x512\(_\.\*\)\?", phase="warmup"', 1.0), (r"knob_override_active", 0.0)])
    d = triage([a], prom, thresholds=TH).incidents[0].primary
    assert d.cause == "compile_cache_evicted" and d.path == ["unlisted_shape", "warmed_up", "knob_changed"]
    fresh = StubProm([(r'phase="warmup"', 0.0)])
    assert triage([a], fresh, thresholds=TH).incidents[0].primary.cause == "recompile_unwarmed_shape"


@pytest.mark.parametrize(("tiling_off", "cause"), [(1.0, "vae_tiling_off"), (None, "shape_too_large")])
def test_oom_rivals(tiling_off: float | None, cause: str) -> None:
    oom = _alert("oom", instance="127.0.0.1:8000", shape="2048x2048_1s", stage="vae_decode")
    prom = StubProm([KV_STAGE_EMPTY, (r'stepwatch_oom_total.*stage="vae_decode"', 1.0), (r"vae_tiling=~", tiling_off)])
    assert triage([oom], prom, thresholds=TH).incidents[0].primary.cause == cause


@pytest.mark.parametrize(("window_raised", "cause"), [(1.0, "kv_window_too_long"), (0.0, "kv_memory_full")])
def test_a_session_kv_cache_that_does_not_fit(window_raised: float, cause: str) -> None:
    """An OOM of stage kv_cache: the window knob raised, or the sessions together past the KV memory."""
    oom = _alert("oom", instance="127.0.0.1:8000", shape="other", stage="kv_cache")
    prom = StubProm([(r'stepwatch_oom_total.*stage="kv_cache"', 1.0), (r'knob="stream_window_chunks"', window_raised),
                     (r"vae_tiling=~", 1.0)])
    d = triage([oom], prom, thresholds=TH).incidents[0].primary
    assert d.cause == cause and d.path[:2] == ["kv_stage", "kv_window"]


@pytest.mark.parametrize(("steps", "window", "cpu_wait", "cause"), [
    (1.0, 0.0, 0.0, "stream_steps_raised"), (0.0, 1.0, 0.0, "stream_window_long"),
    (0.0, 0.0, 0.9, "cpu_contention"), (0.0, 0.0, 0.1, None)])
def test_stream_stalling_rivals(steps: float, window: float, cpu_wait: float, cause: str | None) -> None:
    stall = _alert("stream_stalling", instance="127.0.0.1:8000")
    prom = StubProm([(r'knob="stream_steps"', steps), (r'knob="stream_window_chunks"', window),
                     (r"cpu_wait_seconds_total", cpu_wait)])
    assert triage([stall], prom, thresholds=TH).incidents[0].primary.cause == cause


def test_probe_timeouts_behind_a_rewarm_are_the_knob_not_the_queue() -> None:
    """A knob that re-warmed the worker (another cache kind) held the probes: config_changed, and it shares
    the incident the cache alert opens for the same cause on the same host."""
    probe = _probe("timeout")
    report = triage([probe], StubProm(_probe_world(0.0, timeouts=2.0, rewarm=6.0)), thresholds=TH)  # type: ignore[arg-type]
    d = report.incidents[0].primary
    assert d.cause == "config_changed" and d.path[-1] == "rewarmed"
    assert "warm" in d.next_step()


def test_a_pool_alert_joins_the_one_host_with_its_cause() -> None:
    """The error ratio (per pool, no instance) and the probe failing on the host whose worker crashed: one
    incident; with the same cause on a second host it is not known which, and it stays apart."""
    rules = [(r'code="507"', 0.0), *_probe_world(0.0, restarts=1.0)]
    err, probe = _alert("error_ratio", pool="small"), _probe("connect")
    report = triage([err, probe], StubProm(rules), thresholds=TH)  # type: ignore[arg-type]
    assert [sorted(a.name for a in i.alerts) for i in report.incidents] == [
        ["StepwatchQualityProbeFailing", "StepwatchRequestErrorRatio"]]
    assert report.incidents[0].cause == "worker_crashed"
    other = Alert(probe.name, {**probe.labels, "instance": "10.9.9.9:9465"}, probe.annotations, probe.starts_at)
    report = triage([err, probe, other], StubProm(rules), thresholds=TH)  # type: ignore[arg-type]
    assert len(report.incidents) == 3


def _caused(alert: Alert, cause: str) -> Diagnosis:
    return Diagnosis(alert, None, "", "", cause=cause, confidence="high")


def test_a_pool_short_of_instances_is_one_incident_across_its_instances() -> None:
    """Three instances' queue alerts and the pool's capacity alert, all ``under_provisioned``, on three hosts
    (or three pods of one host): one incident for the pool.  A per-place cause stays one incident per place."""
    hosts = [_alert("queue_wait", instance=f"10.0.0.{i}:8000", pool="small") for i in (1, 2, 3)]
    pods = [_alert("queue_wait", instance=f"127.0.0.1:800{i}", pool="small", pod=f"replica-{i}") for i in (1, 2, 3)]
    capacity = _alert("pool_capacity")
    for queues in (hosts, pods):
        incidents = group([_caused(a, "under_provisioned") for a in [*queues, capacity]], TH)
        assert len(incidents) == 1 and len(incidents[0].alerts) == 4
        assert incidents[0].cause == "under_provisioned"
        crashed = group([_caused(a, "worker_crashed") for a in queues], TH)
        assert sorted(len(i.alerts) for i in crashed) == [1, 1, 1]  # a crash is each pod's own


def test_one_node_gone_is_one_incident_and_pods_are_places() -> None:
    """Alerts naming ``node_down`` for one node join; another node's stay apart; two pods on one address are
    two places for a per-place cause (a fleet on one host), one service and its sidecar in a pod one."""
    a = _alert("node_silent", node="node-1")
    b = _alert("target_down", instance="127.0.0.1:9001", pod="replica-1", node="node-1")
    c = _alert("node_silent", node="node-0")
    incidents = group([_caused(a, "node_down"), _caused(b, "node_down"), _caused(c, "node_down")], TH)
    assert sorted(sorted(x.name for x in i.alerts) for i in incidents) == [
        ["StepwatchNodeSilent"], ["StepwatchNodeSilent", "StepwatchTargetDown"]]
    svc, sidecar, other = (_alert("target_down", instance=f"127.0.0.1:{port}", pod=pod)
                           for port, pod in ((9001, "replica-1"), (9002, "replica-1"), (9003, "replica-2")))
    incidents = group([_caused(x, "process_down") for x in (svc, sidecar, other)], TH)
    assert sorted(len(i.alerts) for i in incidents) == [1, 2]


@pytest.mark.parametrize("balancer, cause", [(0.0, "node_down"), (1.0, "agent_down"), (None, None)])
def test_node_silent_tells_a_node_gone_from_its_agent_gone(balancer: float | None, cause: str | None) -> None:
    """The balancer's health checks of the node's replicas decide; without the balancer's view, no cause."""
    prom = StubProm([(r"count\(haproxy_server_status", 0.0 if balancer is None else 3.0),
                     (r"haproxy_server_status", balancer)])
    report = triage([_alert("node_silent", node="node-1")], prom, thresholds=TH)  # type: ignore[arg-type]
    [inc] = report.incidents
    assert inc.cause == cause
    asked = [q for q, _ in prom.queries if "haproxy_server_status" in q]
    assert len(asked) == 2 and all('job="prometheus-agent"' in q for q in asked) and 'node="node-1"' in asked[-1]


@pytest.mark.parametrize("samples_ratio, cause", [(1.0, "bad_instance"), (0.4, None)])
def test_instance_slow_on_incomplete_data_names_no_bad_instance(samples_ratio: float, cause: str | None) -> None:
    """A paused node agent leaves its replica's series a gap: the instance-slow runbook asks whether its data are
    complete before comparing it with the fleet, and does not advise draining a replica it cannot measure."""
    node = {"job": "stepwatch-service", "instance": "127.0.0.11:8000", "pod": "replica-1", "node": "node-1"}
    rules: list[tuple[str, float | Sample | None]] = [
        (r"stepwatch_gpu_", None),  # no NVML on the practice fleet
        (r"instance:stepwatch_up_samples:ratio_to_most_rate1m", Sample(node, samples_ratio)),
        (r"ratio_to_fleet_median_rate1m", 1.4),  # an outlier by the numbers it has
    ]
    slow = _alert("instance_slow", instance="127.0.0.11:8000", shape="512x512_8s")
    d = Engine(StubProm(rules), TH).run([slow]).incidents[0].primary  # type: ignore[arg-type]
    assert d.cause == cause
    assert (d.explained_by is not None) is (cause is None)
    if d.explained_by is not None:
        assert d.explained_by.alert == "StepwatchNodeSilent" and d.explained_by.labels.get("node") == "node-1"
