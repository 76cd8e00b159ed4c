"""Quality alerts: the images themselves, as the sidecar's prober measures them."""

from __future__ import annotations

from stepwatch.alerts.defs.base import (
    SC,
    SIDECAR,
    AlertDef,
    Case,
    Expect,
    Series,
    Timing,
    born,
    const,
    need_window,
    pending,
    ramp,
)
from stepwatch.alerts.promql import events, num, since
from stepwatch.thresholds import AlertSpec, Thresholds, ThresholdsError

SUBSYSTEM = "quality"


# ----- quality drop ---------------------------------------------------------------------------

def _quality_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return ('  stepwatch_quality_psnr_decibels{stat="p10"}\n'
            "< on (job, instance, probe_set) group_left ()\n"
            f"  (stepwatch_quality_gate_decibels - {num(spec.threshold)})")


def _quality_cases(p: Timing) -> list[Case]:
    gate = p.th.quality.gate()
    kb = 3  # the low probe result arrives at the third scrape
    fire = kb * p.s + p.F
    n = p.n(fire + 2 * p.s)
    sc = {"job": SIDECAR, "instance": SC, "probe_set": "default"}
    series = [Series("stepwatch_quality_gate_decibels", sc, const(gate, n))]
    vals = {("svc-a", "p10"): gate - p.T + 0.1, ("svc-b", "p10"): gate - p.T - 0.1, ("svc-b", "p50"): gate - p.T - 1}
    for (iid, q), v in vals.items():
        values = born(kb, round(v, 6), n) if (iid, q) == ("svc-b", "p10") else const(round(v, 6), n)
        series.append(Series("stepwatch_quality_psnr_decibels", {**sc, "instance_id": iid, "stat": q}, values))
    low = {**sc, "instance_id": "svc-b", "stat": "p10"}
    return [Case(p.spec.key, "p10 just above gate - margin is silent; just below fires once its probe result "
                 "arrives; p50 is not read", series,
                 [Expect(fire - p.e, [], "only the result just above the line yet"),
                  Expect(fire, [(low, round(gate - p.T - 0.1, 6))])])]


# ----- probe failing --------------------------------------------------------------------------

def _missed_probes(spec: AlertSpec) -> int:
    missed = spec.extra.get("missed_probes")
    if isinstance(missed, bool) or not isinstance(missed, int) or missed < 1:
        raise ThresholdsError(f"alerts.{spec.key}.missed_probes: {missed!r} is not a whole number >= 1")
    return missed


def _probe_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    missed = _missed_probes(spec)
    # The no-success arm waits while the target was seen restarting or warming up within as many intervals: the
    # prober measures nothing then and counts no failure (exporter/sidecar/prober.py, its not-ready grace).
    return (events("stepwatch_quality_probe_failures_total", need_window(spec, profile), spec.threshold)
            + "\nor\n  (\n"
            f"      {since('stepwatch_quality_last_success_timestamp_seconds')}\n"
            "    > on (job, instance, probe_set)\n"
            f"      {missed} * stepwatch_quality_probe_interval_seconds\n"
            "  unless on (job, instance, probe_set)\n"
            f"      {since('stepwatch_quality_target_not_ready_timestamp_seconds')}\n"
            "    < on (job, instance, probe_set)\n"
            f"      {missed} * stepwatch_quality_probe_interval_seconds\n  )")


def _probe_failures_case(p: Timing) -> Case:
    kb = 4
    fire = kb * p.s + p.F
    n = p.n(fire + p.s)
    sc = {"job": SIDECAR, "instance": SC, "probe_set": "default"}
    series = [
        Series("stepwatch_quality_probe_failures_total", {**sc, "reason": "connect"}, f"0x{kb - 1} 1+1x{n - kb}"),
        Series("stepwatch_quality_probe_failures_total", {**sc, "reason": "timeout"}, const(0, n)),
        Series("stepwatch_quality_last_success_timestamp_seconds", sc, ramp(p.s, n)),
        Series("stepwatch_quality_probe_interval_seconds", sc, const(60, n)),
    ]
    return Case(p.spec.key, "failing on every attempt from t_b fires after for; the other reason stays 0",
                series, [Expect(fire - p.e, [], "for: not elapsed"),
                         Expect(fire, [({**sc, "reason": "connect"}, 1.0)])])


