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

Every patch is recorded by name on the pipeline, so uninstrument() undoes
exactly what instrument() did, and instrument() twice is a no-op.  Hook bodies
never raise into the pipeline: errors are counted and logged once.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry

from stepwatch.exporter import caches, ledger, spans
from stepwatch.exporter.clock import Clock, clock_for
from stepwatch.exporter.compile_watch import WATCH
from stepwatch.exporter.memory import MemoryProbe, is_oom, oom_requested_bytes, probe_for
from stepwatch.exporter.report import CompileEvent, RequestReport
from stepwatch.exporter.shapes import ShapeKey, ShapeLabeler
from stepwatch.metrics import MetricSet

log = logging.getLogger("stepwatch.exporter")

ATTR = "_stepwatch"
_COMPONENTS = ("scheduler", "transformer", "transformer_2", "unet", "vae")
STAGES = ("text_encode", "denoise", "vae_decode")
PEAK_STAGES = (*STAGES, "request")


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


class _Guard:
    """Count and log-once every error raised inside our own hook bodies."""

    def __init__(self, metrics: MetricSet) -> None:
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


@dataclass
class _Req:
    """Marks of one request in flight; resolved into a RequestReport afterwards."""

    start: Any
    start_unix: float
    height: int | None
    width: int | None
    frames: int | None
    steps_hint: int | None
    cfg_hint: bool
    text_tokens: int
    parent_ctx: Any
    cache: tuple[str, caches.Decision] | None
    stage: str = "prepare"
    mem_stage: str = "prepare"
    te_spans: list[tuple[Any, Any]] = field(default_factory=list)
    te_open: Any = None
    denoise_start: Any = None
    planned_steps: int | None = None
    step_marks: list[Any] = field(default_factory=list)
    calls: int = 0  # transformer branches (CFG) in the current step
    max_branches: int = 0
    decisions: list[tuple[int, str, bool]] = field(default_factory=list)
    vae_spans: list[tuple[Any, Any]] = field(default_factory=list)
    vae_open: Any = None
    end: Any = None
    compiles: list[tuple[float, float]] = field(default_factory=list)
    peaks: dict[str, int] = field(default_factory=dict)
    capacity: int = 0
    outcome: str = "ok"
    error: str | None = None
    oom_demand: int | None = None


class _BranchContext:
    """Wraps transformer.cache_context: counts CFG branches, reads the cache decision."""

    __slots__ = ("_inner", "_inst", "_name", "_req")

    def __init__(self, inst: Instrumentation, req: _Req, inner: Any, name: str) -> None:
        self._inst = inst
        self._req = req
        self._inner = inner
        self._name = name

    def __enter__(self) -> Any:
        return self._inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        result = self._inner.__exit__(*exc)
        try:
            req = self._req
            req.calls += 1
            if req.cache is not None:
                hit = req.cache[1](self._name)
                if hit is not None:
                    req.decisions.append((len(req.step_marks), self._name, hit))
        except Exception as e:
            self._inst._guard.fail("transformer.cache_context", e)
        return result


