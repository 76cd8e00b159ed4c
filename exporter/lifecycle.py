"""The request lifecycle of an instrumented pipeline: the hooks' marks, from a call's start to its report.

A part of ``Instrumentation`` (``exporter/instrument.py``), which holds the
state it reads.  A call begins (marks, the rank's request), the hooks mark its
stages and their memory, it ends (outcome, OOM demand), and once the device's
timings are ready its marks are resolved (``request.resolve``) and published,
each step guarded on its own.  CUDA-timed requests resolve on a background
thread, off the request path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from stepwatch.exporter import caches, chunks, spans
from stepwatch.exporter.compile_watch import WATCH
from stepwatch.exporter.memory import is_oom, oom_requested_bytes
from stepwatch.exporter.options import InstrumentationState
from stepwatch.exporter.publish import Publisher
from stepwatch.exporter.report import RequestReport
from stepwatch.exporter.request import (
    CallSignature,
    RequestMarks,
    ResolveContext,
    denoiser,
    marks_for,
    resolve,
)


class _Unresolved:
    """What the rank reporter is given for a request that could not be resolved: no steps."""

    __slots__ = ()
    step_seconds: tuple[float, ...] = ()

    @property
    def extra(self) -> dict[str, Any]:
        return {}


_UNRESOLVED = _Unresolved()


class RequestLifecycle(InstrumentationState):
    """Begins, marks, ends and emits each request of an Instrumentation."""

    publisher: Publisher
    last_report: RequestReport | None
    few_step_max_steps: int
    _pending: list[tuple[RequestMarks, str]]
    _pending_lock: threading.Lock
    _tracer: Any
    _sig: CallSignature
    _find_cache: Callable[[Any], tuple[str, caches.Decision] | None]
    _resolve_ctx: ResolveContext
    _ensure_component_patches: Callable[[], None]
    _emit_stream: Callable[[RequestMarks, RequestReport], None]

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

    def _first_call(self, req: RequestMarks, hidden: Any, kwargs: dict[str, Any]) -> None:
        """The request's first transformer call: its hidden_states shape and text tokens, what the ledger
        counts (the batches of all calls go to the log in the hook itself)."""
        text = getattr(kwargs.get("encoder_hidden_states"), "shape", None)
        tokens = int(text[1]) if text is not None and len(text) >= 2 else None
        req.call_shape = (tuple(int(d) for d in hidden.shape), tokens)

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
        if self._tracer is not None:
            req.span_attrs = spans.request_attributes(spans.model_name(self.pipe), params, req.frames is not None)
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
                          r.step_bounds, req.span_attrs)
        if self.options.rank_reporter is not None:
            self._guarded("ranks", self.options.rank_reporter.report, report, req.rank_request)
        if self.options.on_report is not None:
            self._guarded("on_report", self.options.on_report, report)


class _Resolver:
    """Resolves CUDA-timed requests once their events complete, off the request path."""

    _lock = threading.Lock()
    _threads: dict[int, threading.Thread] = {}

    @classmethod
    def ensure(cls, inst: RequestLifecycle) -> None:
        with cls._lock:
            t = cls._threads.get(id(inst))
            if t is not None and t.is_alive():
                return
            t = threading.Thread(target=cls._run, args=(inst,), name="stepwatch-resolver", daemon=True)
            cls._threads[id(inst)] = t
            t.start()

    @classmethod
    def _run(cls, inst: RequestLifecycle) -> None:
        while True:
            inst._drain_pending()
            with cls._lock:  # decided under the lock ensure() takes: a request queued meanwhile is not stranded
                if not inst._pending:
                    cls._threads.pop(id(inst), None)
                    return
            time.sleep(0.005)
