"""The on-call overview board: the "Alerts" row, then one function per row, grouped by subsystem.

``ROWS`` maps each subsystem of ``stepwatch.thresholds.SUBSYSTEMS`` to its row functions,
and ``overview()`` lays them out in that order, so the board reads as the alerts are grouped
(what users see, the pipeline behind it, the output, the monitoring itself).  Adding a panel for
a new alert means adding it to its subsystem's row function: first in the row when it is the
alert's "open this panel first" (its ``panel:`` in stepwatch/thresholds.yaml).

Every query is built from the PromQL vocabulary of ``stepwatch.alerts.promql``; every number in a
line, band or title comes from the thresholds source, never a literal here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client.utils import floatToGoString

from stepwatch.alerts.promql import (
    above_bucket,
    cache_hit_ratio,
    device_peak_flops,
    events,
    firing,
    floored_multiple,
    mean_step_time,
    num,
    over_positive,
    pct,
    quantile,
    ratio_of_rates,
    ratio_to_fastest,
    sel,
    since,
    stage_share,
    sum_increase,
    sum_rate,
)
from stepwatch.dashboards.board import F_INSTANCE, F_POOL, F_SHAPE, GREEN, RED, Board, T
from stepwatch.thresholds import ALERT_PREFIX, SUBSYSTEMS, Thresholds, agent_job, capacity_headroom, stall_floor

OVERVIEW_UID = "stepwatch-overview"
RATE = "$__rate_interval"
INST = F_INSTANCE  # every query filters by the instance variable

Row = Callable[[Board], None]


def diagnosis(th: Thresholds, key: str) -> float | None:
    """A number of the thresholds' diagnosis section, or None when the file does not define it."""
    v = th.diagnosis.get(key)
    return float(v) if isinstance(v, (int, float)) else None


# ----- the alerts row (first, whatever the subsystem) ----------------------------------------------

def alerts_row(b: Board) -> None:
    b.row("Alerts")
    b.timeseries(
        "Firing stepwatch alerts", """Stepwatch alerts firing, per alert: how many label sets (instances,
        shapes, pools, ...) fire. Healthy: empty. Each alert names the panel to open first; the runbook links
        are on those panels.""", "short",
        [T(f'sum by (alertname, severity) ({firing(f"{ALERT_PREFIX}.*")})',
           "{{alertname}} ({{severity}})")], min_=0, decimals=0, span=24, height=6, no_value="none firing")


# ----- service ------------------------------------------------------------------------------------

def traffic_row(b: Board) -> None:
    er = b.th.alert("error_ratio")
    sreq = sel("stepwatch_service_requests_total", INST, F_POOL)
    b.row("Traffic and latency")
    b.timeseries(
        "Requests by pool and code", """Generation requests per second by pool and HTTP code. Healthy: all 200;
        429 = queue past its hard limit, 503 = warming up or worker restarting, 507 = out of memory.""",
        "reqps", [T(sum_rate(sreq, RATE, "pool, code"), "{{pool}} {{code}}")], min_=0)
    b.timeseries(
        er.panel, """Share of generation requests answered 5xx, per pool (0 when none failed). Healthy: 0.""",
        "percentunit",
        [T(ratio_of_rates(sel("stepwatch_service_requests_total", INST, F_POOL, 'code=~"5.."'), sreq, RATE,
                          "job, pool", zero_fill=True), "{{pool}}")],
        alerts=["error_ratio"], lines=[(er.threshold, RED)], min_=0)
    lat = sel("stepwatch_service_request_duration_seconds_bucket", INST, F_POOL)
    b.timeseries(
        "Latency p50 / p99, by pool", """End-to-end latency (queue + work) of generation requests per pool,
        with the pool's latency SLO dashed. Healthy: p99 under the SLO. p99 up with p50 flat = a few slow
        requests (serving recompiles, a queue backlog in one pool).""", "s",
        [T(quantile(0.5, lat, RATE, "pool"), "{{pool}} p50"), T(quantile(0.99, lat, RATE, "pool"), "{{pool}} p99"),
         T(f"max by (pool) ({sel('stepwatch_queue_slo_seconds', INST, F_POOL)})", "{{pool}} SLO", "ref")],
        min_=0, span=24)


