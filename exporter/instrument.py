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

  transformer.__call__         each call's batch, the first call's shapes (the class
                               swapped like the pipeline's, outside what torch.compile traces)

CFG branches are counted from what the transformer receives: the samples of a step's calls over the prompt
batch (``request.branch_count``), so separate calls (FLUX's true CFG, Wan) and one call on a doubled batch
(SD3, PixArt, CogVideoX) read alike, whatever properties the pipeline has.

The flow has three parts, one module each: the hooks record marks while the
request runs (``hooks``, installed through the named ``patches`` registry, so
uninstrument() undoes exactly what instrument() did and instrument() twice is
a no-op); the marks become a report once device timings are ready
(``request.resolve``, pure); the report becomes metric observations
(``publish``).  This module wires them to one pipeline.  Hook bodies never
raise into the pipeline: errors are counted and logged once.

The handle's parts: its options and error guard (``options``), the request
lifecycle the hooks drive (``lifecycle``), and streaming sessions on a chunked
video pipeline (``stream_sessions``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import REGISTRY

from stepwatch import __version__, versions
from stepwatch.exporter import caches, chunks, hooks, ledger, patches, spans
from stepwatch.exporter.clock import Clock, clock_for
from stepwatch.exporter.compile_watch import WATCH
from stepwatch.exporter.cpu import SchedstatReader, ThreadTotals
from stepwatch.exporter.hooks import ATTR
from stepwatch.exporter.lifecycle import RequestLifecycle
from stepwatch.exporter.memory import MemoryProbe, probe_for
from stepwatch.exporter.options import Guard, InstrumentOptions
from stepwatch.exporter.publish import Publisher
from stepwatch.exporter.report import RequestReport
from stepwatch.exporter.request import (
    PEAK_STAGES,
    STAGES,
    CallSignature,
    RequestMarks,
    ResolveContext,
    StepFlops,
    denoiser,
)
from stepwatch.exporter.shapes import ShapeKey, ShapeLabeler
from stepwatch.exporter.stream_sessions import StreamSessions
from stepwatch.metrics import MetricSet, ScrapeCounter

__all__ = ["ATTR", "PEAK_STAGES", "STAGES", "InstrumentOptions", "Instrumentation", "instrument", "uninstrument"]


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


class Instrumentation(RequestLifecycle, StreamSessions):
    """The handle instrument() returns; also reachable as ``pipe._stepwatch``."""

    def __init__(self, pipe: Any, options: InstrumentOptions) -> None:
        self.pipe = pipe
        self.options = options
        registry = options.registry if options.registry is not None else REGISTRY
        self.metrics = MetricSet.shared(registry, "exporter")
        self._guard = Guard(self.metrics)
        self.patches = patches.PatchRegistry(on_error=self._guard.fail)
        # Signals that read another library's private state run only on tested versions (stepwatch.versions).
        self._gates = {signal: versions.enabled(signal, self._count_off)
                       for signal in ("cache_decisions", "compiled_call", "batched_observe")}
        self.labeler = ShapeLabeler(options.shapes, options.max_shapes)
        device = getattr(pipe, "device", None)
        self.clock: Clock = options.clock or clock_for(device)
        self.memory: MemoryProbe = options.memory or probe_for(device)
        self.publisher = Publisher(self.metrics, self.memory.device, batched=self._gates["batched_observe"])
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
        self._find_cache = caches.CacheFinder() if self._gates["cache_decisions"] else caches.no_cache
        self._components_key: tuple[int, ...] = ()
        self.peak_flops = options.peak_flops
        self.few_step_max_steps = options.few_step_max_steps or _default_few_step()
        if options.rank_reporter is not None:
            options.rank_reporter.bind(self.metrics)
        self._setup_static()
        self._resolve_ctx = ResolveContext(
            seconds=self.clock.seconds, offsets=getattr(self.clock, "offsets", None), labeler=self.labeler,
            device=self.memory.device, peak_flops=self.peak_flops,
            step_flops=StepFlops(self._ledger) if self._ledger is not None else None)

    def _count_off(self, component: str) -> None:
        """A signal the version gate turned off: one count under ``version.<signal>``."""
        self.metrics.exporter_errors_total.labels(component=component).inc()

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
            if mod is None:
                continue
            self._patch_denoiser_call(comp, mod)
            if hasattr(mod, "cache_context"):
                reg.wrap(patches.cache_context(comp), mod, "cache_context", lambda fn: hooks.cache_context(self, fn))
        if self._chunks is not None:
            reg.wrap(patches.ENCODE_KV_CACHE, pipe, "encode_kv_cache", lambda fn: hooks.encode_kv_cache(self, fn))
        vae = getattr(pipe, "vae", None)
        if vae is not None and hasattr(vae, "decode"):
            reg.wrap(patches.VAE_DECODE, vae, "decode", lambda fn: hooks.stage(self, fn, "vae"))

    def _patch_denoiser_call(self, comp: str, mod: Any) -> None:
        """Record each transformer call's batch: the class swapped (``hooks.denoiser_class``), or, for a
        module compiled in place already, its compiled call wrapped on the instance."""
        if not callable(mod):
            return
        reg = self.patches
        name = patches.denoiser_call(comp)
        if mod.__dict__.get("_compiled_call_impl") is not None:
            if self._gates["compiled_call"]:
                reg.wrap(name, mod, "_compiled_call_impl", lambda fn: hooks.compiled_denoiser_call(self, fn))
            return
        reg.register(name, mod, "__class__", hooks.denoiser_class(self, type(mod)))

    # ----- phases ---------------------------------------------------------------------------
    def warmup(self) -> _Phase:
        """``with inst.warmup(): pipe(...)``: compiles inside count as warm-up, not serving."""
        return _Phase(self, "warmup")


    def on_orphan_compile(self, start: float, seconds: float) -> None:
        """A compile outside any request (compile_watch calls this)."""
        try:
            self.publisher.compile("other", self.phase, seconds)
        except Exception as e:
            self._guard.fail("compile.orphan", e)


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