def _probe_stale_case(p: Timing) -> Case:
    missed = _missed_probes(p.spec)
    interval = 4 * p.s
    last = p.s  # the last success, as a unix time
    fire = p.align(missed * interval + last + 1) + p.F
    n = p.n(fire + p.s)
    series = []
    # (last success, last seen not ready) per set; ramp(p.s, n) is "now" at every evaluation
    sets = (("a", const(last, n), const(0, n)), ("b", ramp(p.s, n), const(0, n)), ("c", const(0, n), const(0, n)),
            ("d", const(last, n), ramp(p.s, n)))
    for ps, last_success, not_ready in sets:
        sc = {"job": SIDECAR, "instance": SC, "probe_set": ps}
        series += [Series("stepwatch_quality_last_success_timestamp_seconds", sc, last_success),
                   Series("stepwatch_quality_target_not_ready_timestamp_seconds", sc, not_ready),
                   Series("stepwatch_quality_probe_interval_seconds", sc, const(interval, n)),
                   Series("stepwatch_quality_probe_failures_total", {**sc, "reason": "connect"}, const(0, n))]
    return Case(p.spec.key, f"set a has not succeeded for {missed} probe intervals: fires; set b is fresh; "
                "set c never succeeded (0) and has no failures; set d has not succeeded either, but its target "
                "is restarting (seen not ready now): quiet", series,
                [Expect(fire - p.e, [], "for: not elapsed"),
                 Expect(fire, [({"job": SIDECAR, "instance": SC, "probe_set": "a"}, 1.0)])])


def _probe_cases(p: Timing) -> list[Case]:
    """Both arms: failures counted over the window, and no success for missed_probes intervals."""
    return [_probe_failures_case(p), _probe_stale_case(p)]


# ----- baseline stale -------------------------------------------------------------------------

def _stale_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return "stepwatch_quality_baseline_stale == 1"


def _stale_cases(p: Timing) -> list[Case]:
    n = p.n(p.F + p.s)
    series = [Series("stepwatch_quality_baseline_stale", {"job": SIDECAR, "instance": SC, "probe_set": ps},
                     const(v, n)) for ps, v in (("a", 1), ("b", 0))]
    return [Case(p.spec.key, "set a stale, set b current", series,
                 [pending(p), Expect(p.F or p.e, [({"job": SIDECAR, "instance": SC, "probe_set": "a"}, 1.0)])])]


# ----- SSIM drop (the worst frame) -------------------------------------------------------------

def _ssim_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return ('  stepwatch_quality_ssim_ratio{stat="min"}\n'
            "< on (job, instance, probe_set) group_left ()\n"
            f"  ((stepwatch_quality_ssim_gate_ratio > 0) - {num(spec.threshold)})")