def queue_row(b: Board) -> None:
    qw = b.th.alert("queue_wait")
    b.row("Queue")
    b.timeseries(
        qw.panel, f"""Estimated queue wait (GPU-seconds of queued work / workers) as a share of the pool's
        latency SLO. Healthy: well under {pct(qw.threshold)}; above it, scale out (a cold start takes minutes:
        weights + compile).""", "percentunit",
        [T(sel("instance_pool:stepwatch_queue_estimated_wait_seconds:slo_ratio", INST, F_POOL),
           "{{pool}} @ {{instance}}")],
        alerts=["queue_wait"], lines=[(qw.threshold, RED)], min_=0)
    qwait = sel("stepwatch_queue_wait_seconds_bucket", INST, F_POOL)
    b.timeseries(
        f"Estimated queue wait vs SLO x {num(qw.threshold)}, by pool", f"""Estimated queue wait in seconds and
        the scale-out line (SLO x {num(qw.threshold)}, dashed red), with the measured p99 wait of the requests
        that left the queue. Healthy: the estimate stays under the dashed line.""", "s",
        [T(sel("stepwatch_queue_estimated_wait_seconds", INST, F_POOL), "{{pool}} estimated @ {{instance}}"),
         T(quantile(0.99, qwait, RATE, "pool"), "{{pool}} measured p99"),
         T(f"{sel('stepwatch_queue_slo_seconds', INST, F_POOL)} * {num(qw.threshold)}",
           f"{{{{pool}}}} scale out (SLO x {num(qw.threshold)})", "limit")],
        alerts=["queue_wait"], min_=0)
    b.timeseries(
        "Queue depth, by pool", """Requests waiting for a worker, per pool. Healthy: 0 to a few. Depth alone
        is not the signal (a 2048² request weighs ~16x a 512² one); the estimated wait is.""", "short",
        [T(sel("stepwatch_queue_depth", INST, F_POOL), "{{pool}} @ {{instance}}")], min_=0, decimals=0,
        span=12, height=6)
    _worker_stall_panel(b)


def fleet_row(b: Board) -> None:
    """The pool's capacity by the seeds' formula: instances needed against instances ready."""
    pc = b.th.alert("pool_capacity")
    window = b.th.profiles["production"].rate_window  # recorded in both rule files under the same names
    needed, ready = f"job:stepwatch_service_instances:needed_rate{window}", "job:stepwatch_service_instances:ready"
    b.row("Fleet: capacity")
    b.timeseries(
        pc.panel, f"""Instances the pool needs (requests per second, plus queue growth, x worker seconds per
        request x {num(capacity_headroom(pc))}, over {window}) against the instances ready.
        Healthy: needed under ready. Needed above ready for minutes ({pc.name}): add instances before the queues
        grow; they take minutes to load and compile.""", "short",
        [T(needed, "needed ({{job}})"), T(ready, "ready ({{job}})", "limit")],
        alerts=["pool_capacity"], min_=0)
    b.timeseries(
        "Demand and seconds per request, by pool", f"""What the needed line is made of: requests per second per
        pool (all answers, 429s included: they are demand too) and the worker seconds one request costs (latency
        minus queue wait, over {window}). A rising request rate is more load; rising seconds per request are
        slower instances or larger requests.""", "short",
        [T(sum_rate(sel("stepwatch_service_requests_total", F_POOL), RATE, "job, pool"), "{{pool}} requests/s"),
         T(sel(f"pool:stepwatch_service_work_seconds:mean_rate{window}", F_POOL), "{{pool}} seconds/request")],
        min_=0)


def _node_agents_panel(b: Board) -> None:
    """Each node's agent as the central evaluators scrape it, beside the balancer's view of each replica."""
    ns = b.th.alert("node_silent")
    b.timeseries(
        ns.panel, f"""Each fleet node's Prometheus agent (1 = the central evaluators scrape it) and each replica
        as the load balancer's health checks see it (1 = up). Healthy: every line at 1. An agent at 0 is a silent
        node ({ns.name}): its replicas' series stop and their last values stay for five minutes; the balancer's
        lines tell whether its replicas went with it (node down) or still serve (only the agent).""", "short",
        [T(f'up{{job="{agent_job(b.th)}"}}', "agent {{node}}"),
         T('max by (server) (haproxy_server_status{state="UP"})', "balancer: {{server}}")],
        alerts=["node_silent"], min_=0, decimals=0)


def fleet_instances_row(b: Board) -> None:
    """Each instance against the median instance of its shape: the outlier stands out from the lines at 100%."""
    sl = b.th.alert("instance_slow")
    step = mean_step_time(RATE, "job, instance, shape", F_SHAPE)
    mine = mean_step_time(RATE, "job, instance, shape", INST, F_SHAPE)
    b.row("Fleet: instances side by side")
    b.timeseries(
        sl.panel, f"""Each instance's mean step time per shape as a share of the median instance's for that shape
        (all instances, whatever the instance filter). Healthy: every line near 100%; one line above
        {pct(1 + sl.threshold)} with the others at 100% is one bad instance ({sl.name}: a neighbour, a throttled
        GPU, another build); every line moving together is the load, not an instance.""", "percentunit",
        [T(f"  {mine}\n/ on (job, shape) group_left\n  quantile by (job, shape) (0.5, {step})",
           "{{instance}} {{shape}}")],
        alerts=["instance_slow"], lines=[(1 + sl.threshold, RED)], min_=0)
    b.timeseries(
        "Per-step time by instance", """Each instance's mean seconds per step per shape, side by side (the
        numbers behind the share on the left). Healthy: instances of a shape together.""", "s",
        [T(mine, "{{instance}} {{shape}}")], min_=0)
    _fleet_quality_panel(b)


