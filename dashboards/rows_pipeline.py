"""The overview's pipeline rows: denoising, the fleet's instances, compile, cache, few-step, streaming, ranks, memory.

Row functions of ``dashboards/overview.py``'s ``ROWS["pipeline"]``, in board order.
"""

from __future__ import annotations

from prometheus_client.utils import floatToGoString

from stepwatch.alerts.promql import (
    above_bucket,
    cache_hit_ratio,
    device_peak_flops,
    events,
    mean_step_time,
    num,
    over_positive,
    pct,
    quantile,
    ratio_of_rates,
    ratio_to_fastest,
    sel,
    stage_share,
    sum_increase,
)
from stepwatch.dashboards.board import F_SHAPE, INST, RATE, RED, Board, T, diagnosis


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
    spread = float(b.th.diagnosis["instance_psnr_spread_db"])
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
