"""Every metric stepwatch emits, as data.

The exporter, the practice service and the sidecar build their collectors from
this table; the rule generator, the dashboards, the runbook checks and the
triage agent validate their queries against it.  One name, one meaning.

Naming: ``stepwatch_<subsystem>_<name>_<unit>``, base units (seconds, bytes,
ratios 0..1), ``_total`` for counters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["counter", "gauge", "histogram", "summary", "info"]
# "stream": the exporter's series for chunked autoregressive video, registered only where such a pipeline is
# instrumented (an image worker exposes none of them).
Owner = Literal["exporter", "stream", "service", "sidecar"]

# 0.5 ms .. 300 s: resolves 5 ms steps on a GPU and 60 s+ compiles in one family.
DURATION_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0,
    20.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
# Position of a cache hit in the trajectory: step index / steps, deciles.
POSITION_BUCKETS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
PSNR_BUCKETS: tuple[float, ...] = (10, 15, 20, 24, 26, 28, 30, 32, 35, 40, 50, 60, 100)
# Chunk latency of streaming video: sub-second first chunks on a GPU (seed 002) to tens of seconds on a CPU.
CHUNK_BUCKETS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
# Generation seconds / playback seconds per chunk; 1.0 (the stall line) must stay a boundary.
REALTIME_FACTOR_BUCKETS: tuple[float, ...] = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
# A streaming session's length: a few chunks on a practice service to tens of minutes of live video.
SESSION_BUCKETS: tuple[float, ...] = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# Peak memory / capacity per request.  0.9 is the memory alert's threshold and must stay a
# boundary (validated by the rule generator); > 1 is an OOM's failed demand.
MEMORY_RATIO_BUCKETS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0, 1.5)


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    owner: Owner = "exporter"
    buckets: tuple[float, ...] = field(default=(), compare=False)
    # Read from its source at each scrape (a kernel counter): the owner registers a metrics.ScrapeCounter for
    # it, MetricSet builds no collector of its own.
    scraped: bool = False

    def series_names(self) -> tuple[str, ...]:
        """Names that appear in an exposition for this metric."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        if self.kind == "summary":
            return (f"{self.name}_sum", f"{self.name}_count")
        if self.kind == "info":
            return (f"{self.name}_info",)
        return (self.name,)


def _m(name: str, kind: Kind, help: str, labels: tuple[str, ...] = (), owner: Owner = "exporter",
       buckets: tuple[float, ...] = (), scraped: bool = False) -> MetricDef:
    return MetricDef(name, kind, help, labels, owner, buckets, scraped)


