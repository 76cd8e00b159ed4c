"""Pipeline alerts: the diffusion pipeline itself (step time, cache, memory, compiles, ranks, OOMs)."""

from __future__ import annotations

import math

from prometheus_client.utils import floatToGoString

from stepwatch.alerts.defs.base import (
    I1,
    I2,
    I3,
    SVC,
    AlertDef,
    Case,
    Expect,
    Series,
    Timing,
    const,
    events_case,
    jump,
    need_window,
    pending,
    ramp,
    rate_window,
)
from stepwatch.alerts.promql import above_bucket, events, num, over_positive, sel, sum_increase
from stepwatch.catalog import MEMORY_RATIO_BUCKETS
from stepwatch.thresholds import AlertSpec, Thresholds, ThresholdsError

SUBSYSTEM = "pipeline"


# ----- step time regression -------------------------------------------------------------------

def _step_time_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    w = rate_window(th, profile)
    share = over_positive(f"  instance_shape:stepwatch_pipeline_step_duration_seconds:mean_rate{w}",
                          "stepwatch_baseline_step_duration_seconds", "job, instance, shape")
    return f"{share}\n> {num(spec.threshold)}"


def _step_time_cases(p: Timing) -> list[Case]:
    fire = p.s + p.F  # the first rate needs two samples: active from s
    n = p.n(fire + p.s)
    series, bad, ok = [], "1024x1024_28s_cfg", "768x1344_28s_cfg"
    for shape, factor in ((bad, p.T * 1.02), (ok, p.T * 0.98)):
        lab = {"job": SVC, "instance": I1, "shape": shape}
        series += [Series("stepwatch_baseline_step_duration_seconds", lab, const(0.1, n)),
                   Series("stepwatch_pipeline_step_duration_seconds_count", lab, ramp(10, n)),
                   Series("stepwatch_pipeline_step_duration_seconds_sum", lab, ramp(10 * 0.1 * factor, n))]
    bad_lab = {"job": SVC, "instance": I1, "shape": bad}
    return [Case(p.spec.key, f"{bad} at {num(p.T * 1.02)}x baseline fires; {ok} at {num(p.T * 0.98)}x does not",
                 series, [Expect(fire - p.e, [], "for: not elapsed"), Expect(fire, [(bad_lab, p.T * 1.02)])])]


# ----- cache hit rate shift -------------------------------------------------------------------

def _hit_rate_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    w = rate_window(th, profile)
    ratio = (f"(\n    instance_shape:stepwatch_cache_decisions:hit_ratio_rate{w}\n"
             f"  / on (job, instance, shape)\n    stepwatch_baseline_cache_hit_ratio\n)")
    return f"{ratio} > {num(1 + spec.threshold)}\nor\n{ratio} < {num(1 - spec.threshold)}"


def _hit_rate_cases(p: Timing) -> list[Case]:
    fire = p.s + p.F
    n = p.n(fire + p.s)
    # shape -> (baseline, hits per scrape); 20 decisions per scrape
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
    return [Case(p.spec.key, "hit rate above, inside and below the band; never hit; hits on a zero baseline",
                 series, [Expect(fire - p.e, [], "for: not elapsed"), Expect(fire, firing)])]


# ----- memory pressure ------------------------------------------------------------------------

def _memory_le(spec: AlertSpec) -> str:
    """The threshold as the ``le`` of a bucket of stepwatch_memory_peak_ratio (it must be one)."""
    if spec.threshold not in MEMORY_RATIO_BUCKETS:
        raise ThresholdsError(f"alerts.{spec.key}.threshold: {num(spec.threshold)} is not a bucket boundary of "
                              f"stepwatch_memory_peak_ratio ({', '.join(num(b) for b in MEMORY_RATIO_BUCKETS)}); "
                              "the alert counts requests above that bucket")
    return floatToGoString(spec.threshold)


def _memory_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    above = above_bucket("stepwatch_memory_peak_ratio", _memory_le(spec), need_window(spec, profile),
                         "job, instance, device")
    count, minus, below = (line.strip() for line in above.splitlines())  # laid out as label_replace's argument
    return ("label_replace(\n"
            f"    {count}\n  {minus} {below},\n"
            '  "gpu", "$1", "device", "cuda:([0-9]+)"\n'
            ") > 0")


