"""promtool unit tests for the generated rules, one file per profile.

Each alert's scenarios come from its AlertDef (alerts/defs/): stated from first
principles and placed relative to the thresholds and ``for:`` of the profile, one series
just over the threshold (fires, with its exact labels and annotations), one just under
(never in the firing list), and an evaluation one interval before ``for:`` elapses
(nothing fires yet).  Every recording rule has a ``promql_expr_test`` (compared within
1e-9: promtool compares floats exactly).
"""

from __future__ import annotations

import math
from typing import Any

from stepwatch.alerts import defs, gotemplate
from stepwatch.alerts.defs.base import I1, I2, SVC, Case, Expect, Series, Timing, const, ramp
from stepwatch.alerts.promql import num
from stepwatch.alerts.rulegen import (
    ALERTING_GROUP,
    RECORDING_GROUP,
    alert_annotations,
    alert_labels,
    dump,
    header,
    windows,
)
from stepwatch.thresholds import Thresholds, capacity_headroom, parse_duration

__all__ = ["Case", "Expect", "Series", "cases", "test_file"]

Samples = dict[str, list[tuple[dict[str, str], float]]]  # record -> (labels, expected value)


def cases(th: Thresholds, profile: str) -> list[Case]:
    """Every alert's promtool scenarios for one profile, in the thresholds' order."""
    out: list[Case] = []
    for spec, d in defs.defined(th):
        out += d.cases(Timing(th, spec, profile))
    return out


# ----- recording rules ------------------------------------------------------------------------

A = "1024x1024_8s"  # the one shape of the recording-rule test
INSTANCES = [{"job": SVC, "instance": I1}, {"job": SVC, "instance": I2}]


def _pipeline_series(n: int) -> list[Series]:
    """Per instance: step sum/count, cache hits/misses, ledger FLOPs, device peak."""
    series: list[Series] = []
    per = [(1, 4, 1, 3, 5e14, 1e15), (3, 4, 0, 4, 2.7e15, 3e15)]
    for lab, (ssum, scnt, hit, miss, flops, peak) in zip(INSTANCES, per, strict=True):
        sl = {**lab, "shape": A}
        series += [Series("stepwatch_pipeline_step_duration_seconds_sum", sl, ramp(ssum, n)),
                   Series("stepwatch_pipeline_step_duration_seconds_count", sl, ramp(scnt, n)),
                   Series("stepwatch_cache_decisions_total", {**sl, "cache": "first_block_cache", "decision": "miss"},
                          ramp(miss, n)),
                   Series("stepwatch_ledger_flops_total", sl, ramp(flops, n)),
                   Series("stepwatch_device_peak_flops_per_second", {**lab, "device": "cuda:0"}, const(peak, n))]
        if hit:
            series.append(Series("stepwatch_cache_decisions_total",
                                 {**sl, "cache": "first_block_cache", "decision": "hit"}, ramp(hit, n)))
    return series


def _service_and_rank_series(n: int) -> list[Series]:
    """Requests by pool and code, queue wait and SLO by pool, per-rank step and busy times."""
    svc, series = INSTANCES, []
    for pool, code, v in (("large", "200", 90), ("large", "500", 6), ("large", "507", 4), ("small", "200", 100)):
        series.append(Series("stepwatch_service_requests_total", {**svc[0], "pool": pool, "code": code}, ramp(v, n)))
    for lab, pool, wait, slo in ((svc[0], "small", 5, 10), (svc[0], "large", 15, 60), (svc[1], "small", 8, 10)):
        series += [Series("stepwatch_queue_estimated_wait_seconds", {**lab, "pool": pool}, const(wait, n)),
                   Series("stepwatch_queue_slo_seconds", {**lab, "pool": pool}, const(slo, n))]
    # Worker seconds per request: small 0.6 s latency - 0.1 s queued, large 2.5 - 0.5 (100 requests per scrape each).
    for pool, latency, queued in (("small", 0.6, 0.1), ("large", 2.5, 0.5)):
        pl = {**svc[0], "pool": pool}
        series += [Series("stepwatch_service_request_duration_seconds_sum", pl, ramp(100 * latency, n)),
                   Series("stepwatch_queue_wait_seconds_sum", pl, ramp(100 * queued, n)),
                   Series("stepwatch_queue_wait_seconds_count", pl, ramp(100, n)),
                   Series("stepwatch_queue_depth", pl, const(0, n))]
    series += [Series("stepwatch_service_ready", lab, const(1, n)) for lab in svc]
    series += [Series("up", lab, const(1, n)) for lab in svc]
    for lab, ranks in ((svc[0], (1.0, 1.25)), (svc[1], (2.0, 2.0))):
        for r, t in enumerate(ranks):
            rl = {**lab, "rank": str(r)}
            series += [Series("stepwatch_rank_step_duration_seconds", rl, const(t, n)),
                       Series("stepwatch_rank_busy_seconds_total", rl, ramp(t, n)),
                       Series("stepwatch_rank_steps_total", rl, ramp(4, n))]
    return series