def _fleet_quality_panel(b: Board) -> None:
    """Each instance's probe PSNR against the median instance's for the probe set (the quality runbook's
    one-instance check, as a picture)."""
    spread = b.th.diagnosis["instance_psnr_spread_db"]
    p10 = 'stepwatch_quality_psnr_decibels{stat="p10"}'
    b.timeseries(
        "Probe PSNR p10 vs the fleet median, by instance", f"""Each instance's p10 PSNR of a probe set minus the
        median instance's for that set, in dB (all instances). Healthy: every line near 0. One line more than
        {num(spread)} dB under (dashed red) with the others at 0 is one bad instance (FP8 scales, another
        parallel degree, a broken GPU: the quality-drop runbook's "one instance much worse" check); every line
        at 0 while PSNR drops is the deployment or the cache, not an instance.""", "dB",
        [T(f"  {p10}\n- on (probe_set) group_left\n  quantile by (probe_set) (0.5, {p10})",
           "{{instance_id}} {{probe_set}}")],
        lines=[(-spread, RED)])


def _worker_stall_panel(b: Board) -> None:
    ws = b.th.alert("worker_stalled")
    floor = stall_floor(ws, "production")  # one board for both; the drill stack's shorter floor is in its rules
    busy, expected = (sel(m, INST, F_POOL) for m in ("stepwatch_worker_busy_seconds",
                                                      "stepwatch_worker_expected_seconds"))
    b.timeseries(
        ws.panel, f"""Seconds the worker has spent on the generation in flight, with its stall line: {num(ws.threshold)}
        x the queue's prediction, never below {num(floor)} s (dashed red). Healthy: a sawtooth that drops to 0 as
        each request ends, under the line. A ramp that keeps climbing = a hung worker (a frozen process, a rank
        stuck in a collective); the service restarts it at twice the line.""", "s",
        [T(busy, "{{pool}} busy @ {{instance}}"),
         T(f"{floored_multiple(expected, ws.threshold, floor)} and {busy} > 0",
           f"{{{{pool}}}} stall line (x {num(ws.threshold)})", "limit")],
        alerts=["worker_stalled"], min_=0, span=12, height=6)


# ----- pipeline -----------------------------------------------------------------------------------

def denoising_row(b: Board) -> None:
    b.row("Denoising: step time, stages, MFU")
    _step_time_panels(b)
    _mfu_panels(b)
    b.timeseries(
        "Stage time per request (text_encode / denoise / vae_decode)", """Mean seconds per request in each
        stage, per shape. Healthy: denoise dominates (~97% on a GPU); text_encode is small and flat; vae_decode
        is short but the memory peak.""", "s",
        [T(ratio_of_rates(sel("stepwatch_pipeline_stage_duration_seconds_sum", INST, F_SHAPE),
                          sel("stepwatch_pipeline_stage_duration_seconds_count", INST, F_SHAPE), RATE, "shape, stage"),
           "{{shape}} {{stage}}")], min_=0, span=24)


def _step_time_panels(b: Board) -> None:
    st = b.th.alert("step_time_regression")
    step_mean = mean_step_time(RATE, "job, instance, shape", INST, F_SHAPE)
    base = sel("stepwatch_baseline_step_duration_seconds", INST, F_SHAPE)
    b.timeseries(
        st.panel, f"""Mean time of one denoising step (all CFG branches) per shape, and each shape's alert line:
        its baseline x {num(st.threshold)} (dashed red). Healthy: every shape under its line. Above it: check
        rank skew, GPU clocks and temperature, other processes, compile disabled.""", "s",
        [T(step_mean, "{{shape}} @ {{instance}}"),
         T(f"{base} * {num(st.threshold)}", f"{{{{shape}}}} alert (baseline x {num(st.threshold)})", "limit")],
        alerts=["step_time_regression"], min_=0)
    b.timeseries(
        "Per-step time / baseline, by shape", f"""Per-step time as a share of the shape's baseline (what the
        step-time alert compares). Healthy: about 100%; the alert line is {pct(st.threshold)}.""",
        "percentunit",
        [T(over_positive(f"(\n{step_mean}\n)", base, "job, instance, shape"), "{{shape}} @ {{instance}}")],
        alerts=["step_time_regression"], lines=[(st.threshold, RED)], min_=0)


def _mfu_panels(b: Board) -> None:
    achieved = ratio_of_rates(sel("stepwatch_ledger_flops_total", INST, F_SHAPE),
                              sel("stepwatch_pipeline_step_duration_seconds_sum", INST, F_SHAPE), RATE,
                              "job, instance, shape")
    peak = device_peak_flops(INST)
    mfu_floor = diagnosis(b.th, "mfu_floor")
    floor_text = (f"below {num(mfu_floor)} (dashed) suspect eager mode or compile off" if mfu_floor is not None
                  else "well below that, suspect eager mode or compile off")
    b.timeseries(
        "MFU, by shape", f"""Model FLOPs utilization from the FLOPs ledger: nominal denoising FLOPs / step
        seconds / the device's dense peak FLOP/s, over the interval and for the last request. GPU-Util says
        nothing here; this does. Healthy on a compiled DiT: ~0.5 (seeds: eager ~0.31, compiled ~0.49);
        {floor_text}. Empty where the device peak is unknown (CPU).""", "percentunit",
        [T(f"(\n{achieved}\n)\n/ on (job, instance) group_left\n  {peak}", "{{shape}} @ {{instance}}"),
         T(f"{sel('stepwatch_ledger_mfu_ratio', INST, F_SHAPE)} > 0", "{{shape}} last request")],
        lines=[(mfu_floor, "orange")] if mfu_floor is not None else [], min_=0, max_=1)
    b.timeseries(
        "Achieved FLOP/s vs device peak, by shape", """Nominal denoising FLOPs per second of denoising time
        (the ledger's numerator of MFU) and the device's dense peak (dashed). Healthy: a stable fraction of
        the peak per shape; a drop at the same shape = the same work ran slower.""", "flops",
        [T(achieved, "{{shape}} @ {{instance}}"), T(peak, "device peak @ {{instance}}", "ref")], min_=0)


