"""The overview's quality rows: image probes and similarity, then video quality.

Row functions of ``dashboards/overview.py``'s ``ROWS["quality"]``, in board order.
"""

from __future__ import annotations

from stepwatch.alerts.promql import (
    events,
    num,
    sel,
    since,
    sum_increase,
)
from stepwatch.dashboards.board import F_POOL, INST, RATE, Board, T


def quality_row(b: Board) -> None:
    b.row("Output quality")
    _similarity_panels(b)
    _probe_panels(b)
    b.stat(
        b.th.alert("baseline_stale").panel, """Whether each probe set's baseline loaded with matching checksums
        (ok) and matches this deployment's fingerprint (stale = captured on another deployment: no PSNR is
        reported until it is rebuilt with `stepwatch baseline capture`). Healthy: ok 1, stale 0.""", "none",
        [T(sel("stepwatch_quality_baseline_stale", INST), "{{probe_set}} stale"),
         T(sel("stepwatch_quality_baseline_ok", INST), "{{probe_set}} baseline ok")],
        alerts=["baseline_stale"], span=12, height=8)
    b.timeseries(
        b.th.alert("nonfinite_outputs").panel, """Images that came out NaN/Inf or all black per interval, by
        pool (the first one included). Healthy: none. Check FP8 and which layers (outliers saturating
        per-tensor scales).""", "short",
        [T(events(sel("stepwatch_service_images_nonfinite_total", INST, F_POOL), RATE, by="job, instance, pool"),
           "{{pool}} @ {{instance}}")],
        alerts=["nonfinite_outputs"], bars=True, min_=0, decimals=0, no_value="0")


def _similarity_panels(b: Board) -> None:
    qd = b.th.alert("quality_drop")
    psnr = "stepwatch_quality_psnr_decibels"
    gate = sel("stepwatch_quality_gate_decibels", INST)
    b.timeseries(
        qd.panel, f"""PSNR of the fixed probe set (prompt x seed) against the baseline images: p10 and p50 per
        probe set and target instance, the probe set's gate (dashed blue) and the alert line, gate -
        {num(qd.threshold)} dB (dashed red). Healthy: above the gate (> 35 dB invisible, 30-35 visible on a
        close look, < 28 obvious). A drop with normal performance panels: deployment fingerprint vs baseline,
        cache hit rate, PSNR by instance.""", "dB",
        [T(sel(psnr, INST, 'stat="p10"'), "{{probe_set}} p10 ({{instance_id}})"),
         T(sel(psnr, INST, 'stat="p50"'), "{{probe_set}} p50 ({{instance_id}})"),
         T(gate, "{{probe_set}} gate", "ref"),
         T(f"{gate} - {num(qd.threshold)}", f"{{{{probe_set}}}} alert (gate - {num(qd.threshold)} dB)", "limit")],
        alerts=["quality_drop"])
    ssim_gate = b.th.quality.ssim_gate["image"]
    b.timeseries(
        "Probe SSIM p10 / p50", f"""Structural similarity of the probe images against the baseline. Healthy:
        above {num(ssim_gate)} for images (dashed; video {num(b.th.quality.ssim_gate.get('video', ssim_gate))}).
        """, "none",
        [T(sel("stepwatch_quality_ssim_ratio", INST, 'stat=~"p10|p50"'),
           "{{probe_set}} {{stat}} ({{instance_id}})")],
        lines=[(ssim_gate, "orange")], decimals=3)


def _probe_panels(b: Board) -> None:
    pf = b.th.alert("probe_failing")
    b.timeseries(
        pf.panel, """Probe sets completed and probe requests failed per interval, by reason. Healthy: runs
        at the probe cadence, no failures. While failing, quality is unwatched.""", "short",
        [T(sum_increase(sel("stepwatch_quality_probe_runs_total", INST), RATE, "job, instance, probe_set"),
           "{{probe_set}} runs"),
         T(sum_increase(sel("stepwatch_quality_probe_failures_total", INST), RATE, "job, instance, probe_set, reason"),
           "{{probe_set}} failed: {{reason}}")],
        alerts=["probe_failing"], min_=0)
    missed = int(pf.extra.get("missed_probes", 3))
    b.timeseries(
        "Time since the last successful probe", f"""Seconds since the probe set last completed, against
        {missed} probe intervals (dashed red: the probe-failing alert's clock). Healthy: a sawtooth under the
        line.""", "s",
        [T(since(sel("stepwatch_quality_last_success_timestamp_seconds", INST)),
           "{{probe_set}} @ {{instance}}"),
         T(f"{missed} * {sel('stepwatch_quality_probe_interval_seconds', INST)}",
           f"{{{{probe_set}}}} alert ({missed} intervals)", "limit")],
        alerts=["probe_failing"], min_=0)


def video_quality_row(b: Board) -> None:
    qs = b.th.alert("quality_ssim")
    worst = 'stat=~"min|p10"'
    ssim, gate = "stepwatch_quality_ssim_ratio", f'({sel("stepwatch_quality_ssim_gate_ratio", INST)} > 0)'
    b.row("Video quality (worst frame)")
    b.timeseries(
        qs.panel, f"""SSIM of the probe set's worst frame (stat min: the worst frame of a video set, scored
        frame by frame against the baseline) and p10, per probe set and target instance, with the set's SSIM
        gate (dashed; video {num(b.th.quality.ssim_gate.get('video', 0))} by the seeds). Healthy: the worst frame
        above the gate. Only sets with an SSIM gate (video and high-quality sets) are alerted on.""", "none",
        [T(f"{sel(ssim, INST, worst)} and on (job, instance, probe_set) {gate}",
           "{{probe_set}} {{stat}} ({{instance_id}})"),
         T(f"{gate} - {num(qs.threshold)}", "{{probe_set}} SSIM gate", "limit")],
        alerts=["quality_ssim"], decimals=3)
    psnr, pgate = "stepwatch_quality_psnr_decibels", sel("stepwatch_quality_gate_decibels", INST)
    video = f'({sel("stepwatch_quality_ssim_gate_ratio", INST)} > 0)'  # the sets with an SSIM gate
    b.timeseries(
        "Probe PSNR worst frame vs gate, video sets", f"""PSNR of the worst frame and p10 over the frames of
        video probe sets, with the set's PSNR gate (video {num(b.th.quality.video_psnr_gate_db)} dB by the
        seeds, dashed). Healthy: above the gate; the PSNR alert reads p10 (gate -
        {num(b.th.quality.alert_margin_db)} dB), the SSIM alert the worst frame.""", "dB",
        [T(f"{sel(psnr, INST, worst)} and on (job, instance, probe_set) {video}",
           "{{probe_set}} {{stat}} ({{instance_id}})"),
         T(f"{pgate} and on (job, instance, probe_set) {video}", "{{probe_set}} gate", "ref")])