def _memory_cases(p: Timing) -> list[Case]:
    kb = p.align(p.Wa + 2 * p.s) // p.s
    tb = kb * p.s
    n = p.n(tb + p.Wa + 2 * p.s)
    le = _memory_le(p.spec)
    series = []
    # device -> (count after, bucket le=T after): cuda:0 above T, cuda:1 exactly at T (in the bucket), cpu above
    for dev, above in (("cuda:0", True), ("cuda:1", False), ("cpu", True)):
        lab = {"job": SVC, "instance": I1, "device": dev}
        series += [Series("stepwatch_memory_peak_ratio_count", lab, jump(3, kb, 4, n)),
                   Series("stepwatch_memory_peak_ratio_bucket", {**lab, "le": le}, jump(3, kb, 3 if above else 4, n))]
    firing = [({"job": SVC, "instance": I1, "device": "cuda:0", "gpu": "0"}, 1.0),
              ({"job": SVC, "instance": I1, "device": "cpu"}, 1.0)]
    return [Case(p.spec.key, "one request above the bucket on cuda:0 and cpu fires (gpu label from cuda:N); "
                 "one exactly at it on cuda:1 does not", series,
                 [Expect(tb - p.e, [], "before"), Expect(tb, firing), Expect(tb + p.Wa + p.e, [], "a window later")])]


# ----- serving recompile ----------------------------------------------------------------------

def _recompile_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return events('stepwatch_compile_total{phase="serving"}', need_window(spec, profile), spec.threshold)


def _recompile_cases(p: Timing) -> list[Case]:
    warm = Series("stepwatch_compile_total", {"job": SVC, "instance": I1, "shape": "512x512_8s", "phase": "warmup"},
                  ramp(1, p.n(4 * p.Wa)))
    return [events_case(p, "stepwatch_compile_total", {"shape": "1024x1024_8s", "phase": "serving"},
                        {"shape": "768x768_8s", "phase": "serving"}, {"shape": "other", "phase": "serving"}, [warm])]


# ----- rank skew ------------------------------------------------------------------------------

def _rank_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    w = rate_window(th, profile)
    return f"instance_rank:stepwatch_rank_busy_seconds:ratio_to_fastest_rate{w} > {num(1 + spec.threshold)}"


def _rank_cases(p: Timing) -> list[Case]:
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
    return [Case(p.spec.key, "rank 1 of one instance just over; rank 1 of another just under", series,
                 [Expect(fire - p.e, [], "for: not elapsed"),
                  Expect(fire, [({"job": SVC, "instance": I1, "rank": "1"}, (1 + p.T) * 1.02)])])]


# ----- out of memory --------------------------------------------------------------------------

def _oom_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return events("stepwatch_oom_total", need_window(spec, profile), spec.threshold)


def _oom_cases(p: Timing) -> list[Case]:
    return [events_case(p, "stepwatch_oom_total", {"shape": "1024x1024_8s", "stage": "denoise"},
                        {"shape": "2048x2048_8s", "stage": "vae_decode"}, {"shape": "other", "stage": "vae_decode"})]


# ----- streaming: chunks slower than real time ------------------------------------------------

RTF = "stepwatch_stream_realtime_factor_ratio"


def _stream_stall_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    """Share of chunks whose real-time factor is above 1 (1.0 is a bucket bound of the histogram)."""
    w = rate_window(th, profile)
    over = above_bucket(RTF, "1.0", w, "job, instance")
    chunks = sum_increase(sel(f"{RTF}_count"), w, "job, instance")
    return f"(\n{over}\n)\n/ on (job, instance)\n  ({chunks} > 0)\n> {num(spec.threshold)}"


def _stream_stall_cases(p: Timing) -> list[Case]:
    fire = p.s + p.F  # increase() needs two samples
    n = p.n(fire + p.s)
    series = []
    # (instance, chunks per scrape, of which at most real time): I1 3 of 4 over (0.75), I2 1 of 4 over (0.25)
    for inst, under in ((I1, 1), (I2, 3)):
        lab = {"job": SVC, "instance": inst}
        series += [Series(f"{RTF}_count", lab, ramp(4, n)),
                   Series(f"{RTF}_bucket", {**lab, "le": "1.0"}, ramp(under, n))]
    return [Case(p.spec.key, "3 of 4 chunks over real time fires; 1 of 4 does not", series,
                 [pending(p), Expect(fire, [({"job": SVC, "instance": I1}, 0.75)])])]


# ----- cache on a distilled (few-step) model ---------------------------------------------------

def _distilled_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return events("stepwatch_cache_few_step_hits_total", need_window(spec, profile), spec.threshold)