METRICS: tuple[MetricDef, ...] = (
    # --- in-process exporter: one pipeline call = one request -------------------------------
    _m("stepwatch_pipeline_requests_total", "counter",
       "Pipeline calls by outcome (ok, error, oom; cancelled: a video job cancelled mid-run).", ("shape", "outcome")),
    # Per-shape times are summaries (sum and count, no quantiles): what the rules and the board read is the
    # mean per shape; a bucket layout per shape would cost ~30 series each (docs/contracts.md, budget).
    _m("stepwatch_pipeline_request_duration_seconds", "summary",
       "Wall time of a pipeline call, device-accurate on CUDA.", ("shape",)),
    _m("stepwatch_pipeline_stage_duration_seconds", "summary",
       "Time per stage: text_encode, denoise, vae_decode.", ("shape", "stage")),
    _m("stepwatch_pipeline_step_duration_seconds", "summary",
       "Time of one denoising step, all CFG branches together.", ("shape",)),
    _m("stepwatch_pipeline_warmup_active", "gauge",
       "1 while the pipeline runs inside the exporter's warmup() (the start-up warm-up, or a re-warm after a "
       "knob changed the compiled forward): requests wait behind it.", ()),
    _m("stepwatch_pipeline_cfg_branches", "gauge",
       "CFG branches per step in the last request of the shape: 2 with CFG, as separate transformer calls or "
       "one call on a doubled batch.", ("shape",)),
    _m("stepwatch_cache_decisions_total", "counter",
       "Cross-step cache decisions per transformer call: hit reuses the cached residual, miss recomputes.",
       ("shape", "cache", "decision")),
    _m("stepwatch_cache_few_step_hits_total", "counter",
       "Cache hits on few-step requests (at most few_step.max_steps steps, no CFG: a distilled model's), "
       "serving phase only; a distilled model must see none.", ("shape", "cache")),
    _m("stepwatch_cache_hit_position_ratio", "histogram",
       "Where in the trajectory cache hits land: step index / steps (all shapes together).", (),
       buckets=POSITION_BUCKETS),
    _m("stepwatch_compile_total", "counter",
       "torch.compile (Dynamo) compilations, by the shape that triggered them and the phase.",
       ("shape", "phase")),
    _m("stepwatch_compile_duration_seconds", "summary",
       "Duration of one torch.compile compilation.", ("shape", "phase")),
    _m("stepwatch_memory_peak_bytes", "gauge",
       "Peak memory of the last request per stage (and stage=request); on OOM, the demand that failed.",
       ("device", "stage")),
    _m("stepwatch_memory_peak_ratio", "histogram",
       "Peak memory / capacity of each request (on OOM, failed demand / capacity, so above 1).",
       ("device",), buckets=MEMORY_RATIO_BUCKETS),
    _m("stepwatch_memory_capacity_bytes", "gauge",
       "Memory the peak is measured against (GPU total, or the worker's budget on CPU).", ("device",)),
    _m("stepwatch_oom_total", "counter", "Out-of-memory failures by stage.", ("shape", "stage")),
    _m("stepwatch_ledger_step_flops", "gauge",
       "Nominal FLOPs of one denoising step (all CFG branches) from the ledger.", ("shape",)),
    _m("stepwatch_ledger_flops_total", "counter",
       "Nominal denoising FLOPs executed; rate() / step seconds / peak = MFU.", ("shape",)),
    _m("stepwatch_ledger_mfu_ratio", "gauge",
       "Model FLOPs utilization of the last request of the shape (step FLOPs / step time / peak).",
       ("shape",)),
    _m("stepwatch_device_peak_flops_per_second", "gauge",
       "Dense peak FLOP/s the MFU is computed against (0 when unknown).", ("device",)),
    _m("stepwatch_rank_step_duration_seconds", "gauge",
       "Per rank: busy seconds per step (see _busy_seconds_total) in the last request all ranks finished.",
       ("rank",)),
    _m("stepwatch_rank_skew_ratio", "gauge",
       "(max - min) / min of the ranks' busy seconds per step in the last request all ranks finished.", ()),
    _m("stepwatch_rank_busy_seconds_total", "counter",
       "Per rank, per collective: from the group's release by the previous collective to this rank's "
       "arrival, plus its threads' waits for a CPU; the straggler's is longest; / steps = busy per step.",
       ("rank",)),
    _m("stepwatch_rank_cpu_wait_seconds_total", "counter",
       "Per rank: seconds its threads were runnable but waited for a CPU (Linux schedstat; part of busy).",
       ("rank",)),
    _m("stepwatch_rank_steps_total", "counter", "Per rank: denoising steps run.", ("rank",)),
    _m("stepwatch_pipeline_cpu_wait_seconds_total", "counter",
       "Seconds the pipeline process's threads were runnable but waited for a CPU (Linux schedstat, thread-"
       "seconds): another process on the host delays the host side of every step.", (), scraped=True),
    _m("stepwatch_pipeline_cpu_run_seconds_total", "counter",
       "Seconds the pipeline process's threads ran on a CPU (Linux schedstat, thread-seconds): what its waits "
       "for a CPU are read against.", (), scraped=True),
    _m("stepwatch_rank_progress_age_seconds", "gauge",
       "Per rank, while it runs a request: seconds since it last left a collective (0 when idle).", ("rank",)),
    _m("stepwatch_rank_collective_wait_seconds", "gauge",
       "Per rank: seconds inside the collective it is waiting in now (0 when in none, or when the rank "
       "went silent: a waiting rank keeps shipping its heartbeat).", ("rank",)),
    _m("stepwatch_baseline_step_duration_seconds", "gauge",
       "Per-step time baseline of a shape, from the deployment's baseline file.", ("shape",)),
    _m("stepwatch_baseline_cache_hit_ratio", "gauge",
       "Cache hit-rate baseline of a shape, from the deployment's baseline file.", ("shape",)),
    _m("stepwatch_exporter_errors_total", "counter",
       "Errors inside stepwatch's own hooks (never raised into the pipeline).", ("component",)),
    _m("stepwatch_exporter_build", "info", "stepwatch and library versions of this process.", ()),
    # --- practice service ----------------------------------------------------------------
    _m("stepwatch_service_requests_total", "counter",
       "HTTP generation requests by pool and result code class.", ("pool", "code"), "service"),
    _m("stepwatch_service_request_duration_seconds", "histogram",
       "End-to-end latency of a generation request (queue + work).", ("pool",), "service",
       DURATION_BUCKETS),
    _m("stepwatch_service_images_nonfinite_total", "counter",
       "Images that came out NaN/Inf or all black.", ("pool",), "service"),
    _m("stepwatch_queue_depth", "gauge", "Requests waiting in a pool's queue.", ("pool",), "service"),
    _m("stepwatch_queue_estimated_wait_seconds", "gauge",
       "Predicted GPU-seconds of queued work / workers.", ("pool",), "service"),
    _m("stepwatch_queue_slo_seconds", "gauge", "Latency SLO of a pool.", ("pool",), "service"),
    _m("stepwatch_queue_wait_seconds", "histogram",
       "Time a request waited before a worker took it.", ("pool",), "service", DURATION_BUCKETS),
    _m("stepwatch_queue_rejected_total", "counter",
       "Requests refused with 429 because the estimated wait passed the hard limit.", ("pool",), "service"),
    _m("stepwatch_worker_restarts_total", "counter", "Worker processes restarted after dying.", (), "service"),
    _m("stepwatch_worker_up", "gauge", "1 when the worker process is alive.", (), "service"),
    _m("stepwatch_worker_busy_seconds", "gauge",
       "Seconds the worker has spent on the generation in flight, by its pool (0 when idle): it grows while "
       "a hung worker answers nothing.", ("pool",), "service"),
    _m("stepwatch_worker_expected_seconds", "gauge",
       "Predicted seconds of the generation in flight (the queue's estimate), by its pool; 0 when idle.",
       ("pool",), "service"),
    _m("stepwatch_service_ready", "gauge", "1 once warm-up finished.", (), "service"),
    _m("stepwatch_service_config", "info",
       "Runtime knobs and the deployment fingerprint of the service.", (), "service"),
    _m("stepwatch_service_config_rollout_timestamp_seconds", "gauge",
       "Unix time the service last restarted onto another start-up configuration (a rollout; known across "
       "restarts with state_dir; a routine restart keeps the last one's time); 0: none known.", (), "service"),
    _m("stepwatch_service_config_rollout_key_active", "gauge",
       "1 for each knob (or fingerprint, the deployment itself) whose start-up value the last rollout changed, "
       "0 for the others.", ("key",), "service"),
    _m("stepwatch_service_config_rollout", "info",
       "The config ids before and after the last rollout; absent while none is known.", (), "service"),
    _m("stepwatch_service_knob_override_active", "gauge",
       "1 while a runtime knob (cache, cache_threshold, vae_tiling, compile, attention_backend) differs from the "
       "value the service started with; 0 again once it is restored.", ("knob",), "service"),
    # --- in-process exporter, chunked autoregressive video (exporter/chunks.py) ---------------
    _m("stepwatch_stream_first_chunk_seconds", "histogram",
       "Session open (or, outside a session, the call's start) to the first chunk's frames out: what a streaming "
       "client waits before its first frames.",
       (), "stream", CHUNK_BUCKETS),
    _m("stepwatch_stream_chunk_duration_seconds", "histogram",
       "Latency of one chunk: the previous chunk's frames out to this one's (the first from the call's start).",
       (), "stream", CHUNK_BUCKETS),
    _m("stepwatch_stream_chunk_index_duration_seconds", "summary",
       "Chunk latency by chunk-index range (0, 1, 2-3, 4-7, 8-15, 16+): later chunks should take constant "
       "time; a rising trend is a window or a cache that grows.", ("chunk_index",), "stream"),
    _m("stepwatch_stream_realtime_factor_ratio", "histogram",
       "A chunk's latency over the seconds its frames play (chunks after the first): above 1 the stream stalls.",
       (), "stream", REALTIME_FACTOR_BUCKETS),
    _m("stepwatch_stream_kv_cache_bytes", "gauge",
       "KV cache of the chunked calls in flight on this worker, from the pipeline's cache tensors: allocated, "
       "and in_use (the share of the window the chunks encoded so far fill); 0 when none runs.",
       ("state",), "stream"),
    _m("stepwatch_stream_kv_cache_ledger_bytes", "gauge",
       "The KV ledger's bytes for the chunked calls in flight: 2 x d x layers x bytes per element x window "
       "tokens x batch (seed 002).  Next to the measured bytes: a mismatch is a cache the ledger does not know.",
       (), "stream"),
    _m("stepwatch_stream_kv_window_tokens", "gauge",
       "Tokens the KV window of the last chunked call holds (full-resolution chunks plus compressed older ones).",
       (), "stream"),
    _m("stepwatch_stream_kv_cache_capacity_bytes", "gauge",
       "KV memory the host gives its chunked calls (a KV pool: a session whose window does not fit fails with an "
       "out-of-memory of stage kv_cache); 0 when the host sets none.", (), "stream"),
    _m("stepwatch_stream_steps_total", "counter",
       "Denoising steps of chunked calls; over the chunk-latency histogram's count: steps per chunk.",
       (), "stream"),
    _m("stepwatch_stream_sessions_active", "gauge",
       "Streaming sessions running on this worker (a host marks them with Instrumentation.stream_session).",
       (), "stream"),
    _m("stepwatch_stream_sessions_total", "counter",
       "Streaming sessions that ended: done (every chunk out), closed (by the client, its idle timeout or its send "
       "buffer), failed (an error or out of memory).", ("outcome",), "stream"),
    _m("stepwatch_stream_session_duration_seconds", "histogram",
       "A session's open to its end, whatever the outcome.", (), "stream", SESSION_BUCKETS),
    # --- practice service: asynchronous video jobs (POST /v1/videos) ----------------------
    _m("stepwatch_video_jobs_created_total", "counter", "Video jobs accepted (202).", ("pool",), "service"),
    _m("stepwatch_video_jobs_finished_total", "counter",
       "Video jobs that ended: succeeded, failed or cancelled; created - finished = in flight.",
       ("pool", "outcome"), "service"),
    _m("stepwatch_video_jobs_depth", "gauge", "Video jobs in flight by state (queued, running).",
       ("pool", "state"), "service"),
    _m("stepwatch_video_oldest_job_age_seconds", "gauge",
       "Age of the oldest video job still queued or running (0 when none).", ("pool",), "service"),
    _m("stepwatch_video_job_duration_seconds", "histogram",
       "Creation to completion of a succeeded video job (queue + generation + encoding).", ("pool",), "service",
       DURATION_BUCKETS),
    _m("stepwatch_video_frames_total", "counter", "Frames of succeeded video jobs.", ("pool",), "service"),
    # --- sidecar: NVML ------------------------------------------------------------------
    _m("stepwatch_nvml_up", "gauge", "1 when NVML initialized and answered.", (), "sidecar"),
    _m("stepwatch_gpu_memory_used_bytes", "gauge", "Device memory in use.", ("gpu",), "sidecar"),
    _m("stepwatch_gpu_memory_total_bytes", "gauge", "Device memory capacity.", ("gpu",), "sidecar"),
    _m("stepwatch_gpu_utilization_ratio", "gauge",
       "Share of time a kernel ran (NVML GPU-Util); says nothing about MFU.", ("gpu",), "sidecar"),
    _m("stepwatch_gpu_sm_clock_hertz", "gauge", "SM clock.", ("gpu",), "sidecar"),
    _m("stepwatch_gpu_temperature_celsius", "gauge", "GPU temperature.", ("gpu",), "sidecar"),
    _m("stepwatch_gpu_power_watts", "gauge", "Power draw.", ("gpu",), "sidecar"),
    _m("stepwatch_gpu_throttle_active", "gauge",
       "1 while a clock throttle reason is active.", ("gpu", "reason"), "sidecar"),
    _m("stepwatch_gpu_xid_errors_total", "counter", "XID errors seen by NVML events.", ("gpu",), "sidecar"),
    _m("stepwatch_gpu_read_errors_total", "counter", "Failed NVML reads per GPU.", ("gpu",), "sidecar"),
    # --- sidecar: quality prober --------------------------------------------------------
    _m("stepwatch_quality_psnr_decibels", "gauge",
       "PSNR of the last probe set against the baseline (stat: the set's p50, p10 or min).",
       ("probe_set", "instance_id", "stat"), "sidecar"),
    _m("stepwatch_quality_ssim_ratio", "gauge",
       "SSIM of the last probe set against the baseline (stat: the set's p50, p10 or min).",
       ("probe_set", "instance_id", "stat"), "sidecar"),
    _m("stepwatch_quality_gate_decibels", "gauge", "PSNR gate of the probe set.", ("probe_set",), "sidecar"),
    _m("stepwatch_quality_ssim_gate_ratio", "gauge",
       "SSIM gate of the probe set's worst frame (video sets 0.92, high-quality image sets 0.95); 0: the set "
       "has no SSIM gate (image sets are gated on PSNR).",
       ("probe_set",), "sidecar"),
    _m("stepwatch_quality_probe_duration_seconds", "histogram",
       "Time to run one probe set.", ("probe_set",), "sidecar", DURATION_BUCKETS),
    _m("stepwatch_quality_probe_runs_total", "counter", "Probe sets completed.", ("probe_set",), "sidecar"),
    _m("stepwatch_quality_probe_failures_total", "counter",
       "Probe requests that failed (target down, timeout, bad answer).", ("probe_set", "reason"), "sidecar"),
    _m("stepwatch_quality_baseline_stale", "gauge",
       "1 when the deployment fingerprint differs from the baseline's: no PSNR is reported.",
       ("probe_set",), "sidecar"),
    _m("stepwatch_quality_baseline_ok", "gauge",
       "1 when the baseline loaded and its checksums match.", ("probe_set",), "sidecar"),
    _m("stepwatch_quality_last_success_timestamp_seconds", "gauge",
       "Unix time of the last completed probe set.", ("probe_set",), "sidecar"),
    _m("stepwatch_quality_target_not_ready_timestamp_seconds", "gauge",
       "Unix time a probe run last found its target not ready (restarting or warming up, within the prober's "
       "grace; 0: never): the probe-failing alert's no-success clock waits while it is.", ("probe_set",), "sidecar"),
    _m("stepwatch_quality_probe_interval_seconds", "gauge",
       "Current cadence of the probe set: seconds between runs (the probe-failing alert's clock).",
       ("probe_set",), "sidecar"),
    _m("stepwatch_quality_stream_chunk_psnr_decibels", "gauge",
       "A stream probe set's worst chunk PSNR against its baseline session, per range of chunk index (each "
       "chunk's last frame; +Inf: identical): drift shows as late ranges falling while early ones hold.",
       ("probe_set", "chunk_index"), "sidecar"),
    _m("stepwatch_quality_stream_chunk_ssim_ratio", "gauge",
       "A stream probe set's worst chunk SSIM against its baseline session, per range of chunk index.",
       ("probe_set", "chunk_index"), "sidecar"),
    _m("stepwatch_quality_stream_psnr_slope_decibels", "gauge",
       "Least-squares slope of a stream probe's chunk PSNR over chunk index, in dB per chunk (PSNR capped at "
       "60 dB, where the determinism check stops): below 0 the picture drifts from the baseline as it goes.",
       ("probe_set",), "sidecar"),
)