class Instrumentation:
    """The handle instrument() returns; also reachable as ``pipe._stepwatch``."""

    def __init__(self, pipe: Any, options: InstrumentOptions) -> None:
        self.pipe = pipe
        self.options = options
        registry = options.registry if options.registry is not None else REGISTRY
        self.metrics = MetricSet.shared(registry, "exporter")
        self._guard = _Guard(self.metrics)
        self.labeler = ShapeLabeler(options.shapes, options.max_shapes)
        device = getattr(pipe, "device", None)
        self.clock: Clock = options.clock or clock_for(device)
        self.memory: MemoryProbe = options.memory or probe_for(device)
        self.phase = "serving"
        self.last_report: RequestReport | None = None
        self._local = threading.local()
        self._patches: dict[str, tuple[Any, str, Any, bool]] = {}
        self._pending: list[tuple[_Req, str]] = []
        self._pending_lock = threading.Lock()
        self._tracer = spans.make_tracer(options.tracer_provider)
        self._flops_memo: dict[tuple[Any, ...], float] = {}
        self._ledger: ledger.LedgerModel | None = None
        self._sig = _CallSignature(type(pipe))
        self._find_cache = caches.CacheFinder()
        self._components_key: tuple[int, ...] = ()
        self._child_cache: dict[str, _ShapeChildren] = {}
        self._peak_children: dict[str, Any] = {}
        self.peak_flops = options.peak_flops
        self._setup_static()

    # ----- set-up ---------------------------------------------------------------------------
    def _setup_static(self) -> None:
        m = self.metrics
        try:
            import diffusers
            import torch

            versions = {"torch": torch.__version__, "diffusers": diffusers.__version__}
        except Exception:
            versions = {}
        from stepwatch import __version__

        m.exporter_build.info({"stepwatch": __version__, "pipeline": type(self.pipe).__name__, **versions})
        dev = self.memory.device
        if self.peak_flops is None and dev.startswith("cuda"):
            try:
                import torch

                self.peak_flops = ledger.peak_flops_for(torch.cuda.get_device_name(int(dev.split(":")[1])))
            except Exception as e:
                self._guard.fail("ledger.peak", e)
        m.device_peak_flops_per_second.labels(device=dev).set(self.peak_flops or 0)
        self._capacity_child = m.memory_capacity_bytes.labels(device=dev)
        self._ratio_child = m.memory_peak_ratio.labels(device=dev)
        self.refresh_capacity()
        transformer = _denoiser(self.pipe)
        if transformer is not None:
            try:
                self._ledger = ledger.ledger_model(transformer)
            except Exception as e:
                self._guard.fail("ledger.model", e)
        if self.options.baselines is not None:
            self.set_baselines(self.options.baselines)
        for shape in [*sorted(self.labeler.known), "other"]:
            self._zero_events(shape)
        m.exporter_errors_total.labels(component="request.begin")

    def refresh_capacity(self) -> None:
        """Re-read the capacity now (e.g. after the worker armed its memory budget)."""
        try:
            self._capacity_child.set(self.memory.capacity_bytes())
        except Exception as e:
            self._guard.fail("memory.capacity", e)

    def set_baselines(self, source: str | Path | Mapping[str, Any]) -> None:
        """Publish per-shape baselines (step seconds, cache hit ratio) as gauges for the rules."""
        data: Mapping[str, Any]
        if isinstance(source, (str, Path)):
            import yaml

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

    def _patch(self, name: str, obj: Any, attr: str, new: Any) -> None:
        if name in self._patches:
            return
        had_own = attr in getattr(obj, "__dict__", {})
        self._patches[name] = (obj, attr, getattr(obj, attr), had_own)
        setattr(obj, attr, new)

    def _unpatch_all(self) -> None:
        for name in reversed(list(self._patches)):
            self._unpatch(name)

    def _ensure_component_patches(self) -> None:
        """(Re)attach to the pipeline's current components; an identity check when nothing changed."""
        pipe = self.pipe
        d = pipe.__dict__
        components = tuple(id(d.get(c)) for c in _COMPONENTS)
        if components == self._components_key:
            return
        self._components_key = components
        for name in list(self._patches):  # a component removed or swapped: let go of the old object
            comp = name.split(".", 1)[0]
            if comp in _COMPONENTS and d.get(comp) is not self._patches[name][0]:
                self._unpatch(name)
        if getattr(type(pipe), "encode_prompt", None) is not None:
            self._patch("encode_prompt", pipe, "encode_prompt", self._wrap_stage(pipe.encode_prompt, "te"))
        sched = getattr(pipe, "scheduler", None)
        if sched is not None:
            self._repatch("scheduler.set_timesteps", sched, "set_timesteps", self._wrap_set_timesteps)
            self._repatch("scheduler.step", sched, "step", self._wrap_step)
        for comp in ("transformer", "transformer_2", "unet"):
            mod = getattr(pipe, comp, None)
            if mod is not None and hasattr(mod, "cache_context"):
                self._repatch(f"{comp}.cache_context", mod, "cache_context", self._wrap_cache_context)
        vae = getattr(pipe, "vae", None)
        if vae is not None and hasattr(vae, "decode"):
            self._repatch("vae.decode", vae, "decode", lambda fn: self._wrap_stage(fn, "vae"))

    def _repatch(self, name: str, obj: Any, attr: str, wrap: Callable[[Any], Any]) -> None:
        """Patch ``obj.attr`` unless already patched on this very object (a swapped component is re-patched)."""
        current = self._patches.get(name)
        if current is not None:
            if current[0] is obj:
                return
            self._unpatch(name)
        self._patch(name, obj, attr, wrap(getattr(obj, attr)))

    def _unpatch(self, name: str) -> None:
        obj, attr, orig, had_own = self._patches.pop(name)
        try:
            if had_own:
                setattr(obj, attr, orig)
            else:
                delattr(obj, attr)
        except Exception as e:
            self._guard.fail(f"unpatch.{name}", e)

    # ----- phases ---------------------------------------------------------------------------
    def warmup(self) -> _Phase:
        """``with inst.warmup(): pipe(...)``: compiles inside count as warm-up, not serving."""
        return _Phase(self, "warmup")

    # ----- wrappers -------------------------------------------------------------------------
    def _wrap_stage(self, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        inst = self

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            req = getattr(inst._local, "req", None)
            if req is not None:
                try:
                    inst._stage_enter(req, kind)
                except Exception as e:
                    inst._guard.fail(f"{kind}.enter", e)
            out = fn(*args, **kwargs)
            if req is not None:
                try:
                    inst._stage_exit(req, kind)
                except Exception as e:
                    inst._guard.fail(f"{kind}.exit", e)
            return out

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped

    def _wrap_set_timesteps(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        inst = self

        def set_timesteps(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            req = getattr(inst._local, "req", None)
            if req is not None:
                try:
                    inst._denoise_start(req)
                except Exception as e:
                    inst._guard.fail("scheduler.set_timesteps", e)
            return out

        set_timesteps.__wrapped__ = fn  # type: ignore[attr-defined]
        return set_timesteps

    def _wrap_step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        inst = self

        def step(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            req = getattr(inst._local, "req", None)
            if req is not None:
                try:
                    req.step_marks.append(inst.clock.mark())
                    if req.calls > req.max_branches:
                        req.max_branches = req.calls
                    req.calls = 0
                except Exception as e:
                    inst._guard.fail("scheduler.step", e)
            return out

        step.__wrapped__ = fn  # type: ignore[attr-defined]
        return step

    def _wrap_cache_context(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        inst = self

        def cache_context(name: str, *args: Any, **kwargs: Any) -> Any:
            inner = fn(name, *args, **kwargs)
            req = getattr(inst._local, "req", None)
            if req is None:
                return inner
            return _BranchContext(inst, req, inner, name)

        cache_context.__wrapped__ = fn  # type: ignore[attr-defined]
        return cache_context

    # ----- hook bodies ----------------------------------------------------------------------
    # Memory boundaries: text encoding and latent preparation share one window (the encoders'
    # peak is what matters there), then denoise, then vae_decode: four reads per request.
    def _stage_enter(self, req: _Req, kind: str) -> None:
        if kind == "te":
            req.stage = "text_encode"
            req.te_open = self.clock.mark()
        else:
            self._close_stage_memory(req)
            req.stage = "vae_decode"
            req.vae_open = self.clock.mark()

    def _stage_exit(self, req: _Req, kind: str) -> None:
        m = self.clock.mark()
        if kind == "te":
            req.te_spans.append((req.te_open, m))
            req.stage = "prepare"
            req.mem_stage = "text_encode"
        else:
            self._close_stage_memory(req)
            req.vae_spans.append((req.vae_open, m))
            req.stage = "postprocess"

    def _denoise_start(self, req: _Req) -> None:
        self._close_stage_memory(req)
        req.denoise_start = self.clock.mark()
        req.stage = "denoise"
        sched = getattr(self.pipe, "scheduler", None)
        ts = getattr(sched, "timesteps", None)
        if ts is not None:
            req.planned_steps = len(ts)

    def _close_stage_memory(self, req: _Req) -> None:
        """Attribute the peak since the last boundary to the stage that just ran."""
        peak = self.memory.peak_bytes()
        stage = req.mem_stage if req.stage == "prepare" else req.stage
        if peak > req.peaks.get(stage, 0):
            req.peaks[stage] = peak
        self.memory.reset_peak()

    def on_orphan_compile(self, start: float, seconds: float) -> None:
        try:
            self.metrics.compile_total.labels(shape="other", phase=self.phase).inc()
            self.metrics.compile_duration_seconds.labels(shape="other", phase=self.phase).observe(seconds)
        except Exception as e:
            self._guard.fail("compile.orphan", e)

    # ----- request lifecycle ----------------------------------------------------------------
    def _begin(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Req:
        self._ensure_component_patches()
        WATCH.ensure()
        self._drain_pending()
        params = self._sig.bind(args, kwargs)
        height, width = params.get("height"), params.get("width")
        if height is None or width is None:
            default = _default_size(self.pipe)
            height = height or default
            width = width or default
        frames = params.get("num_frames")
        text_tokens = params.get("max_sequence_length") or self.options.text_tokens or 0
        denoiser = _denoiser(self.pipe)
        req = _Req(
            start=self.clock.mark(),
            start_unix=time.time(),
            height=int(height) if height else None,
            width=int(width) if width else None,
            frames=int(frames) if isinstance(frames, int) and frames > 1 else None,
            steps_hint=params.get("num_inference_steps"),
            cfg_hint=_cfg_hint(self.pipe, params),
            text_tokens=int(text_tokens),
            parent_ctx=spans.capture_parent() if self._tracer is not None else None,
            cache=self._find_cache(denoiser) if denoiser is not None else None,
        )
        req.capacity = self.memory.capacity_bytes()
        self.memory.reset_peak()
        self._local.req = req
        self._local.prev_sink = WATCH.set_sink(lambda s, d: req.compiles.append((s, d)))
        return req

    def _end(self, req: _Req, exc: BaseException | None) -> None:
        self._local.req = None
        WATCH.set_sink(getattr(self._local, "prev_sink", None))
        req.end = self.clock.mark()
        self._close_stage_memory(req)
        if exc is not None:
            req.error = f"{type(exc).__name__}: {exc}"[:500]
            if is_oom(exc):
                req.outcome = "oom"
                requested = oom_requested_bytes(exc)
                if requested is not None:
                    req.oom_demand = self.memory.in_use_bytes() + requested
            else:
                req.outcome = "error"
        phase = self.phase
        if self.options.rank_reporter is not None:
            # Ranks gather per request: every rank must report in request order, on this thread, before
            # the next request's collectives.  The host already waited for the output; this wait is free.
            self.clock.wait(req.end)
        if self.clock.ready(req.end):
            self._emit(req, phase)
        else:
            with self._pending_lock:
                self._pending.append((req, phase))
            _Resolver.ensure(self)

    def _drain_pending(self) -> None:
        if not self._pending:
            return
        ready: list[tuple[_Req, str]] = []
        keep: list[tuple[_Req, str]] = []
        with self._pending_lock:
            for p in self._pending:
                (ready if self.clock.ready(p[0].end) else keep).append(p)
            self._pending = keep
        for req, phase in ready:
            self._emit(req, phase)

    def _emit(self, req: _Req, phase: str) -> None:
        try:
            report, stage_bounds, step_bounds = self._resolve(req, phase)
        except Exception as e:
            self._guard.fail("resolve", e)
            return
        self.last_report = report
        try:
            self._publish(report)
        except Exception as e:
            self._guard.fail("emit.metrics", e)
        try:
            spans.emit(self._tracer, report, req.parent_ctx, stage_bounds, step_bounds)
        except Exception as e:
            self._guard.fail("emit.spans", e)
        if self.options.rank_reporter is not None:
            try:
                self.options.rank_reporter.report(report, self.metrics)
            except Exception as e:
                self._guard.fail("ranks", e)
        if self.options.on_report is not None:
            try:
                self.options.on_report(report)
            except Exception as e:
                self._guard.fail("on_report", e)

    def _resolve(self, req: _Req, phase: str) -> tuple[RequestReport, dict[str, tuple[float, float]],
                                                        list[tuple[float, float]]]:
        c = self.clock
        rel = lambda m: c.seconds(req.start, m)  # noqa: E731
        total = rel(req.end)
        stage_bounds: dict[str, tuple[float, float]] = {}
        stages: dict[str, float] = {}
        if req.te_spans:
            stages["text_encode"] = sum(c.seconds(a, b) for a, b in req.te_spans)
            stage_bounds["text_encode"] = (rel(req.te_spans[0][0]), rel(req.te_spans[-1][1]))
        step_bounds: list[tuple[float, float]] = []
        if req.denoise_start is not None and req.step_marks:
            prev = rel(req.denoise_start)
            for m in req.step_marks:
                t = rel(m)
                step_bounds.append((prev, t))
                prev = t
            stages["denoise"] = step_bounds[-1][1] - step_bounds[0][0]
            stage_bounds["denoise"] = (step_bounds[0][0], step_bounds[-1][1])
        if req.vae_spans:
            stages["vae_decode"] = sum(c.seconds(a, b) for a, b in req.vae_spans)
            stage_bounds["vae_decode"] = (rel(req.vae_spans[0][0]), rel(req.vae_spans[-1][1]))
        step_seconds = [b - a for a, b in step_bounds]
        branches = req.max_branches
        cfg = branches > 1 if branches else req.cfg_hint
        steps = req.planned_steps or req.steps_hint or len(step_seconds)
        shape = (ShapeKey(req.height, req.width, int(steps), cfg, req.frames)
                 if req.height and req.width and steps else None)
        label = self.labeler.label(shape)
        step_flops = self._step_flops(req, max(branches, 2 if cfg else 1)) if shape else None
        mean_step = sum(step_seconds) / len(step_seconds) if step_seconds else 0.0
        mfu = ledger.mfu(step_flops, mean_step, self.peak_flops) if step_flops else None
        peaks = dict(req.peaks)
        peaks.pop("prepare", None)
        peaks.pop("postprocess", None)
        request_peak = max(req.peaks.values()) if req.peaks else 0
        failed_stage = None
        if req.outcome != "ok":
            failed_stage = req.stage
            if req.oom_demand is not None and req.stage in STAGES:
                peaks[req.stage] = max(peaks.get(req.stage, 0), req.oom_demand)
                request_peak = max(request_peak, req.oom_demand)
        peaks["request"] = request_peak
        report = RequestReport(
            shape=shape,
            shape_label=label,
            outcome=req.outcome,
            seconds=total,
            stages=stages,
            step_seconds=step_seconds,
            cfg_branches=branches,
            cache=req.cache[0] if req.cache else None,
            cache_decisions=req.decisions,
            compiles=[CompileEvent(s, d, phase) for s, d in req.compiles],
            memory_peak_bytes=peaks,
            memory_capacity_bytes=req.capacity,
            device=self.memory.device,
            step_flops=step_flops,
            mfu=mfu,
            failed_stage=failed_stage,
            error=req.error,
            start_unix=req.start_unix,
        )
        return report, stage_bounds, step_bounds

    def _step_flops(self, req: _Req, branches: int) -> float | None:
        if self._ledger is None or not req.height or not req.width:
            return None
        key = (req.height, req.width, req.frames, req.text_tokens, branches)
        cached = self._flops_memo.get(key)
        if cached is not None:
            return cached
        pipe = self.pipe
        spatial = int(getattr(pipe, "vae_scale_factor_spatial", 0) or getattr(pipe, "vae_scale_factor", 8) or 8)
        temporal = int(getattr(pipe, "vae_scale_factor_temporal", 4) or 4)
        n, n_txt = self._ledger.tokens(req.height, req.width, req.frames, spatial, temporal, req.text_tokens)
        flops = branches * self._ledger.forward_flops(n, n_txt)
        if len(self._flops_memo) < 256:
            self._flops_memo[key] = flops
        return flops

    def _children(self, shape: str) -> _ShapeChildren:
        c = self._child_cache.get(shape)
        if c is None:
            c = self._child_cache[shape] = _ShapeChildren(self.metrics, shape)
            self._zero_events(shape)
        return c

    def _zero_events(self, shape: str) -> None:
        """Event counters at 0 from a shape's first appearance (from the start for the allowlist), so its
        first OOM or serving compile is an increase that rate() and increase() see."""
        self.metrics.compile_total.labels(shape=shape, phase="serving")
        for stage in (*STAGES, "prepare", "postprocess"):
            self.metrics.oom_total.labels(shape=shape, stage=stage)

    def _publish(self, r: RequestReport) -> None:
        m = self.metrics
        shape = r.shape_label
        c = self._children(shape)
        (c.ok if r.outcome == "ok" else m.pipeline_requests_total.labels(shape=shape, outcome=r.outcome)).inc()
        c.request.observe(r.seconds)
        for stage, sec in r.stages.items():
            c.stages[stage].observe(sec)
        if r.step_seconds:
            for s in r.step_seconds:
                c.step.observe(s)
            c.branches.set(r.cfg_branches)
        if r.cache:
            hits = r.hits
            if hits:
                m.cache_decisions_total.labels(shape=shape, cache=r.cache, decision="hit").inc(hits)
            if r.misses:
                m.cache_decisions_total.labels(shape=shape, cache=r.cache, decision="miss").inc(r.misses)
            steps = r.shape.steps if r.shape else max(1, len(r.step_seconds))
            for step, _branch, hit in r.cache_decisions:
                if hit:
                    c.position.observe(step / steps)
        for ev in r.compiles:
            m.compile_total.labels(shape=shape, phase=ev.phase).inc()
            m.compile_duration_seconds.labels(shape=shape, phase=ev.phase).observe(ev.seconds)
        peaks = self._peak_children
        for stage in PEAK_STAGES:  # every one, every request: a stage this request skipped reads 0, not stale
            g = peaks.get(stage)
            if g is None:
                g = peaks[stage] = m.memory_peak_bytes.labels(device=r.device, stage=stage)
            g.set(r.memory_peak_bytes.get(stage, 0))
        if r.memory_capacity_bytes:
            self._capacity_child.set(r.memory_capacity_bytes)
            self._ratio_child.observe(r.memory_peak_bytes.get("request", 0) / r.memory_capacity_bytes)
        if r.outcome == "oom":
            m.oom_total.labels(shape=shape, stage=r.failed_stage or "unknown").inc()
        if r.step_flops:
            c.step_flops.set(r.step_flops)
            if r.step_seconds:
                c.flops.inc(r.step_flops * len(r.step_seconds))
        if r.mfu is not None:
            c.mfu.set(r.mfu)

    # ----- removal --------------------------------------------------------------------------
    def remove(self) -> None:
        self._drain_pending()
        self._unpatch_all()
        WATCH.unsubscribe(self)
        pipe = self.pipe
        orig_cls = getattr(type(pipe), "_stepwatch_original_class", None)
        if orig_cls is not None:
            pipe.__class__ = orig_cls
        if ATTR in pipe.__dict__:
            del pipe.__dict__[ATTR]


class _ShapeChildren:
    """Label children of one shape, looked up once (labels() costs more than observe())."""

    def __init__(self, m: MetricSet, shape: str) -> None:
        self.ok = m.pipeline_requests_total.labels(shape=shape, outcome="ok")
        self.request = m.pipeline_request_duration_seconds.labels(shape=shape)
        self.stages = {s: m.pipeline_stage_duration_seconds.labels(shape=shape, stage=s) for s in STAGES}
        self.step = m.pipeline_step_duration_seconds.labels(shape=shape)
        self.branches = m.pipeline_cfg_branches.labels(shape=shape)
        self.position = m.cache_hit_position_ratio.labels(shape=shape)
        self.step_flops = m.ledger_step_flops.labels(shape=shape)
        self.flops = m.ledger_flops_total.labels(shape=shape)
        self._m = m
        self._shape = shape
        self._mfu: Any = None

    @property
    def mfu(self) -> Any:
        """Created on first use: an MFU series at 0 would read as "no useful work", not "unknown"."""
        if self._mfu is None:
            self._mfu = self._m.ledger_mfu_ratio.labels(shape=self._shape)
        return self._mfu


class _Phase:
    def __init__(self, inst: Instrumentation, phase: str) -> None:
        self._inst = inst
        self._phase = phase
        self._prev = "serving"

    def __enter__(self) -> Instrumentation:
        self._prev = self._inst.phase
        self._inst.phase = self._phase
        return self._inst

    def __exit__(self, *exc: Any) -> None:
        self._inst.phase = self._prev


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


_CLASS_CACHE: dict[type, type] = {}


def _instrumented_class(cls: type) -> type:
    """A subclass whose __call__ wraps the original one with request bookkeeping."""
    sub = _CLASS_CACHE.get(cls)
    if sub is not None:
        return sub
    original_call = cls.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        inst: Instrumentation | None = self.__dict__.get(ATTR)
        if inst is None:
            return original_call(self, *args, **kwargs)
        req = None
        try:
            req = inst._begin(args, kwargs)
        except Exception as e:
            inst._guard.fail("request.begin", e)
            inst._local.req = None
        try:
            out = original_call(self, *args, **kwargs)
        except BaseException as exc:
            if req is not None:
                try:
                    inst._end(req, exc)
                except Exception as e:
                    inst._guard.fail("request.end", e)
            raise
        if req is not None:
            try:
                inst._end(req, None)
            except Exception as e:
                inst._guard.fail("request.end", e)
        return out

    __call__.__doc__ = original_call.__doc__
    __call__.__wrapped__ = original_call  # type: ignore[attr-defined]
    sub = type(cls.__name__, (cls,), {
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "_stepwatch_original_class": cls,
    })
    _CLASS_CACHE[cls] = sub
    return sub


class _CallSignature:
    """Positional names and defaults of the pipeline's __call__, read once; binding is a dict merge."""

    def __init__(self, cls: type) -> None:
        self.names: list[str] = []
        self.defaults: dict[str, Any] = {}
        try:
            sig = inspect.signature(cls.__call__)
        except (TypeError, ValueError):
            return
        for i, (name, p) in enumerate(sig.parameters.items()):
            if i == 0 or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                self.names.append(name)
            if p.default is not p.empty:
                self.defaults[name] = p.default

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        out = dict(self.defaults)
        if args:
            out.update(zip(self.names, args, strict=False))
        out.update(kwargs)
        return out


def _default_size(pipe: Any) -> int | None:
    sample = getattr(pipe, "default_sample_size", None)
    scale = getattr(pipe, "vae_scale_factor", None) or getattr(pipe, "vae_scale_factor_spatial", None)
    if sample and scale:
        return int(sample) * int(scale)
    return None


def _cfg_hint(pipe: Any, params: Mapping[str, Any]) -> bool:
    """CFG on? Only used when no transformer call was observed (the request failed early)."""
    true_cfg = params.get("true_cfg_scale")
    if true_cfg is not None and "guidance_scale" in params and "negative_prompt" in params:
        return bool(true_cfg > 1 and (params.get("negative_prompt") or params.get("negative_prompt_embeds")))
    gs = params.get("guidance_scale")
    return bool(gs is not None and gs > 1 and not getattr(getattr(pipe, "transformer", None), "config", {})
                .get("guidance_embeds", False))


def _denoiser(pipe: Any) -> Any:
    """The transformer (or UNet), unwrapped from torch.compile's OptimizedModule for its config and hooks."""
    t = getattr(pipe, "transformer", None)  # not `or`: an OptimizedModule's truth test raises
    if t is None:
        t = getattr(pipe, "unet", None)
    return getattr(t, "_orig_mod", t)


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
        pipe.__class__ = _instrumented_class(type(pipe))
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