def compile_row(b: Board) -> None:
    b.row("Compile")
    b.timeseries(
        b.th.alert("recompile").panel, """torch.compile compilations while serving, per shape that triggered
        them, per interval. Healthy: none after warm-up. A bar = requests of that shape waited for a compile
        (p99 up, p50 flat): add the shape to the warm-up list.""", "short",
        [T(events(sel("stepwatch_compile_total", INST, F_SHAPE, 'phase="serving"'), RATE, by="job, instance, shape"),
           "{{shape}} @ {{instance}}")],
        alerts=["recompile"], bars=True, min_=0, decimals=0, no_value="0")
    b.timeseries(
        "Compile seconds, by shape and phase", """Seconds spent compiling per interval, by the shape that
        triggered it and the phase (warmup at start, serving after). Healthy: warmup only, at start.""", "s",
        [T(events(sel("stepwatch_compile_duration_seconds_sum", INST, F_SHAPE), RATE,
                  by="job, instance, shape, phase"), "{{shape}} {{phase}}")], bars=True, min_=0, no_value="0")


def cache_row(b: Board) -> None:
    ch = b.th.alert("cache_hit_rate_shift")
    hbase = sel("stepwatch_baseline_cache_hit_ratio", INST, F_SHAPE)
    b.row("Cross-step cache")
    b.timeseries(
        ch.panel, f"""Share of transformer calls that reused the cached residual, per shape, inside its baseline
        band: baseline x (1 ± {num(ch.threshold)}) (dashed red). Healthy: inside the band (a fixed deployment
        has a stable hit rate per shape). Above: quality at risk (check the PSNR row); below: speed lost;
        any hits on a distilled few-step model are wrong.""", "percentunit",
        [T(cache_hit_ratio(RATE, "job, instance, shape", INST, F_SHAPE), "{{shape}} @ {{instance}}"),
         T(f"{hbase} * {num(1 - ch.threshold)}", f"{{{{shape}}}} band low (x {num(1 - ch.threshold)})", "limit"),
         T(f"{hbase} * {num(1 + ch.threshold)}", f"{{{{shape}}}} band high (x {num(1 + ch.threshold)})",
           "limit")],
        alerts=["cache_hit_rate_shift"], min_=0, max_=1)
    late = diagnosis(b.th, "late_hit_position")
    late_text = f"Hits past {pct(late)} blur details." if late is not None else "Late hits blur details."
    pos = sel("stepwatch_cache_hit_position_ratio_bucket", INST)  # all shapes: no shape label (budget)
    b.heatmap(
        "Cache hit positions (step / steps)", f"""Where in the denoising trajectory cache hits land (0 = first
        step, 1 = last), hits per interval, all shapes together. Healthy: in the middle; first and last steps
        are always computed. {late_text}""", "percentunit",
        T(sum_increase(pos, RATE, "le"), "{{le}}", heatmap=True), alerts=["cache_hit_rate_shift"])
    b.timeseries(
        "Late cache hits: p90 hit position, by instance", f"""90th percentile of where hits land in the
        trajectory, all shapes of an instance together (the histogram has no shape label: a per-shape layout
        would cost 13 series per shape). Healthy: in the middle of the trajectory; late hits blur details
        (threshold too high). {late_text}""",
        "percentunit", [T(quantile(0.9, pos, RATE, "job, instance"), "{{instance}}")],
        lines=[(late, "orange")] if late is not None else [], min_=0, max_=1, span=24, height=6)