def _i(k: int, **kw: str) -> dict[str, str]:
    return {**INSTANCES[k], **kw}


def _expected_per_window(w: str, scrape_s: int, headroom: float | None) -> Samples:
    """What the rate-window recordings read from the series above, worked out by hand."""
    i, fleet = _i, {"job": SVC, "shape": A}
    capacity: Samples = {} if headroom is None else {
        f"pool:stepwatch_service_work_seconds:mean_rate{w}": [
            ({"job": SVC, "pool": "small"}, 0.5), ({"job": SVC, "pool": "large"}, 2.0)],
        # 100 requests per scrape in each pool: headroom x (100/s x 0.5 + 100/s x 2.0)
        f"job:stepwatch_service_instances:needed_rate{w}": [({"job": SVC}, headroom * 250 / scrape_s)]}
    ranks = [(i(0, rank="0"), 1.0), (i(0, rank="1"), 1.25), (i(1, rank="0"), 1.0), (i(1, rank="1"), 1.0)]
    return {
        f"instance_shape:stepwatch_pipeline_step_duration_seconds:mean_rate{w}": [
            (i(0, shape=A), 0.25), (i(1, shape=A), 0.75)],
        f"shape:stepwatch_pipeline_step_duration_seconds:mean_rate{w}": [(fleet, 0.5)],
        f"instance_shape:stepwatch_cache_decisions:hit_ratio_rate{w}": [(i(0, shape=A), 0.25), (i(1, shape=A), 0.0)],
        f"shape:stepwatch_cache_decisions:hit_ratio_rate{w}": [(fleet, 0.125)],
        f"instance_shape:stepwatch_ledger_flops:mfu_rate{w}": [(i(0, shape=A), 0.5), (i(1, shape=A), 0.3)],
        f"shape:stepwatch_ledger_flops:mfu_rate{w}": [(fleet, 0.32)],
        f"instance_rank:stepwatch_rank_busy_seconds:mean_rate{w}": [
            (i(0, rank="0"), 0.25), (i(0, rank="1"), 0.3125), (i(1, rank="0"), 0.5), (i(1, rank="1"), 0.5)],
        f"instance_rank:stepwatch_rank_busy_seconds:ratio_to_fastest_rate{w}": ranks,
        f"pool:stepwatch_service_requests:error_ratio_rate{w}": [
            ({"job": SVC, "pool": "large"}, 0.1), ({"job": SVC, "pool": "small"}, 0.0)],
        # both scraped at every interval: complete, so both count in the fleet comparisons below
        f"instance:stepwatch_up_samples:ratio_to_most_rate{w}": [(i(0), 1.0), (i(1), 1.0)],
        # two instances at 0.25 and 0.75 s per step: their median 0.5 (quantile interpolates)
        f"shape:stepwatch_pipeline_step_duration_seconds:median_instance_rate{w}": [(fleet, 0.5)],
        f"shape:stepwatch_pipeline_step_duration_seconds:instances_rate{w}": [(fleet, 2)],
        f"instance_shape:stepwatch_pipeline_step_duration_seconds:ratio_to_fleet_median_rate{w}": [
            (i(0, shape=A), 0.5), (i(1, shape=A), 1.5)],
        **capacity,
    }


