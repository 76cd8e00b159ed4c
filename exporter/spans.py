"""OpenTelemetry spans for a request, built after the fact from resolved timings.

Spans are created once the device timings are known (explicit start/end
times), so the hot path never touches the tracer.  With no SDK configured the
API's tracer is a no-op and this module does no work at all.
"""

from __future__ import annotations

from typing import Any

from stepwatch.exporter.report import RequestReport

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
except ImportError:  # pragma: no cover - the API is a core dependency
    trace = None  # type: ignore[assignment]
    otel_context = None  # type: ignore[assignment]


def make_tracer(provider: Any = None) -> Any:
    """A tracer, or None when spans would go nowhere."""
    if trace is None:
        return None
    if provider is None:
        provider = trace.get_tracer_provider()
        if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
            # The global provider may be set later: check again per request via the proxy.
            return _LazyTracer()
    return provider.get_tracer("stepwatch.exporter")


class _LazyTracer:
    """Resolves the global provider when a span is due; None while it is a no-op."""

    def get(self) -> Any:
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.NoOpTracerProvider):
            return None
        if isinstance(provider, trace.ProxyTracerProvider):
            return None
        return provider.get_tracer("stepwatch.exporter")


def capture_parent() -> Any:
    return otel_context.get_current() if otel_context is not None else None


def emit(tracer: Any, report: RequestReport, parent: Any, stage_bounds: dict[str, tuple[float, float]],
         step_bounds: list[tuple[float, float]]) -> None:
    """One request span with stage child spans and a span event per step.

    Bounds are seconds relative to the request start.
    """
    if isinstance(tracer, _LazyTracer):
        tracer = tracer.get()
    if tracer is None:
        return
    t0 = int(report.start_unix * 1e9)

    def ns(sec: float) -> int:
        return t0 + int(sec * 1e9)

    attrs = {
        "stepwatch.shape": report.shape_label,
        "stepwatch.outcome": report.outcome,
        "stepwatch.steps": len(report.step_seconds),
        "stepwatch.cfg_branches": report.cfg_branches,
    }
    if report.mfu is not None:
        attrs["stepwatch.mfu"] = report.mfu
    root = tracer.start_span("diffusion.request", context=parent, start_time=t0, attributes=attrs)
    ctx = trace.set_span_in_context(root)
    hit_steps = {s for s, _b, h in report.cache_decisions if h}
    for i, (a, b) in enumerate(step_bounds):
        root.add_event(
            "step",
            {"step.index": i, "step.seconds": b - a, "step.cache_hit": i in hit_steps},
            timestamp=ns(b),
        )
    for stage, (a, b) in stage_bounds.items():
        span = tracer.start_span(f"diffusion.{stage}", context=ctx, start_time=ns(a))
        span.end(end_time=ns(b))
    if report.outcome != "ok":
        root.set_status(trace.Status(trace.StatusCode.ERROR, report.error or report.outcome))
    root.end(end_time=ns(report.seconds))