def ranks_row(b: Board) -> None:
    rk = b.th.alert("rank_skew")
    per_step = ratio_of_rates(sel("stepwatch_rank_busy_seconds_total", INST), sel("stepwatch_rank_steps_total", INST),
                              RATE, "job, instance, rank")
    b.row("Ranks (sequence parallel)")
    b.timeseries(
        rk.panel, f"""Each rank's busy time per step (from the group's release by one collective to the rank's
        arrival at the next, plus its waits for a CPU) over the interval,
        as a share of the fastest rank's, and the last request's ratio (what the alert reads). Healthy: all
        ranks near 100%; the alert line is {pct(1 + rk.threshold)}. Every step waits for the slowest rank:
        check that GPU's clock, temperature, processes and link.""", "percentunit",
        [T(ratio_to_fastest(per_step), "rank {{rank}} @ {{instance}}"),
         T(sel("instance_rank:stepwatch_rank_step_duration_seconds:ratio_to_fastest", INST),
           "rank {{rank}} last request")],
        alerts=["rank_skew"], lines=[(1 + rk.threshold, RED)], min_=0)
    b.timeseries(
        "Per-rank busy time per step", """Seconds each rank takes per denoising step (over the interval), the
        part of it its threads waited for a CPU, and each rank's mean in the last request. Healthy: ranks
        equal. A CPU-wait line far above the others: another process on that rank's CPUs. Empty with one
        rank.""", "s",
        [T(per_step, "rank {{rank}} busy/step @ {{instance}}"),
         T(ratio_of_rates(sel("stepwatch_rank_cpu_wait_seconds_total", INST), sel("stepwatch_rank_steps_total", INST),
                          RATE, "job, instance, rank"), "rank {{rank}} CPU wait/step @ {{instance}}"),
         T(sel("stepwatch_rank_step_duration_seconds", INST), "rank {{rank}} last request")],
        alerts=["rank_skew"], min_=0)


def memory_row(b: Board) -> None:
    mp = b.th.alert("memory_pressure")
    peak_req = sel("stepwatch_memory_peak_bytes", INST, 'stage="request"')
    b.row("Memory and OOM")
    b.timeseries(
        mp.panel, f"""Peak memory of requests / the device's capacity: the largest request in the interval (to
        the histogram's bucket bound, so every request counts, whatever the scrape interval; one outlier
        among hundreds is what the alert is about, so no percentile) and the last request (a gauge: the next
        request may overwrite an outlier before a scrape). Healthy: under {pct(mp.threshold)} (dashed); above
        it the next larger request may OOM; above 100% is an OOM's failed demand.""", "percentunit",
        [T(quantile(1, sel("stepwatch_memory_peak_ratio_bucket", INST), RATE, "job, instance, device"),
           "{{device}} largest request @ {{instance}}"),
         T(f"  max by (job, instance, device) ({peak_req})\n"
           f"/\n  max by (job, instance, device) ({sel('stepwatch_memory_capacity_bytes', INST)} > 0)",
           "{{device}} last request")],
        alerts=["memory_pressure"], lines=[(mp.threshold, RED)], min_=0)
    b.timeseries(
        f"Requests above {pct(mp.threshold)} of memory", f"""Requests per interval whose peak memory passed
        {pct(mp.threshold)} of capacity (what the memory alert counts). Healthy: none.""", "short",
        [T(above_bucket("stepwatch_memory_peak_ratio", floatToGoString(mp.threshold), RATE,
                        "job, instance, device", INST), "{{device}} @ {{instance}}")],
        alerts=["memory_pressure"], bars=True, min_=0)
    _memory_by_stage_and_oom(b)


def _memory_by_stage_and_oom(b: Board) -> None:
    mp = b.th.alert("memory_pressure")
    cap = sel("stepwatch_memory_capacity_bytes", INST)
    b.timeseries(
        "Peak memory by stage", f"""Peak memory of the last request in each stage (on an OOM: the demand that
        failed), with the capacity and {pct(mp.threshold)} of it (dashed). Healthy: vae_decode is the peak and
        stays under the red line; untiled VAE decode at high resolution is the usual OOM.""", "bytes",
        [T(f"max by (instance, device, stage) ({sel('stepwatch_memory_peak_bytes', INST)})",
           "{{device}} {{stage}}"),
         T(cap, "{{device}} capacity", "ref"),
         T(f"{cap} * {num(mp.threshold)}", f"{{{{device}}}} {pct(mp.threshold)} of capacity", "limit")],
        min_=0)
    b.timeseries(
        b.th.alert("oom").panel, """Requests that failed with out-of-memory per interval, by the stage that
        was running and the shape (the first OOM of a shape included). Healthy: none. vae_decode at high
        resolution = VAE tiling off; the instance keeps serving other shapes.""", "short",
        [T(events(sel("stepwatch_oom_total", INST, F_SHAPE), RATE, by="job, instance, shape, stage"),
           "{{stage}} {{shape}} @ {{instance}}")],
        alerts=["oom"], bars=True, min_=0, decimals=0, no_value="0")


# ----- quality ------------------------------------------------------------------------------------

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


# ----- monitoring ---------------------------------------------------------------------------------

def health_row(b: Board) -> None:
    b.row("Health: scrape targets, exporter, sidecar, GPUs")
    _stepwatch_health_panels(b)
    _gpu_memory_and_load_panels(b)
    _gpu_clock_and_error_panels(b)