def _distilled_cases(p: Timing) -> list[Case]:
    return [events_case(p, "stepwatch_cache_few_step_hits_total",
                        {"shape": "1024x1024_4s", "cache": "first_block_cache"},
                        {"shape": "832x480x81_3s", "cache": "first_block_cache"},
                        {"shape": "other", "cache": "mag_cache"})]


# ----- one instance slower than the fleet -----------------------------------------------------

def _instance_slow_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    w = rate_window(th, profile)
    spread = th.diagnosis.get("instance_spread")
    if spread != spec.threshold:  # one number, read by this alert and by the step-time runbook's fleet check
        raise ThresholdsError(f"alerts.{spec.key}.threshold ({num(spec.threshold)}) must equal "
                              f"diagnosis.instance_spread ({spread})")
    least = int(spec.extra.get("min_instances", 3))
    return (f"  instance_shape:stepwatch_pipeline_step_duration_seconds:ratio_to_fleet_median_rate{w} - 1\n"
            f"> {num(spec.threshold)}\nand on (job, shape)\n"
            f"  shape:stepwatch_pipeline_step_duration_seconds:instances_rate{w} >= {least}")


def _instance_slow_cases(p: Timing) -> list[Case]:
    fire = p.s + p.F
    n = p.n(fire + p.s)
    shape, close, pair = "1024x1024_28s_cfg", "768x1344_28s_cfg", "512x512_28s_cfg"
    rows = [(shape, I1, 1 + p.T * 1.1), (shape, I2, 1.0), (shape, I3, 1.0),  # one outlier of three: fires
            (close, I1, 1 + p.T * 0.9), (close, I2, 1.0), (close, I3, 1.0),  # just inside: silent
            (pair, I1, 3.0), (pair, I2, 1.0)]  # two instances: no median to stand out from, silent
    series = _step_series(rows, n) + [Series("up", {"job": SVC, "instance": i}, const(1, n)) for i in (I1, I2, I3)]
    # The same outlier, but its scrapes stopped after the first (a paused node agent): it no longer counts, and
    # two instances have no median to stand out from.
    gap = [*_step_series(rows[:3], n), Series("up", {"job": SVC, "instance": I1}, f"1 _x{n}"),
           *(Series("up", {"job": SVC, "instance": i}, const(1, n)) for i in (I2, I3))]
    return [Case(p.spec.key, f"{I1} at {num(1 + p.T * 1.1)}x the median of three fires; {num(1 + p.T * 0.9)}x "
                 "does not; 3x of a pair does not", series,
                 [Expect(fire - p.e, [], "for: not elapsed"),
                  Expect(fire, [({"job": SVC, "instance": I1, "shape": shape}, p.T * 1.1)])]),
            Case(p.spec.key, f"{I1} at {num(1 + p.T * 1.1)}x the median, its scrapes stopped: incomplete data "
                 "count in no fleet comparison, silent", gap, [Expect(fire, [], "its data are incomplete")])]


def _step_series(rows: list[tuple[str, str, float]], n: int) -> list[Series]:
    """Per-step time series of (shape, instance, factor x 0.1 s per step) rows."""
    series = []
    for sh, inst, factor in rows:
        lab = {"job": SVC, "instance": inst, "shape": sh}
        series += [Series("stepwatch_pipeline_step_duration_seconds_count", lab, ramp(10, n)),
                   Series("stepwatch_pipeline_step_duration_seconds_sum", lab, ramp(10 * 0.1 * factor, n))]
    return series


ALERTS = (
    AlertDef("step_time_regression", _step_time_expr, ("instance", "shape"), _step_time_cases, rate_based=True,
             explains=("instance_slowdown",)),
    AlertDef("cache_hit_rate_shift", _hit_rate_expr, ("instance", "shape"), _hit_rate_cases, rate_based=True),
    AlertDef("memory_pressure", _memory_expr, ("instance", "device", "gpu"), _memory_cases),
    AlertDef("recompile", _recompile_expr, ("instance", "shape", "phase"), _recompile_cases),
    AlertDef("rank_skew", _rank_expr, ("instance", "rank"), _rank_cases, rate_based=True),
    AlertDef("oom", _oom_expr, ("instance", "shape", "stage"), _oom_cases, explains=("out_of_memory",)),
    AlertDef("cache_on_distilled", _distilled_expr, ("instance", "shape", "cache"), _distilled_cases),
    AlertDef("stream_stalling", _stream_stall_expr, ("instance",), _stream_stall_cases, rate_based=True),
    AlertDef("instance_slow", _instance_slow_expr, ("instance", "shape"), _instance_slow_cases, rate_based=True),
)