def _ssim_cases(p: Timing) -> list[Case]:
    """A video set's worst frame just under its gate fires once its probe result arrives; one just over, a p10
    under the gate (not the worst-frame stat) and a set without an SSIM gate stay quiet."""
    gate = p.th.quality.ssim_gate["video"]
    kb = 3
    fire = kb * p.s + p.F
    n = p.n(fire + 2 * p.s)
    sc = {"job": SIDECAR, "instance": SC, "probe_set": "video"}
    series = [Series("stepwatch_quality_ssim_gate_ratio", sc, const(gate, n))]
    vals = {("svc-a", "min"): gate - p.T + 0.01, ("svc-b", "min"): gate - p.T - 0.01, ("svc-b", "p10"): gate - 0.1}
    for (iid, q), v in vals.items():
        values = born(kb, round(v, 6), n) if (iid, q) == ("svc-b", "min") else const(round(v, 6), n)
        series.append(Series("stepwatch_quality_ssim_ratio", {**sc, "instance_id": iid, "stat": q}, values))
    no_gate = {"job": SIDECAR, "instance": SC, "probe_set": "default"}  # an image set: gate 0, PSNR-gated only
    series += [Series("stepwatch_quality_ssim_gate_ratio", no_gate, const(0, n)),
               Series("stepwatch_quality_ssim_ratio", {**no_gate, "instance_id": "svc-a", "stat": "min"},
                      const(0.5, n))]
    low = {**sc, "instance_id": "svc-b", "stat": "min"}
    return [Case(p.spec.key, "worst frame just above the gate is silent; just below fires once its probe result "
                 "arrives; p10 and a set without a gate are not read", series,
                 [Expect(fire - p.e, [], "only the result just above the line yet"),
                  Expect(fire, [(low, round(gate - p.T - 0.01, 6))])])]


# Chunks 0-3 (the exporter's index ranges "0", "1" and "2-3") are the early ones: a drift alert needs them to pass.
EARLY_RANGES = '0|1|2-3'


def _drift_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    chunk, gate, by = "stepwatch_quality_stream_chunk_psnr_decibels", "stepwatch_quality_gate_decibels", \
        "(job, instance, probe_set)"
    line = f"({gate} - {num(spec.threshold)})"
    return (f'  min by {by} ({chunk}{{chunk_index!~"{EARLY_RANGES}"}})\n< on {by} {line}\n'
            f'and on {by}\n  min by {by} ({chunk}{{chunk_index=~"{EARLY_RANGES}"}})\n>= on {by} {line}')


def _drift_cases(p: Timing) -> list[Case]:
    """Late chunks under the gate with the early ones over it fire once the probe result arrives; late chunks
    just over the gate, and a set bad from its first chunk (not drift), stay quiet."""
    gate = p.th.quality.video_psnr_gate_db
    kb = 3
    fire = kb * p.s + p.F
    n = p.n(fire + 2 * p.s)
    series = []
    sets = {"drifts": (60.0, gate - p.T - 0.5), "holds": (60.0, gate - p.T + 0.5), "bad": (gate - 5, gate - 5)}
    for name, (early, late) in sets.items():
        sc = {"job": SIDECAR, "instance": SC, "probe_set": name}
        series += [Series("stepwatch_quality_gate_decibels", sc, const(gate, n)),
                   Series("stepwatch_quality_stream_chunk_psnr_decibels", {**sc, "chunk_index": "0"}, const(early, n)),
                   Series("stepwatch_quality_stream_chunk_psnr_decibels", {**sc, "chunk_index": "2-3"},
                          const(early, n)),
                   Series("stepwatch_quality_stream_chunk_psnr_decibels", {**sc, "chunk_index": "4-7"},
                          born(kb, late, n) if name == "drifts" else const(late, n))]
    drifts = {"job": SIDECAR, "instance": SC, "probe_set": "drifts"}
    return [Case(p.spec.key, "late chunks under the gate with early ones over it fire; just over, or bad from the "
                 "first chunk, stay quiet", series,
                 [Expect(fire - p.e, [], "the late range not yet probed"),
                  Expect(fire, [(drifts, gate - p.T - 0.5)])])]


ALERTS = (
    AlertDef("quality_drop", _quality_expr, ("instance", "probe_set", "instance_id", "stat"), _quality_cases),
    AlertDef("probe_failing", _probe_expr, ("instance", "probe_set", "reason"), _probe_cases),
    AlertDef("baseline_stale", _stale_expr, ("instance", "probe_set"), _stale_cases),
    AlertDef("quality_ssim", _ssim_expr, ("instance", "probe_set", "instance_id", "stat"), _ssim_cases),
    AlertDef("stream_drift", _drift_expr, ("instance", "probe_set"), _drift_cases),
)