def _expected_gauges() -> Samples:
    i = _i
    return {
        "instance_pool:stepwatch_queue_estimated_wait_seconds:slo_ratio": [
            (i(0, pool="small"), 0.5), (i(0, pool="large"), 0.25), (i(1, pool="small"), 0.8)],
        "pool:stepwatch_queue_estimated_wait_seconds:max": [
            ({"job": SVC, "pool": "small"}, 8), ({"job": SVC, "pool": "large"}, 15)],
        "instance_rank:stepwatch_rank_step_duration_seconds:ratio_to_fastest": [
            (i(0, rank="0"), 1.0), (i(0, rank="1"), 1.25), (i(1, rank="0"), 1.0), (i(1, rank="1"), 1.0)],
        "instance:stepwatch_rank_step_duration_seconds:skew_ratio": [(i(0), 0.25), (i(1), 0.0)],
        "job:stepwatch_service_instances:ready": [({"job": SVC}, 2)],
    }


def _recording_test(th: Thresholds, profile: str) -> dict[str, Any]:
    """One promtool test: every recording rule's value, late enough that the longest window is full."""
    s = int(parse_duration(th.profiles[profile].scrape_interval))
    at = int(math.ceil((max(parse_duration(w) for w in windows(th)) + 2 * s) / s) * s)
    n = at // s + 2
    expect: Samples = {}
    capacity = th.alerts.get("pool_capacity")
    headroom = capacity_headroom(capacity) if capacity is not None else None
    for w in windows(th):
        expect.update(_expected_per_window(w, s, headroom))
    expect.update(_expected_gauges())
    tests = []
    for record, samples in expect.items():
        for lab, value in samples:
            sel = record + "{" + ", ".join(f'{k}="{v}"' for k, v in lab.items()) + "}"
            tests.append({"expr": f"abs({sel} - {num(value)}) < bool 1e-9", "eval_time": f"{at}s",
                          "exp_samples": [{"labels": _labels_text(lab), "value": 1}]})
    series = _pipeline_series(n) + _service_and_rank_series(n)
    return {"name": "recording rules", "interval": f"{s}s",
            "input_series": [{"series": x.text(), "values": x.values} for x in series],
            "promql_expr_test": tests}



def _labels_text(lab: dict[str, str]) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(lab.items())) + "}"


# ----- the file -------------------------------------------------------------------------------

def _alert_test(th: Thresholds, profile: str, case: Case) -> dict[str, Any]:
    spec = th.alert(case.key)
    p = Timing(th, spec, profile)
    rule_ann = alert_annotations(th, spec, profile)
    checks = []
    for ex in case.expects:
        exp = []
        for lab, value in ex.firing:
            ann = dict(rule_ann)
            ann["description"] = gotemplate.render(rule_ann["description"], lab, value)
            exp.append({"exp_labels": {**alert_labels(spec, profile), **lab}, "exp_annotations": ann})
        checks.append({"eval_time": f"{ex.at}s", "alertname": spec.name, "exp_alerts": exp})
    return {"name": f"{spec.name}: {case.title}", "interval": f"{p.s}s",
            "input_series": [{"series": x.text(), "values": x.values} for x in case.series],
            "alert_rule_test": checks}


def test_file(th: Thresholds, profile: str, rule_file: str) -> str:
    doc = {
        "rule_files": [rule_file],
        "evaluation_interval": th.profiles[profile].evaluation_interval,
        "group_eval_order": [RECORDING_GROUP, ALERTING_GROUP],
        "tests": [_recording_test(th, profile)] + [_alert_test(th, profile, c) for c in cases(th, profile)],
    }
    return header(f"promtool unit tests for the {profile} rules",
                  ["", f"Run: promtool test rules alerts/tests/stepwatch-{profile}.test.yml",
                   "Each alert: just over fires with exact labels and annotations, just under never does,",
                   "one evaluation before `for:` elapses nothing fires; every recording rule has a value test."]) \
        + dump(doc)