BY_NAME: dict[str, MetricDef] = {m.name: m for m in METRICS}

# Series that rules, panels and runbook checks read but no stepwatch part emits, with the labels they carry
# besides job and instance (None: any label, e.g. every label of the alert).  Prometheus makes these itself:
# ``up`` with the target labels service discovery sets (pod; node as the fleet's agents' external label).
PROMETHEUS_SERIES: dict[str, frozenset[str] | None] = {
    "up": frozenset({"pod", "node"}), "ALERTS": None, "ALERTS_FOR_STATE": None,
}
# The fleet's other parts: haproxy's built-in exporter (the balancer's health check of each replica), whose
# series the fleet's agents label with their node.
FOREIGN_SERIES: dict[str, frozenset[str]] = {
    "haproxy_server_status": frozenset({"proxy", "server", "state", "node"}),
    # The blackbox exporter's probe of the users' endpoint through the balancer (alerts.endpoint_down).
    "probe_success": frozenset(),
    "probe_duration_seconds": frozenset(),
    "probe_http_status_code": frozenset(),
}

_NAME_RE = re.compile(r"^stepwatch_[a-z]+_[a-z0-9_]+$")
_UNITS = ("_seconds", "_bytes", "_tokens", "_ratio", "_total", "_flops", "_per_second", "_hertz", "_celsius",
          "_watts", "_decibels", "_stale", "_ok", "_up", "_depth", "_ready", "_branches", "_active")