def _stepwatch_health_panels(b: Board) -> None:
    up = {"0": ("DOWN", RED), "1": ("UP", GREEN)}
    b.stat(
        b.th.alert("target_down").panel, """Whether Prometheus can scrape each stepwatch target (service and
        sidecar). Healthy: all UP. A DOWN target blinds every alert that reads it.""", "none",
        [T(sel("up", f'job=~"{b.th.job_regex}"', INST), "{{job}} {{instance}}")],
        alerts=["target_down"], mappings=up)
    _node_agents_panel(b)
    b.timeseries(
        b.th.alert("exporter_errors").panel, """Errors inside stepwatch's own hooks per interval, by component
        (the first one included). The pipeline never sees them, but that hook's signals are missing or wrong.
        Healthy: none.""", "short",
        [T(events(sel("stepwatch_exporter_errors_total", INST), RATE, by="job, instance, component"),
           "{{component}} @ {{instance}}")],
        alerts=["exporter_errors"], bars=True, min_=0, decimals=0, no_value="0", span=6, height=6)
    b.stat(
        "Worker and NVML up", """Worker process alive, service warmed up, and the sidecar's NVML collector
        answering. Healthy: all 1 (NVML is 0 on a machine without a GPU, and the GPU panels are then
        empty).""", "none",
        [T(sel("stepwatch_worker_up", INST), "worker up {{instance}}"),
         T(sel("stepwatch_service_ready", INST), "ready {{instance}}"),
         T(sel("stepwatch_nvml_up", INST), "NVML up {{instance}}")],
        mappings=up)
    b.timeseries(
        "Worker restarts", """Worker processes restarted after dying, per interval. Healthy: none; each
        restart fails its in-flight requests and costs a warm-up.""", "short",
        [T(sum_increase(sel("stepwatch_worker_restarts_total", INST), RATE, "instance"), "{{instance}}")],
        bars=True, min_=0, span=6, height=6)


def _gpu_memory_and_load_panels(b: Board) -> None:
    mp = b.th.alert("memory_pressure")
    total = sel("stepwatch_gpu_memory_total_bytes", INST)
    b.timeseries(
        "GPU memory used / total (NVML)", f"""Device memory in use per GPU as NVML sees it (all processes),
        with the total and {pct(mp.threshold)} of it. Healthy: stable; a climb without traffic = another
        process or a leak.""", "bytes",
        [T(sel("stepwatch_gpu_memory_used_bytes", INST), "GPU {{gpu}} used @ {{instance}}"),
         T(total, "GPU {{gpu}} total", "ref"),
         T(f"{total} * {num(mp.threshold)}", f"GPU {{{{gpu}}}} {pct(mp.threshold)}", "limit")], min_=0)
    b.timeseries(
        "GPU utilization (NVML)", """Share of time a kernel ran. Says nothing about efficiency (eager FLUX shows
        ~100% at MFU 0.31): read MFU for that. Healthy: high while serving.""", "percentunit",
        [T(sel("stepwatch_gpu_utilization_ratio", INST), "GPU {{gpu}} @ {{instance}}")], min_=0, max_=1)


def _gpu_clock_and_error_panels(b: Board) -> None:
    b.timeseries(
        "GPU SM clock and throttling", """SM clock per GPU, and 1 while a clock throttle reason is active.
        Healthy: clocks flat at the application clock, no throttle; one GPU lower = the straggler rank's
        GPU.""", "hertz",
        [T(sel("stepwatch_gpu_sm_clock_hertz", INST), "GPU {{gpu}} @ {{instance}}"),
         T(f"{sel('stepwatch_gpu_throttle_active', INST)} == 1", "GPU {{gpu}} throttled: {{reason}}")],
        min_=0)
    b.timeseries(
        "GPU temperature", """Temperature per GPU. Healthy: steady under the slowdown temperature; a hot GPU
        throttles its clock and drags its rank.""", "celsius",
        [T(sel("stepwatch_gpu_temperature_celsius", INST), "GPU {{gpu}} @ {{instance}}")], min_=0)
    b.timeseries(
        "GPU power", """Power draw per GPU. Healthy: high and steady while serving; a GPU at its power limit
        with a lower clock is power-throttled.""", "watt",
        [T(sel("stepwatch_gpu_power_watts", INST), "GPU {{gpu}} @ {{instance}}")], min_=0)
    b.timeseries(
        "GPU XID and NVML read errors", """XID errors reported by NVML events and failed NVML reads per GPU
        per interval. Healthy: none; an XID usually means a driver or hardware fault on that GPU.""", "short",
        [T(sum_increase(sel("stepwatch_gpu_xid_errors_total", INST), RATE, "instance, gpu"), "GPU {{gpu}} XID"),
         T(sum_increase(sel("stepwatch_gpu_read_errors_total", INST), RATE, "instance, gpu"),
           "GPU {{gpu}} read errors")], bars=True, min_=0)


# ----- video jobs and few-step serving ------------------------------------------------------------

