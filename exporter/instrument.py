"""instrument() / uninstrument(): per-request signals from any diffusers pipeline.

Where we hook, and why there (all outside anything torch.compile traces):

  pipeline.__call__            request boundaries, outcome, OOM stage
                               (the instance's class is swapped for a thin
                               subclass: ``__call__`` is looked up on the type)
  pipeline.encode_prompt       text_encode stage
  scheduler.set_timesteps      planned steps; denoising starts after it
  scheduler.step               end of each denoising step (all CFG branches)
  transformer.cache_context    one call per CFG branch; cache decision after it
  vae.decode                   vae_decode stage

CFG run as one transformer call on a doubled batch (SD3, SDXL, Sana, ...: one or no cache_context per
step) is not seen by any hook: at request end the pipeline's own ``do_classifier_free_guidance`` is read
once and, when no step logged two branches, decides 1 or 2 (``request.branch_count``).

The flow has three parts, one module each: the hooks record marks while the
request runs (``hooks``, installed through the named ``patches`` registry, so
uninstrument() undoes exactly what instrument() did and instrument() twice is
a no-op); the marks become a report once device timings are ready
(``request.resolve``, pure); the report becomes metric observations
(``publish``).  This module wires them to one pipeline.  Hook bodies never
raise into the pipeline: errors are counted and logged once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import REGISTRY, CollectorRegistry

from stepwatch import __version__
from stepwatch.exporter import caches, chunks, hooks, ledger, patches, spans
from stepwatch.exporter.clock import Clock, clock_for
from stepwatch.exporter.compile_watch import WATCH
from stepwatch.exporter.cpu import SchedstatReader, ThreadTotals
from stepwatch.exporter.hooks import ATTR
from stepwatch.exporter.memory import MemoryProbe, is_oom, oom_requested_bytes, probe_for
from stepwatch.exporter.publish import Publisher
from stepwatch.exporter.report import RequestReport
from stepwatch.exporter.request import (
    PEAK_STAGES,
    STAGES,
    CallSignature,
    RequestMarks,
    ResolveContext,
    StepFlops,
    batch_cfg,
    denoiser,
    marks_for,
    resolve,
)
from stepwatch.exporter.shapes import ShapeKey, ShapeLabeler
from stepwatch.metrics import ExporterMetrics, MetricSet, ScrapeCounter

log = logging.getLogger("stepwatch.exporter")

__all__ = ["ATTR", "PEAK_STAGES", "STAGES", "InstrumentOptions", "Instrumentation", "instrument", "uninstrument"]


@dataclass
class InstrumentOptions:
    """How to instrument.  Every field has a serving-friendly default."""

    registry: CollectorRegistry | None = None  # default: prometheus_client's global registry
    shapes: Iterable[str] | None = None  # serving allowlist; None: first `max_shapes` seen
    max_shapes: int = 16
    peak_flops: float | None = None  # overrides the device table (FLOP/s)
    text_tokens: int | None = None  # N_txt when the call does not say (max_sequence_length)
    baselines: str | Path | Mapping[str, Any] | None = None
    tracer_provider: Any = None
    on_report: Callable[[RequestReport], None] | None = None
    rank_reporter: Any = None  # see stepwatch.exporter.ranks; None: single rank
    memory: MemoryProbe | None = None  # default: from the pipeline's device
    clock: Clock | None = None  # default: from the pipeline's device
    # The most steps a request without CFG may run and still be few-step (a distilled model's, whose cache must
    # never hit); None: ``few_step.max_steps`` of the packaged stepwatch/thresholds.yaml.
    few_step_max_steps: int | None = None
    # Playback rate of a chunked video pipeline's frames, for the real-time factor (exporter/chunks.py).
    stream_fps: float = chunks.DEFAULT_FPS


class _Guard:
    """Count and log-once every error raised inside our own hook bodies."""

    def __init__(self, metrics: ExporterMetrics) -> None:
        self._metrics = metrics
        self._logged: set[str] = set()

    def fail(self, component: str, exc: BaseException) -> None:
        try:
            self._metrics.exporter_errors_total.labels(component=component).inc()
            if component not in self._logged:
                self._logged.add(component)
                log.warning("stepwatch hook %s failed (logged once, counted in "
                            "stepwatch_exporter_errors_total): %r", component, exc)
        except Exception:
            pass


def _versions() -> dict[str, str]:
    try:
        # Lazy: importing stepwatch.exporter must not import torch (the sidecar and rules tools load it).
        import diffusers
        import torch

        return {"torch": torch.__version__, "diffusers": diffusers.__version__}
    except Exception:
        return {}


def _default_few_step() -> int:
    from stepwatch.thresholds import load  # YAML only: no torch, no Prometheus

    return load().few_step_max_steps


def _cuda_peak_flops(device: str) -> float | None:
    import torch  # lazy: only for a CUDA device, which means torch is loaded already

    return ledger.peak_flops_for(torch.cuda.get_device_name(int(device.split(":")[1])))


class _Unresolved:
    """What the rank reporter is given for a request that could not be resolved: no steps."""

    __slots__ = ()
    step_seconds: tuple[float, ...] = ()

    @property
    def extra(self) -> dict[str, Any]:
        return {}


_UNRESOLVED = _Unresolved()


@dataclass
class SessionMark:
    """A streaming session the host marked (Instrumentation.stream_session); the host sets its outcome."""

    outcome: str = "done"


class Instrumentation:
    """The handle instrument() returns; also reachable as ``pipe._stepwatch``."""

    def __init__(self, pipe: Any, options: InstrumentOptions) -> None:
        self.pipe = pipe
        self.options = options
        registry = options.registry if options.registry is not None else REGISTRY
        self.metrics = MetricSet.shared(registry, "exporter")
        self._guard = _Guard(self.metrics)
        self.patches = patches.PatchRegistry(on_error=self._guard.fail)
        self.labeler = ShapeLabeler(options.shapes, options.max_shapes)
        device = getattr(pipe, "device", None)
        self.clock: Clock = options.clock or clock_for(device)
        self.memory: MemoryProbe = options.memory or probe_for(device)
        self.publisher = Publisher(self.metrics, self.memory.device)
        self.phase = "serving"
        self.last_report: RequestReport | None = None
        self._local = threading.local()
        self._pending: list[tuple[RequestMarks, str]] = []
        self._pending_lock = threading.Lock()
        self._tracer = spans.make_tracer(options.tracer_provider)
        self._ledger: ledger.LedgerModel | None = None
        self._chunks: chunks.ChunkModel | None = None  # set for a chunked autoregressive video pipeline
        self._stream: chunks.StreamPublisher | None = None
        self._sig = CallSignature(type(pipe))
        self._find_cache = caches.CacheFinder()
        self._components_key: tuple[int, ...] = ()
        self.peak_flops = options.peak_flops
        self.few_step_max_steps = options.few_step_max_steps or _default_few_step()
        if options.rank_reporter is not None:
            options.rank_reporter.bind(self.metrics)
        self._setup_static()
        self._resolve_ctx = ResolveContext(
            seconds=self.clock.seconds, offsets=getattr(self.clock, "offsets", None), labeler=self.labeler,
            device=self.memory.device, peak_flops=self.peak_flops,
            step_flops=StepFlops(self._ledger, pipe) if self._ledger is not None else None)

    # ----- set-up ---------------------------------------------------------------------------
    def _setup_static(self) -> None:
        """The series that do not depend on requests: build info, device peak, capacity, baselines, and
        the event counters of the allowlisted shapes at 0."""
        m = self.metrics
        m.exporter_build.info({"stepwatch": __version__, "pipeline": type(self.pipe).__name__, **_versions()})
        schedstat = SchedstatReader(ThreadTotals())
        ScrapeCounter("stepwatch_pipeline_cpu_wait_seconds_total", schedstat.waited, m.registry)
        ScrapeCounter("stepwatch_pipeline_cpu_run_seconds_total", schedstat.ran, m.registry)
        dev = self.memory.device
        if self.peak_flops is None and dev.startswith("cuda"):
            try:
                self.peak_flops = _cuda_peak_flops(dev)
            except Exception as e:
                self._guard.fail("ledger.peak", e)
        m.device_peak_flops_per_second.labels(device=dev).set(self.peak_flops or 0)
        self.refresh_capacity()
        transformer = denoiser(self.pipe)
        if transformer is not None:
            try:
                self._ledger = ledger.ledger_model(transformer)
            except Exception as e:
                self._guard.fail("ledger.model", e)
            self._chunks = chunks.model_for(self.pipe, transformer)
            if self._chunks is not None:
                self._stream = chunks.StreamPublisher.shared(MetricSet.shared(m.registry, "stream"))
        if self.options.baselines is not None:
            self.set_baselines(self.options.baselines)
        for shape in [*sorted(self.labeler.known), "other"]:
            self.publisher.zero_events(shape)
        m.exporter_errors_total.labels(component="request.begin")

    def refresh_capacity(self) -> None:
        """Re-read the capacity now (e.g. after the worker armed its memory budget)."""
        try:
            self.publisher.capacity.set(self.memory.capacity_bytes())
        except Exception as e:
            self._guard.fail("memory.capacity", e)

    def set_baselines(self, source: str | Path | Mapping[str, Any]) -> None:
        """Publish per-shape baselines (step seconds, cache hit ratio) as gauges for the rules."""
        data: Mapping[str, Any]
        if isinstance(source, (str, Path)):
            with open(source) as f:
                data = yaml.safe_load(f) or {}
        else:
            data = source
        shapes = data.get("shapes", data)
        if not isinstance(shapes, Mapping):
            raise ValueError("baselines: expected a mapping of shape -> {step_seconds, cache_hit_ratio}")
        for shape, vals in shapes.items():
            label = str(ShapeKey.parse(str(shape)))
            if not isinstance(vals, Mapping):
                raise ValueError(f"baselines: {shape}: expected a mapping, got {vals!r}")
            if "step_seconds" in vals:
                self.metrics.baseline_step_duration_seconds.labels(shape=label).set(float(vals["step_seconds"]))
            if "cache_hit_ratio" in vals:
                self.metrics.baseline_cache_hit_ratio.labels(shape=label).set(float(vals["cache_hit_ratio"]))

    def _ensure_component_patches(self) -> None:
        """(Re)attach to the pipeline's current components; an identity check when nothing changed."""
        pipe = self.pipe
        d = pipe.__dict__
        key = tuple(id(d.get(c)) for c in patches.COMPONENTS)
        if key == self._components_key:
            return
        self._components_key = key
        reg = self.patches
        for name in reg:  # a component removed or swapped: let go of the old object
            comp = patches.component_of(name)
            if comp is not None and d.get(comp) is not reg.target(name):
                reg.remove(name)
        if getattr(type(pipe), "encode_prompt", None) is not None:
            reg.wrap(patches.ENCODE_PROMPT, pipe, "encode_prompt", lambda fn: hooks.stage(self, fn, "te"))
        sched = getattr(pipe, "scheduler", None)
        if sched is not None:
            reg.wrap(patches.SET_TIMESTEPS, sched, "set_timesteps", lambda fn: hooks.set_timesteps(self, fn))
            reg.wrap(patches.STEP, sched, "step", lambda fn: hooks.step(self, fn))
        for comp in patches.DENOISERS:
            mod = getattr(pipe, comp, None)
            if mod is not None and hasattr(mod, "cache_context"):
                reg.wrap(patches.cache_context(comp), mod, "cache_context", lambda fn: hooks.cache_context(self, fn))
        if self._chunks is not None:
            reg.wrap(patches.ENCODE_KV_CACHE, pipe, "encode_kv_cache", lambda fn: hooks.encode_kv_cache(self, fn))
        vae = getattr(pipe, "vae", None)
        if vae is not None and hasattr(vae, "decode"):
            reg.wrap(patches.VAE_DECODE, vae, "decode", lambda fn: hooks.stage(self, fn, "vae"))

    # ----- phases ---------------------------------------------------------------------------
    def warmup(self) -> _Phase:
        """``with inst.warmup(): pipe(...)``: compiles inside count as warm-up, not serving."""
        return _Phase(self, "warmup")

    # ----- hook bodies (called by the hooks through the instance) ---------------------------
    # Memory boundaries: text encoding and latent preparation share one window (the encoders'
    # peak is what matters there), then denoise, then vae_decode: four reads per request.
    def _stage_enter(self, req: RequestMarks, kind: str) -> None:
        if kind == "te":
            req.stage = "text_encode"
            req.te_open = self.clock.mark()
        else:
            # Denoising is over: branches after the last step call are read now, before the pipeline's
            # maybe_free_model_hooks() resets the cache state at the end of __call__.
            req.tail_snapshot()
            self._close_stage_memory(req)
            req.stage = "vae_decode"
            req.vae_open = self.clock.mark()

    def _stage_exit(self, req: RequestMarks, kind: str) -> None:
        m = self.clock.mark()
        if kind == "te":
            req.te_spans.append((req.te_open, m))
            req.stage = "prepare"
            req.mem_stage = "text_encode"
        else:
            self._close_stage_memory(req)
            req.vae_spans.append((req.vae_open, m))
            req.stage = "postprocess"

    def _denoise_start(self, req: RequestMarks) -> None:
        self._close_stage_memory(req)
        mark = self.clock.mark()
        if req.stream is not None:  # once per chunk: denoising started with the first
            req.stream.starts.append(mark)
            if req.denoise_start is None:
                req.denoise_start = mark
        else:
            req.denoise_start = mark
        req.stage = "denoise"
        ts = getattr(getattr(self.pipe, "scheduler", None), "timesteps", None)
        if ts is not None:
            req.planned_steps = len(ts)

    def _close_stage_memory(self, req: RequestMarks) -> None:
        """Attribute the peak since the last boundary to the stage that just ran."""
        peak = self.memory.peak_bytes()
        stage = req.mem_stage if req.stage == "prepare" else req.stage
        if peak > req.peaks.get(stage, 0):
            req.peaks[stage] = peak
        self.memory.reset_peak()

    def on_orphan_compile(self, start: float, seconds: float) -> None:
        """A compile outside any request (compile_watch calls this)."""
        try:
            self.publisher.compile("other", self.phase, seconds)
        except Exception as e:
            self._guard.fail("compile.orphan", e)

    # ----- request lifecycle ----------------------------------------------------------------
    def _begin(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> RequestMarks:
        # First, before anything that can fail: every rank must count every request (exporter/ranks.py).
        rank_request = self._local.rank_request = self._rank_call("begin_request")
        self._ensure_component_patches()
        WATCH.ensure()
        self._drain_pending()
        den = denoiser(self.pipe)
        params = self._sig.bind(args, kwargs)
        req = marks_for(self.pipe, params, start=self.clock.mark(), start_unix=time.time(),
                        text_tokens=self.options.text_tokens,
                        parent_ctx=spans.capture_parent() if self._tracer is not None else None,
                        cache=self._find_cache(den) if den is not None else None)
        req.capacity = self.memory.capacity_bytes()
        if self._chunks is not None:
            self._chunks = chunks.with_window(self._chunks, den)  # a host may change the window between calls
            req.stream = chunks.marks_for(self._chunks, params, req.height, req.width)
            opened = getattr(self._local, "session_opened", None)
            if opened is not None:
                req.stream.lead_seconds = max(0.0, time.perf_counter() - opened)
        req.rank_request = rank_request if rank_request is not None else -1
        self.memory.reset_peak(check=True)
        self._local.req = req
        self._local.prev_sink = WATCH.set_sink(lambda s, d: req.compiles.append((s, d)))
        return req

    def _end(self, req: RequestMarks, exc: BaseException | None) -> None:
        self._rank_call("end_request")  # first: whatever fails below, the ranks' request has ended
        try:
            self._end_request(req, exc)
        except Exception:
            if self.options.rank_reporter is not None:  # no report will come: let the ranks' stamps of it go
                self._guarded("ranks", self.options.rank_reporter.report, _UNRESOLVED, req.rank_request)
            raise

    def end_unbegun(self) -> None:
        """After a call whose ``_begin`` failed: end the ranks' request it had begun, with no report."""
        rank_request = getattr(self._local, "rank_request", None)
        self._local.rank_request = None
        if rank_request is None:
            return
        self._rank_call("end_request")
        assert self.options.rank_reporter is not None
        self._guarded("ranks", self.options.rank_reporter.report, _UNRESOLVED, rank_request)

    def _rank_call(self, method: str) -> Any:
        """The rank reporter's ``method()``, guarded; None without a reporter or when it failed."""
        reporter = self.options.rank_reporter
        if reporter is None:
            return None
        try:
            return getattr(reporter, method)()
        except Exception as e:
            self._guard.fail("ranks", e)
            return None

    def _end_request(self, req: RequestMarks, exc: BaseException | None) -> None:
        self._local.req = None
        WATCH.set_sink(getattr(self._local, "prev_sink", None))
        req.end = self.clock.mark()
        req.tail_snapshot()
        if req.denoise_start is not None:  # this call set the guidance the property reads
            req.batch_cfg = batch_cfg(self.pipe)
        self._close_stage_memory(req)
        if self._stream is not None and req.stream is not None:
            self._stream.done(id(req.stream))
        if exc is not None:
            self._record_failure(req, exc)
        phase = self.phase
        if self.clock.ready(req.end):
            self._emit(req, phase)
        else:
            with self._pending_lock:
                self._pending.append((req, phase))
            _Resolver.ensure(self)

    def _record_failure(self, req: RequestMarks, exc: BaseException) -> None:
        req.error = f"{type(exc).__name__}: {exc}"[:500]
        if getattr(exc, "stepwatch_outcome", None) == "cancelled":  # the host stopped it on purpose: no error
            req.outcome = "cancelled"
            return
        if not is_oom(exc):
            req.outcome = "error"
            return
        req.outcome = "oom"
        requested = oom_requested_bytes(exc)
        if requested is not None:
            req.oom_demand = self.memory.in_use_bytes() + requested

    def _drain_pending(self) -> None:
        if not self._pending:
            return
        ready: list[tuple[RequestMarks, str]] = []
        keep: list[tuple[RequestMarks, str]] = []
        with self._pending_lock:
            for p in self._pending:
                (ready if self.clock.ready(p[0].end) else keep).append(p)
            self._pending = keep
        for req, phase in ready:
            self._emit(req, phase)

    def _emit(self, req: RequestMarks, phase: str) -> None:
        """Resolve, then publish to metrics, spans, ranks and on_report; each step guarded on its own."""
        try:
            r = resolve(req, phase, self._resolve_ctx)
        except Exception as e:
            self._guard.fail("resolve", e)
            if self.options.rank_reporter is not None:  # so the other ranks' stamps of it are let go
                self._guarded("ranks", self.options.rank_reporter.report, _UNRESOLVED, req.rank_request)
            return
        report = self.last_report = r.report
        self._guarded("emit.metrics", self.publisher.publish, report)
        if req.stream is not None and phase == "serving":  # a session's warm-up call is nobody's stream
            self._guarded("emit.stream", self._emit_stream, req, report)
        if report.shape is not None and report.shape.few_step(self.few_step_max_steps):
            report.extra["few_step"] = True
            if phase == "serving":  # warm-up forces hits on purpose (compiling the cache's path)
                self._guarded("emit.few_step", self.publisher.few_step_hits, report)
        if self._tracer is not None:  # the step bounds are built only for spans
            self._guarded("emit.spans", spans.emit, self._tracer, report, req.parent_ctx, r.stage_bounds,
                          r.step_bounds)
        if self.options.rank_reporter is not None:
            self._guarded("ranks", self.options.rank_reporter.report, report, req.rank_request)
        if self.options.on_report is not None:
            self._guarded("on_report", self.options.on_report, report)

    def _kv_read(self, req: RequestMarks, kv_cache: Any, flag: Any) -> None:
        """After a chunk was encoded into the cache: its bytes (tensor sizes), and the worker's KV gauges."""
        stream, model = req.stream, self._chunks
        allocated, element = chunks.cache_bytes(kv_cache)
        cached = int(flag.get("num_cached_chunks", 0)) if isinstance(flag, dict) else len(stream.outs)
        reading = chunks.KvReading(allocated, element, cached)
        stream.kv.append(reading)
        if self._stream is not None and model is not None:
            self._stream.live(id(stream), allocated, chunks.in_use_bytes(model, stream, reading), stream.ledger_bytes)
            if self.phase == "serving":  # a session's chunks show while it runs, not only at its end
                for index, seconds, frames in chunks.ready_chunks(model, stream, self.clock.seconds, req.start,
                                                                  self.clock.ready):
                    self._stream.chunk(index, seconds, frames, self.options.stream_fps, stream.lead_seconds)

    def _emit_stream(self, req: RequestMarks, report: RequestReport) -> None:
        """A chunked call's chunk latencies, real-time factors and KV reading, into its report and the series."""
        if self._chunks is None or self._stream is None:
            return
        last_out = (req.vae_spans[0][0] if req.vae_spans else req.end) if req.outcome == "ok" else None
        report.stream = chunks.resolve(self._chunks, req.stream, self.clock.seconds, req.start, last_out,
                                       self.options.stream_fps, len(report.step_seconds))
        if report.stream is not None:
            self._stream.publish(report.stream, req.stream.published)

    @contextlib.contextmanager
    def stream_session(self, opened_at: float | None = None) -> Iterator[SessionMark]:
        """Mark a streaming session around the chunked call(s) that serve it, on this thread.

        ``opened_at`` is the host's ``time.perf_counter()`` when the client opened the session (another process
        of the same host may stamp it: the clock is the system's monotonic one); the first chunk's latency then
        counts from there, as the client sees it, not from the call's start.  The session counts as active
        inside the block; at its end its outcome (``mark.outcome``: done, closed or failed; an exception that
        leaves the block makes it failed, or closed where the exception says ``stepwatch_outcome =
        "cancelled"``) and duration are recorded.  A pipeline that is not chunked records nothing.
        """
        opened = time.perf_counter() if opened_at is None else opened_at
        mark = SessionMark()
        stream = self._stream
        if stream is not None:
            self._guarded("stream.session", stream.session_opened)
        self._local.session_opened = opened
        try:
            yield mark
        except BaseException as exc:
            mark.outcome = "closed" if getattr(exc, "stepwatch_outcome", None) == "cancelled" else "failed"
            self._guarded("stream.session", self._session_oom, exc)
            raise
        finally:
            self._local.session_opened = None
            if stream is not None:
                self._guarded("stream.session", stream.session_ended, mark.outcome, time.perf_counter() - opened)

    def _session_oom(self, exc: BaseException) -> None:
        """An out-of-memory the host raised for a session outside any call (its KV cache did not fit the host's
        KV memory): counted with the stage and shape the exception names (``stepwatch_stage``,
        ``stepwatch_shape``).  One raised inside a call was counted by that call."""
        stage = getattr(exc, "stepwatch_stage", None)
        if stage is None or not is_oom(exc):
            return
        shape = getattr(exc, "stepwatch_shape", None)
        label = self.labeler.label(ShapeKey.parse(shape)) if shape else "other"
        self.metrics.oom_total.labels(shape=label, stage=str(stage)).inc()

    def set_stream_kv_capacity(self, capacity_bytes: int) -> None:
        """The KV memory a host gives its chunked calls (``stepwatch_stream_kv_cache_capacity_bytes``)."""
        if self._stream is not None:
            self._stream.m.stream_kv_cache_capacity_bytes.set(max(0, int(capacity_bytes)))

    def _guarded(self, component: str, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:
            self._guard.fail(component, e)

    # ----- removal --------------------------------------------------------------------------
    def remove(self) -> None:
        self._drain_pending()
        self.patches.remove_all()
        WATCH.unsubscribe(self)
        self.pipe.__dict__.pop(ATTR, None)


class _Phase:
    def __init__(self, inst: Instrumentation, phase: str) -> None:
        self._inst = inst
        self._phase = phase
        self._prev = "serving"

    def __enter__(self) -> Instrumentation:
        self._prev = self._inst.phase
        self._inst.phase = self._phase
        self._show()
        return self._inst

    def __exit__(self, *exc: Any) -> None:
        self._inst.phase = self._prev
        self._show()

    def _show(self) -> None:
        """``stepwatch_pipeline_warmup_active`` follows the phase: what waits behind a re-warm is visible."""
        try:
            self._inst.metrics.pipeline_warmup_active.set(int(self._inst.phase == "warmup"))
        except Exception as e:
            self._inst._guard.fail("warmup", e)


class _Resolver:
    """Resolves CUDA-timed requests once their events complete, off the request path."""

    _lock = threading.Lock()
    _threads: dict[int, threading.Thread] = {}

    @classmethod
    def ensure(cls, inst: Instrumentation) -> None:
        with cls._lock:
            t = cls._threads.get(id(inst))
            if t is not None and t.is_alive():
                return
            t = threading.Thread(target=cls._run, args=(inst,), name="stepwatch-resolver", daemon=True)
            cls._threads[id(inst)] = t
            t.start()

    @classmethod
    def _run(cls, inst: Instrumentation) -> None:
        while True:
            inst._drain_pending()
            with cls._lock:  # decided under the lock ensure() takes: a request queued meanwhile is not stranded
                if not inst._pending:
                    cls._threads.pop(id(inst), None)
                    return
            time.sleep(0.005)


def instrument(pipe: Any, options: InstrumentOptions | None = None, **kwargs: Any) -> Instrumentation:
    """Instrument a diffusers pipeline in place; returns the handle.

    Idempotent: a pipeline that is already instrumented returns its existing
    handle unchanged.  ``kwargs`` are InstrumentOptions fields.
    """
    existing = pipe.__dict__.get(ATTR)
    if existing is not None:
        return existing
    if options is None:
        options = InstrumentOptions(**kwargs)
    elif kwargs:
        raise TypeError("pass either options or keyword options, not both")
    inst = Instrumentation(pipe, options)
    pipe.__dict__[ATTR] = inst
    try:
        inst._ensure_component_patches()
        inst.patches.register(patches.CALL, pipe, "__class__", hooks.instrumented_class(type(pipe)))
        WATCH.subscribe(inst)
    except Exception:
        inst.remove()
        raise
    return inst


def uninstrument(pipe: Any) -> bool:
    """Remove every stepwatch hook from the pipeline. Returns False when there was none."""
    inst = pipe.__dict__.get(ATTR)
    if inst is None:
        return False
    inst.remove()
    return True