def validate() -> None:
    """Fail loudly at import time if the catalog breaks its own conventions."""
    seen: set[str] = set()
    for m in METRICS:
        if m.name in seen:
            raise ValueError(f"metric {m.name} defined twice")
        seen.add(m.name)
        if not _NAME_RE.match(m.name):
            raise ValueError(f"metric {m.name} does not follow stepwatch_<subsystem>_<name>_<unit>")
        if m.kind == "counter" and not m.name.endswith("_total"):
            raise ValueError(f"counter {m.name} must end in _total")
        if m.kind != "counter" and m.name.endswith("_total"):
            raise ValueError(f"{m.kind} {m.name} must not end in _total")
        if m.kind in ("counter", "gauge", "histogram", "summary") and not m.name.endswith(_UNITS):
            raise ValueError(f"metric {m.name} has no unit suffix")
        if m.kind == "histogram" and not m.buckets:
            raise ValueError(f"histogram {m.name} needs buckets")


def series_names(owner: Owner | None = None) -> set[str]:
    """Every series name in an exposition, optionally for one owner."""
    out: set[str] = set()
    for m in METRICS:
        if owner is None or m.owner == owner:
            out.update(m.series_names())
    return out


def readable_names() -> set[str]:
    """Every series name a query may read besides recording rules: stepwatch's own, Prometheus', foreign ones."""
    return series_names() | set(PROMETHEUS_SERIES) | set(FOREIGN_SERIES)


validate()