def video_row(b: Board) -> None:
    pool = sel("stepwatch_video_jobs_finished_total", INST, F_POOL)
    b.row("Video jobs")
    b.timeseries(
        b.th.alert("video_jobs_failing").panel, """Video jobs that ended per interval, by pool and outcome
        (succeeded, failed, cancelled). Healthy: no failed. A job fails after its 202, so no HTTP error shows it;
        its error code says why (out_of_memory, worker_died, timeout).""", "short",
        [T(sum_increase(pool, RATE, "job, instance, pool, outcome"), "{{pool}} {{outcome}} @ {{instance}}")],
        alerts=["video_jobs_failing"], bars=True, min_=0, decimals=0, no_value="0")
    slo = sel("stepwatch_queue_slo_seconds", INST, F_POOL)
    b.timeseries(
        "Video jobs in flight and the oldest job's age", """Video jobs queued and running (left), and the
        age of the oldest one still in flight against the pool's SLO (dashed). Healthy: a few jobs, the oldest
        younger than the SLO. A growing backlog with the oldest job ageing = under-provisioned pool or a
        stuck worker.""", "s",
        [T(sel("stepwatch_video_oldest_job_age_seconds", INST, F_POOL), "{{pool}} oldest job @ {{instance}}"),
         T(f"{slo} and on (job, instance, pool) {sel('stepwatch_video_oldest_job_age_seconds', INST, F_POOL)}",
           "{{pool}} SLO", "ref"),
         T(sel("stepwatch_video_jobs_depth", INST, F_POOL), "{{pool}} {{state}} jobs")], min_=0)
    dur = sel("stepwatch_video_job_duration_seconds_bucket", INST, F_POOL)
    b.timeseries(
        "Video job time and time per frame", """Creation to completion of succeeded jobs (p50, p99: queue,
        generation and encoding) and seconds per delivered frame. Healthy: p99 under the pool's SLO; seconds per
        frame flat for a fixed mix (a video's cost is fixed at admission by size, frames, steps and CFG).""",
        "s",
        [T(quantile(0.5, dur, RATE, "pool"), "{{pool}} p50"), T(quantile(0.99, dur, RATE, "pool"), "{{pool}} p99"),
         T(ratio_of_rates(sel("stepwatch_video_job_duration_seconds_sum", INST, F_POOL),
                          sel("stepwatch_video_frames_total", INST, F_POOL), RATE, "pool"), "{{pool}} per frame")],
        min_=0, span=24, height=6)


def distilled_row(b: Board) -> None:
    b.row("Few-step (distilled) serving")
    b.timeseries(
        b.th.alert("cache_on_distilled").panel, f"""Cache hits on few-step requests (at most
        {b.th.few_step_max_steps} steps, no CFG: a distilled model's) per interval, by shape and cache. Healthy:
        none, ever: a distilled model moves the latent a long way every step, and a reused step blurs or breaks
        the output. No baseline is needed to read it.""", "short",
        [T(events(sel("stepwatch_cache_few_step_hits_total", INST, F_SHAPE), RATE, by="job, instance, shape, cache"),
           "{{shape}} {{cache}} @ {{instance}}")],
        alerts=["cache_on_distilled"], bars=True, min_=0, decimals=0, no_value="0")
    b.timeseries(
        "Text encoder + VAE share of request time, by shape", """Seconds in text_encode and vae_decode as a
        share of the request. They run once per request whatever the steps, so few-step models make them
        visible: the seeds measure 2.6% of a 28-step FLUX.1-dev request and 15.6% of a 4-step schnell one.
        Healthy: stable per shape; on a few-step shape, these stages are where the next speed-up is.""",
        "percentunit", [T(stage_share(RATE, "text_encode|vae_decode", "job, instance, shape", INST, F_SHAPE),
                          "{{shape}} @ {{instance}}")], min_=0, max_=1)
    b.timeseries(
        "Denoising FLOPs per request, by shape (ledger)", """Nominal denoising FLOPs of one request: steps x CFG
        branches x one forward, from the FLOPs ledger. Guidance distillation halves it (g = 1), few steps
        divide it: FLUX.1-dev 1024² 2.08 PFLOP (28 steps, g = 1), schnell 0.30 PFLOP (4 steps). Healthy:
        constant per shape.""", "flops",
        [T(ratio_of_rates(sel("stepwatch_ledger_flops_total", INST, F_SHAPE),
                          sel("stepwatch_pipeline_request_duration_seconds_count", INST, F_SHAPE), RATE,
                          "job, instance, shape"), "{{shape}} @ {{instance}}")], min_=0, span=24, height=6)


