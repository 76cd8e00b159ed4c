"""promtool unit tests for the generated rules, one file per profile.

Every scenario is stated from first principles and placed relative to the thresholds
and ``for:`` of its profile: one series just over the threshold (fires, with its exact
labels and annotations), one just under (never in the firing list), and an evaluation
one interval before ``for:`` elapses (nothing fires yet).  Event alerts also check that
a restarted Prometheus stays quiet, that a counter born at 1 fires, that an increasing
one fires, and that both clear a window later.  Every recording rule has a
``promql_expr_test`` (compared within 1e-9: promtool compares floats exactly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from stepwatch.alerts import gotemplate
from stepwatch.alerts.rulegen import (
    ALERTING_GROUP,
    RECORDING_GROUP,
    alert_annotations,
    alert_labels,
    dump,
    header,
    num,
    windows,
)
from stepwatch.alerts.thresholds import AlertSpec, Thresholds, parse_duration

SVC, SIDECAR = "stepwatch-service", "stepwatch-sidecar"
I1, I2, SC = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.1:9465"


@dataclass
class Series:
    name: str
    labels: dict[str, str]
    values: str

    def text(self) -> str:
        return self.name + "{" + ", ".join(f'{k}="{v}"' for k, v in self.labels.items()) + "}"


@dataclass
class Expect:
    at: int  # seconds
    firing: list[tuple[dict[str, str], float]] = field(default_factory=list)  # (series labels, $value)
    why: str = ""


@dataclass
class Case:
    key: str
    title: str
    series: list[Series]
    expects: list[Expect]


class _P:
    """Times of one profile, in seconds, and sample-count helpers."""

    def __init__(self, th: Thresholds, spec: AlertSpec, profile: str) -> None:
        p = th.profiles[profile]
        self.s = int(parse_duration(p.scrape_interval))
        self.e = int(parse_duration(p.evaluation_interval))
        if self.s != self.e:
            raise ValueError(f"profiles.{profile}: the generated tests assume scrape == evaluation interval")
        self.F = int(spec.for_seconds(profile))
        self.W = int(parse_duration(p.rate_window))
        self.Wa = int(parse_duration(spec.window[profile])) if profile in spec.window else self.W
        self.T = spec.threshold

    def align(self, t: float) -> int:
        return int(math.ceil(t / self.s) * self.s)

    def n(self, end: int) -> int:
        """Samples (after the first) so a series covers ``end`` plus margin."""
        return end // self.s + 2


def ramp(step: float, n: int, start: float = 0) -> str:
    return f"{num(start)}+{num(step)}x{n}"


def const(v: float, n: int) -> str:
    return f"{num(v)}x{n}"


def jump(v0: float, at_index: int, v1: float, n: int) -> str:
    """v0 at samples 0..at_index-1, v1 from at_index on (n+1 samples in all)."""
    return f"{num(v0)}x{at_index - 1} {num(v1)}x{n - at_index}"


def born(at_index: int, v: float, n: int) -> str:
    """No sample before at_index, then v."""
    return f"_x{at_index} {num(v)}x{n - at_index}"


def _up(n: int, *instances: tuple[str, str]) -> list[Series]:
    return [Series("up", {"job": j, "instance": i}, const(1, n)) for j, i in instances]


# ----- scenarios ------------------------------------------------------------------------------

def _step_time(p: _P) -> Case:
    fire = p.s + p.F  # the first rate needs two samples: active from s
    n = p.n(fire + p.s)
    series, bad, ok = [], "1024x1024_28s_cfg", "768x1344_28s_cfg"
    for shape, factor in ((bad, p.T * 1.02), (ok, p.T * 0.98)):
        lab = {"job": SVC, "instance": I1, "shape": shape}
        series += [Series("stepwatch_baseline_step_duration_seconds", lab, const(0.1, n)),
                   Series("stepwatch_pipeline_step_duration_seconds_count", lab, ramp(10, n)),
                   Series("stepwatch_pipeline_step_duration_seconds_sum", lab, ramp(10 * 0.1 * factor, n))]
    bad_lab = {"job": SVC, "instance": I1, "shape": bad}
    return Case("step_time_regression", f"{bad} at {num(p.T * 1.02)}x baseline fires; {ok} at "
                f"{num(p.T * 0.98)}x does not", series,
                [Expect(fire - p.e, [], "for: not elapsed"), Expect(fire, [(bad_lab, p.T * 1.02)])])


def _hit_rate(p: _P) -> Case:
    fire = p.s + p.F
    n = p.n(fire + p.s)
    # shape -> (baseline, hits per scrape, misses per scrape)
    shapes = {
        "1024x1024_28s_cfg": (0.5, 20 * 0.5 * (1 + 1.1 * p.T)),  # above the band: fires
        "768x1344_28s_cfg": (0.5, 20 * 0.5 * (1 + 0.9 * p.T)),  # inside: silent
        "512x512_28s_cfg": (0.5, 20 * 0.5 * (1 - 1.1 * p.T)),  # below: fires
        "1328x1328_28s_cfg": (0.5, 0.0),  # never hit (no hit series at all): 0x baseline, fires
        "1024x1024_4s": (0.0, 5.0),  # hits where the baseline has none (a distilled model): fires
        "256x256_4s": (0.0, 0.0),  # no hits, baseline none: silent
    }
    series = []
    for shape, (base, hits) in shapes.items():
        lab = {"job": SVC, "instance": I1, "shape": shape}
        series.append(Series("stepwatch_baseline_cache_hit_ratio", lab, const(base, n)))
        dec = {**lab, "cache": "first_block_cache"}
        if hits:
            series.append(Series("stepwatch_cache_decisions_total", {**dec, "decision": "hit"}, ramp(hits, n)))
        series.append(Series("stepwatch_cache_decisions_total", {**dec, "decision": "miss"}, ramp(20 - hits, n)))

    def of(shape: str) -> dict[str, str]:
        return {"job": SVC, "instance": I1, "shape": shape}

    firing = [(of("1024x1024_28s_cfg"), 1 + 1.1 * p.T), (of("512x512_28s_cfg"), 1 - 1.1 * p.T),
              (of("1328x1328_28s_cfg"), 0.0), (of("1024x1024_4s"), math.inf)]
    return Case("cache_hit_rate_shift", "hit rate above, inside and below the band; never hit; hits on a "
                "zero baseline", series, [Expect(fire - p.e, [], "for: not elapsed"), Expect(fire, firing)])


def _queue(p: _P) -> Case:
    fire = p.F
    n = p.n(fire + p.s)
    series = []
    for pool, slo, ratio in (("large", 60, p.T * 1.05), ("small", 10, p.T * 0.95)):
        lab = {"job": SVC, "instance": I1, "pool": pool}
        series += [Series("stepwatch_queue_slo_seconds", lab, const(slo, n)),
                   Series("stepwatch_queue_estimated_wait_seconds", lab, const(slo * ratio, n))]
    return Case("queue_wait", "pool large just over, pool small just under", series,
                [Expect(fire - p.e, [], "for: not elapsed") if fire else Expect(0, [], "pending"),
                 Expect(fire if fire else p.e, [({"job": SVC, "instance": I1, "pool": "large"}, p.T * 1.05)])])


def _events_case(p: _P, key: str, metric: str, job: str, inst: str, old: dict[str, str], new: dict[str, str],
                 inc: dict[str, str], quiet: list[Series] | None = None) -> Case:
    """old: constant since start; new: born at 1 at t_b; inc: 1 -> 2 at t_c."""
    kb = p.align(p.Wa + 2 * p.s) // p.s
    kc = kb + p.align(p.Wa + 2 * p.s) // p.s
    tb, tc = kb * p.s, kc * p.s
    end = tc + p.Wa + 2 * p.s
    n = p.n(end)
    base = {"job": job, "instance": inst}
    series = _up(n, (job, inst)) + [
        Series(metric, {**base, **old}, const(2, n)),
        Series(metric, {**base, **new}, born(kb, 1, n)),
        Series(metric, {**base, **inc}, jump(1, kc, 2, n)),
    ] + (quiet or [])
    return Case(key, "old counter quiet after a Prometheus restart; a new label set born at 1 fires; an "
                "increase fires; both clear a window later", series, [
                    Expect(p.e, [], "restarted Prometheus: no history, old counters are not new"),
                    Expect(tb - p.e, [], "before the event"),
                    Expect(tb, [({**base, **new}, 1.0)], "born at 1"),
                    Expect(tc, [({**base, **inc}, 1.0)], "increased"),
                    Expect(tc + p.Wa + p.e, [], "a window later"),
                ])


def _memory(p: _P) -> Case:
    kb = p.align(p.Wa + 2 * p.s) // p.s
    tb = kb * p.s
    n = p.n(tb + p.Wa + 2 * p.s)
    from prometheus_client.utils import floatToGoString

    le = floatToGoString(p.T)
    series = []
    # device -> (count after, bucket le=T after): cuda:0 above T, cuda:1 exactly at T (in the bucket), cpu above
    for dev, above in (("cuda:0", True), ("cuda:1", False), ("cpu", True)):
        lab = {"job": SVC, "instance": I1, "device": dev}
        series += [Series("stepwatch_memory_peak_ratio_count", lab, jump(3, kb, 4, n)),
                   Series("stepwatch_memory_peak_ratio_bucket", {**lab, "le": le}, jump(3, kb, 3 if above else 4, n))]
    firing = [({"job": SVC, "instance": I1, "device": "cuda:0", "gpu": "0"}, 1.0),
              ({"job": SVC, "instance": I1, "device": "cpu"}, 1.0)]
    return Case("memory_pressure", "one request above the bucket on cuda:0 and cpu fires (gpu label from cuda:N); "
                "one exactly at it on cuda:1 does not", series,
                [Expect(tb - p.e, [], "before"), Expect(tb, firing), Expect(tb + p.Wa + p.e, [], "a window later")])


def _quality(th: Thresholds, p: _P) -> Case:
    gate = th.quality.gate()
    kb = 3  # the low probe result arrives at the third scrape
    fire = kb * p.s + p.F
    n = p.n(fire + 2 * p.s)
    sc = {"job": SIDECAR, "instance": SC, "probe_set": "default"}
    series = [Series("stepwatch_quality_gate_decibels", sc, const(gate, n))]
    vals = {("svc-a", "p10"): gate - p.T + 0.1, ("svc-b", "p10"): gate - p.T - 0.1, ("svc-b", "p50"): gate - p.T - 1}
    for (iid, q), v in vals.items():
        values = born(kb, round(v, 6), n) if (iid, q) == ("svc-b", "p10") else const(round(v, 6), n)
        series.append(Series("stepwatch_quality_psnr_decibels", {**sc, "instance_id": iid, "quantile": q}, values))
    low = {**sc, "instance_id": "svc-b", "quantile": "p10"}
    return Case("quality_drop", "p10 just above gate - margin is silent; just below fires once its probe result "
                "arrives; p50 is not read", series,
                [Expect(fire - p.e, [], "only the result just above the line yet"),
                 Expect(fire, [(low, round(gate - p.T - 0.1, 6))])])


def _rank(p: _P) -> Case:
    fire = p.s + p.F  # rate() needs two samples: active from s
    n = p.n(fire + p.s)
    busy = {(I1, "0"): 0.1, (I1, "1"): 0.1 * (1 + p.T) * 1.02, (I1, "2"): 0.105, (I2, "0"): 0.1,
            (I2, "1"): 0.1 * (1 + p.T) * 0.98}
    series = []
    for (i, r), b in busy.items():
        lab = {"job": SVC, "instance": i, "rank": r}
        series += [Series("stepwatch_rank_busy_seconds_total", lab, ramp(round(8 * b, 9), n)),
                   Series("stepwatch_rank_steps_total", lab, ramp(8, n)),
                   Series("stepwatch_rank_step_duration_seconds", lab, const(round(b, 9), n))]
    return Case("rank_skew", "rank 1 of one instance just over; rank 1 of another just under", series,
                [Expect(fire - p.e, [], "for: not elapsed"),
                 Expect(fire, [({"job": SVC, "instance": I1, "rank": "1"}, (1 + p.T) * 1.02)])])


def _errors(p: _P) -> Case:
    fire = p.s + p.F
    n = p.n(fire + p.s)
    codes = {"large": {"200": 100 - 100 * p.T * 1.1, "500": 60 * p.T * 1.1, "507": 40 * p.T * 1.1},
             "small": {"200": 100 - 100 * p.T * 0.9, "503": 100 * p.T * 0.9, "429": 10},
             "other": {"200": 10},
             # every request fails, but a handful in the window: below min_requests, silent
             "idle": {"507": 0.05}}
    series = [Series("stepwatch_service_requests_total", {"job": SVC, "instance": I1, "pool": pool, "code": c},
                     ramp(round(v, 9), n)) for pool, cs in codes.items() for c, v in cs.items()]
    return Case("error_ratio", "pool large just over (500 + 507), pool small just under (429 is not an error), "
                "pool other without errors, pool idle all failing but under min_requests", series,
                [Expect(fire - p.e, [], "for: not elapsed"), Expect(fire, [({"job": SVC, "pool": "large"},
                                                                            p.T * 1.1)])])


def _probe_failures(p: _P) -> Case:
    kb = 4
    fire = kb * p.s + p.F
    n = p.n(fire + p.s)
    sc = {"job": SIDECAR, "instance": SC, "probe_set": "default"}
    series = [
        Series("stepwatch_quality_probe_failures_total", {**sc, "reason": "connect"},
               f"0x{kb - 1} 1+1x{n - kb}"),
        Series("stepwatch_quality_probe_failures_total", {**sc, "reason": "timeout"}, const(0, n)),
        Series("stepwatch_quality_last_success_timestamp_seconds", sc, ramp(p.s, n)),
        Series("stepwatch_quality_probe_interval_seconds", sc, const(60, n)),
    ]
    return Case("probe_failing", "failing on every attempt from t_b fires after for; the other reason stays 0",
                series, [Expect(fire - p.e, [], "for: not elapsed"),
                         Expect(fire, [({**sc, "reason": "connect"}, 1.0)])])


def _probe_stale(spec: AlertSpec, p: _P) -> Case:
    missed = int(spec.extra["missed_probes"])
    interval = 4 * p.s
    last = p.s  # the last success, as a unix time
    active = p.align(missed * interval + last + 1)
    fire = active + p.F
    n = p.n(fire + p.s)
    series = []
    for ps, last_success in (("a", const(last, n)), ("b", ramp(p.s, n)), ("c", const(0, n))):
        sc = {"job": SIDECAR, "instance": SC, "probe_set": ps}
        series += [Series("stepwatch_quality_last_success_timestamp_seconds", sc, last_success),
                   Series("stepwatch_quality_probe_interval_seconds", sc, const(interval, n)),
                   Series("stepwatch_quality_probe_failures_total", {**sc, "reason": "connect"}, const(0, n))]
    return Case("probe_failing", f"set a has not succeeded for {missed} probe intervals: fires; set b is fresh; "
                "set c never succeeded (0) and has no failures", series,
                [Expect(fire - p.e, [], "for: not elapsed"),
                 Expect(fire, [({"job": SIDECAR, "instance": SC, "probe_set": "a"}, 1.0)])])


def _stale(p: _P) -> Case:
    fire = p.F
    n = p.n(fire + p.s)
    series = [Series("stepwatch_quality_baseline_stale", {"job": SIDECAR, "instance": SC, "probe_set": ps},
                     const(v, n)) for ps, v in (("a", 1), ("b", 0))]
    return Case("baseline_stale", "set a stale, set b current", series,
                [Expect(fire - p.e, [], "for: not elapsed") if fire else Expect(0, [], "pending"),
                 Expect(fire if fire else p.e, [({"job": SIDECAR, "instance": SC, "probe_set": "a"}, 1.0)])])


def _down(p: _P) -> Case:
    fire = p.F
    n = p.n(fire + p.s)
    series = [Series("up", {"job": SVC, "instance": I1}, const(0, n)),
              Series("up", {"job": SIDECAR, "instance": SC}, const(1, n)),
              Series("up", {"job": "node", "instance": "10.0.0.1:9100"}, const(0, n))]
    return Case("target_down", "the service target is down; the sidecar is up; a non-stepwatch job is ignored",
                series, [Expect(fire - p.e, [], "for: not elapsed") if fire else Expect(0, [], "pending"),
                         Expect(fire if fire else p.e, [({"job": SVC, "instance": I1}, 0.0)])])


def cases(th: Thresholds, profile: str) -> list[Case]:
    out: list[Case] = []
    for key, spec in th.alerts.items():
        p = _P(th, spec, profile)
        if key == "step_time_regression":
            out.append(_step_time(p))
        elif key == "cache_hit_rate_shift":
            out.append(_hit_rate(p))
        elif key == "queue_wait":
            out.append(_queue(p))
        elif key == "memory_pressure":
            out.append(_memory(p))
        elif key == "quality_drop":
            out.append(_quality(th, p))
        elif key == "recompile":
            warm = Series("stepwatch_compile_total", {"job": SVC, "instance": I1, "shape": "512x512_8s",
                                                      "phase": "warmup"}, ramp(1, p.n(4 * p.Wa)))
            out.append(_events_case(p, key, "stepwatch_compile_total", SVC, I1,
                                    {"shape": "1024x1024_8s", "phase": "serving"},
                                    {"shape": "768x768_8s", "phase": "serving"},
                                    {"shape": "other", "phase": "serving"}, [warm]))
        elif key == "rank_skew":
            out.append(_rank(p))
        elif key == "oom":
            out.append(_events_case(p, key, "stepwatch_oom_total", SVC, I1,
                                    {"shape": "1024x1024_8s", "stage": "denoise"},
                                    {"shape": "2048x2048_8s", "stage": "vae_decode"},
                                    {"shape": "other", "stage": "vae_decode"}))
        elif key == "error_ratio":
            out.append(_errors(p))
        elif key == "nonfinite_outputs":
            out.append(_events_case(p, key, "stepwatch_service_images_nonfinite_total", SVC, I1,
                                    {"pool": "large"}, {"pool": "small"}, {"pool": "other"}))
        elif key == "probe_failing":
            out += [_probe_failures(p), _probe_stale(spec, p)]
        elif key == "baseline_stale":
            out.append(_stale(p))
        elif key == "target_down":
            out.append(_down(p))
        elif key == "exporter_errors":
            out.append(_events_case(p, key, "stepwatch_exporter_errors_total", SVC, I1,
                                    {"component": "vae.exit"}, {"component": "scheduler.step"},
                                    {"component": "transformer.cache_context"}))
        else:
            raise ValueError(f"alerts.{key}: no promtool test scenario; add one to stepwatch.alerts.promtests")
    return out


# ----- recording rules ------------------------------------------------------------------------

def _recording_test(th: Thresholds, profile: str) -> dict[str, Any]:
    s = int(parse_duration(th.profiles[profile].scrape_interval))
    at = int(math.ceil((max(parse_duration(w) for w in windows(th)) + 2 * s) / s) * s)
    n = at // s + 2
    A = "1024x1024_8s"
    svc = [{"job": SVC, "instance": I1}, {"job": SVC, "instance": I2}]
    series: list[Series] = []
    # per instance: step sum/count per scrape, hits/misses, ledger FLOPs, device peak
    per = [(1, 4, 1, 3, 5e14, 1e15), (3, 4, 0, 4, 2.7e15, 3e15)]
    for lab, (ssum, scnt, hit, miss, flops, peak) in zip(svc, per, strict=True):
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
    for pool, code, v in (("large", "200", 90), ("large", "500", 6), ("large", "507", 4), ("small", "200", 100)):
        series.append(Series("stepwatch_service_requests_total", {**svc[0], "pool": pool, "code": code}, ramp(v, n)))
    for lab, pool, wait, slo in ((svc[0], "small", 5, 10), (svc[0], "large", 15, 60), (svc[1], "small", 8, 10)):
        series += [Series("stepwatch_queue_estimated_wait_seconds", {**lab, "pool": pool}, const(wait, n)),
                   Series("stepwatch_queue_slo_seconds", {**lab, "pool": pool}, const(slo, n))]
    for lab, ranks in ((svc[0], (1.0, 1.25)), (svc[1], (2.0, 2.0))):
        for r, t in enumerate(ranks):
            rl = {**lab, "rank": str(r)}
            series += [Series("stepwatch_rank_step_duration_seconds", rl, const(t, n)),
                       Series("stepwatch_rank_busy_seconds_total", rl, ramp(t, n)),
                       Series("stepwatch_rank_steps_total", rl, ramp(4, n))]

    def i(k: int, **kw: str) -> dict[str, str]:
        return {**svc[k], **kw}

    expect: dict[str, list[tuple[dict[str, str], float]]] = {}
    for w in windows(th):
        expect[f"instance_shape:stepwatch_pipeline_step_duration_seconds:mean_rate{w}"] = [
            (i(0, shape=A), 0.25), (i(1, shape=A), 0.75)]
        expect[f"shape:stepwatch_pipeline_step_duration_seconds:mean_rate{w}"] = [({"job": SVC, "shape": A}, 0.5)]
        expect[f"instance_shape:stepwatch_cache_decisions:hit_ratio_rate{w}"] = [
            (i(0, shape=A), 0.25), (i(1, shape=A), 0.0)]
        expect[f"shape:stepwatch_cache_decisions:hit_ratio_rate{w}"] = [({"job": SVC, "shape": A}, 0.125)]
        expect[f"instance_shape:stepwatch_ledger_flops:mfu_rate{w}"] = [(i(0, shape=A), 0.5), (i(1, shape=A), 0.3)]
        expect[f"shape:stepwatch_ledger_flops:mfu_rate{w}"] = [({"job": SVC, "shape": A}, 0.32)]
        expect[f"instance_rank:stepwatch_rank_busy_seconds:mean_rate{w}"] = [
            (i(0, rank="0"), 0.25), (i(0, rank="1"), 0.3125), (i(1, rank="0"), 0.5), (i(1, rank="1"), 0.5)]
        expect[f"instance_rank:stepwatch_rank_busy_seconds:ratio_to_fastest_rate{w}"] = [
            (i(0, rank="0"), 1.0), (i(0, rank="1"), 1.25), (i(1, rank="0"), 1.0), (i(1, rank="1"), 1.0)]
        expect[f"pool:stepwatch_service_requests:error_ratio_rate{w}"] = [
            ({"job": SVC, "pool": "large"}, 0.1), ({"job": SVC, "pool": "small"}, 0.0)]
    expect["instance_pool:stepwatch_queue_estimated_wait_seconds:slo_ratio"] = [
        (i(0, pool="small"), 0.5), (i(0, pool="large"), 0.25), (i(1, pool="small"), 0.8)]
    expect["pool:stepwatch_queue_estimated_wait_seconds:max"] = [
        ({"job": SVC, "pool": "small"}, 8), ({"job": SVC, "pool": "large"}, 15)]
    expect["instance_rank:stepwatch_rank_step_duration_seconds:ratio_to_fastest"] = [
        (i(0, rank="0"), 1.0), (i(0, rank="1"), 1.25), (i(1, rank="0"), 1.0), (i(1, rank="1"), 1.0)]
    expect["instance:stepwatch_rank_step_duration_seconds:skew_ratio"] = [(i(0), 0.25), (i(1), 0.0)]
    tests = []
    for record, samples in expect.items():
        for lab, value in samples:
            sel = record + "{" + ", ".join(f'{k}="{v}"' for k, v in lab.items()) + "}"
            tests.append({"expr": f"abs({sel} - {num(value)}) < bool 1e-9", "eval_time": f"{at}s",
                          "exp_samples": [{"labels": _labels_text(lab), "value": 1}]})
    return {"name": "recording rules", "interval": f"{s}s",
            "input_series": [{"series": x.text(), "values": x.values} for x in series],
            "promql_expr_test": tests}


def _labels_text(lab: dict[str, str]) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(lab.items())) + "}"


# ----- the file -------------------------------------------------------------------------------

def _alert_test(th: Thresholds, profile: str, case: Case) -> dict[str, Any]:
    spec = th.alert(case.key)
    p = _P(th, spec, profile)
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