def stream_row(b: Board) -> None:
    """Chunked autoregressive video (exporter/chunks.py): the series exist only where such a pipeline runs."""
    first, chunk = "stepwatch_stream_first_chunk_seconds_bucket", "stepwatch_stream_chunk_duration_seconds_bucket"
    by_index = "stepwatch_stream_chunk_index_duration_seconds"
    rtf = sel("stepwatch_stream_realtime_factor_ratio_bucket", INST)
    kv = sel("stepwatch_stream_kv_cache_bytes", INST)
    b.row("Streaming video (chunked autoregressive)")
    b.timeseries(
        "First-chunk and chunk latency (streaming)", """Seconds from a session's start to its first frames
        (p50, p99: the interactive SLO, sub-second on an H100 by the seeds) and between consecutive chunks'
        frames. Healthy: the first chunk within its SLO, later chunks flat.""", "s",
        [T(quantile(0.5, sel(first, INST), RATE, "job, instance"), "first chunk p50 @ {{instance}}"),
         T(quantile(0.99, sel(first, INST), RATE, "job, instance"), "first chunk p99 @ {{instance}}"),
         T(quantile(0.99, sel(chunk, INST), RATE, "job, instance"), "any chunk p99 @ {{instance}}")], min_=0)
    b.timeseries(
        "Chunk latency by chunk index", """Mean chunk latency per range of chunk indices (0, 1, 2-3, 4-7, 8-15,
        16+). Healthy: flat after the first chunks (attention over a fixed window costs the same each chunk);
        rising with the index = a window or cache that keeps growing.""", "s",
        [T(ratio_of_rates(sel(f"{by_index}_sum", INST), sel(f"{by_index}_count", INST), RATE,
                          "job, instance, chunk_index"), "chunks {{chunk_index}} @ {{instance}}")], min_=0)
    stall = b.th.alert("stream_stalling")
    b.timeseries(
        stall.panel, f"""A chunk's generation seconds over the seconds its frames play (p50, p99). Healthy: below
        1 (the red line); above 1 the viewer waits and the stream stalls. {stall.name} fires when more than
        {pct(stall.threshold)} of the chunks are above 1 (at 50%: the p50 above the line).""", "none",
        [T(quantile(0.5, rtf, RATE, "job, instance"), "p50 @ {{instance}}"),
         T(quantile(0.99, rtf, RATE, "job, instance"), "p99 @ {{instance}}")],
        alerts=["stream_stalling"], lines=[(1.0, RED)], min_=0)
    b.timeseries(
        "KV cache bytes vs the ledger", """KV cache of the sessions in flight on each worker, read from the
        pipeline's cache tensors (allocated, and the share the encoded chunks fill), next to the ledger's
        2 x d x layers x bytes x window tokens and the KV memory the host gives its sessions (dashed). Healthy:
        allocated = ledger, back to 0 when the sessions end, well under the capacity; a session whose window
        does not fit fails at its start (an OOM of stage kv_cache).""", "bytes",
        [T(kv, "{{state}} @ {{instance}}"),
         T(sel("stepwatch_stream_kv_cache_ledger_bytes", INST), "ledger @ {{instance}}", "ref"),
         T(sel("stepwatch_stream_kv_cache_capacity_bytes", INST), "capacity @ {{instance}}", "ref")], min_=0)
    b.timeseries(
        "Streaming sessions: active, and ended by outcome", """Sessions streaming now on each worker, and the
        sessions that ended in the rate window by outcome: done (every chunk out), closed (by the viewer or the
        idle timeout), failed (an error, or a KV cache that did not fit: the OOM panel says which). Healthy:
        active within the worker's session slots, no failed.""", "short",
        [T(sel("stepwatch_stream_sessions_active", INST), "active @ {{instance}}"),
         T(sum_increase(sel("stepwatch_stream_sessions_total", INST), RATE, "job, instance, outcome"),
           "{{outcome}} @ {{instance}}")], min_=0)
    _drift_panel(b)


def _drift_panel(b: Board) -> None:
    drift = b.th.alert("stream_drift")
    chunk = sel("stepwatch_quality_stream_chunk_psnr_decibels", INST)
    b.timeseries(
        drift.panel, f"""The sidecar's stream probe: one fixed session against its baseline session (same prompt,
        seed and deployment), the worst chunk's PSNR per range of chunk index (identical chunks drawn at 60 dB),
        with the probe set's gate (video {num(b.th.quality.video_psnr_gate_db)} dB) and the PSNR's slope over
        chunk index (dB per chunk). Healthy: every range at 60 (identical), slope 0. Drift: the late ranges
        fall under the gate while 0-3 hold ({drift.name}); the slope says how fast.""", "dB",
        [T(f"clamp_max({chunk}, 60)", "chunks {{chunk_index}} ({{probe_set}})"),
         T(f"{sel('stepwatch_quality_gate_decibels', INST)} and on (job, instance, probe_set) "
           f"count by (job, instance, probe_set) ({chunk})", "{{probe_set}} gate", "limit"),
         T(sel("stepwatch_quality_stream_psnr_slope_decibels", INST), "slope dB/chunk ({{probe_set}})")],
        alerts=["stream_drift"])


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


# ----- the board ----------------------------------------------------------------------------------

# Each subsystem's rows, in the order they appear; the subsystems in SUBSYSTEMS order.
ROWS: dict[str, list[Row]] = {
    "service": [traffic_row, queue_row, fleet_row, video_row],
    "pipeline": [denoising_row, fleet_instances_row, compile_row, cache_row, distilled_row, stream_row, ranks_row,
                 memory_row],
    "quality": [quality_row, video_quality_row],
    "monitoring": [health_row],
}


def overview(th: Thresholds) -> dict[str, Any]:
    """The on-call overview: the firing alerts, then each subsystem's rows, each alert's panel first in its row."""
    b = Board(th)
    alerts_row(b)
    for subsystem in SUBSYSTEMS:
        for row in ROWS[subsystem]:
            row(b)
    return b.build(
        OVERVIEW_UID, "stepwatch: diffusion inference overview",
        "On-call overview of diffusion-model inference: traffic, queue, per-step time, stages, MFU, "
        "recompiles, cross-step cache, ranks, memory and OOMs, output quality, and the health of the "
        "exporter, sidecar and GPUs. Generated by `stepwatch dashboards generate`; do not edit in Grafana.",
        ["stepwatch", "diffusion", "generated"])
