"""OpenTelemetry spans for a request, built after the fact from resolved timings.

Spans are created once the device timings are known (explicit start/end
times), so the hot path never touches the tracer.  With no SDK configured the
API's tracer is a no-op and this module does no work at all.

The request span follows OpenTelemetry's GenAI semantic conventions as far as they fit image and video
generation: named ``{gen_ai.operation.name} {gen_ai.request.model}``, operation ``generate_content`` (the
conventions' multimodal generation), provider ``diffusers`` (self-hosted: the runtime, not a vendor), the
request's model, seed and choice count (images or videos per prompt), ``gen_ai.output.type`` ``image`` or
``video``, and on a failure ``error.type`` with an ``exception`` event.  stepwatch's own attributes are under
``stepwatch.``; each stage is a child span with its seconds and memory peak; the tracer carries stepwatch's
version as its instrumentation scope.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from stepwatch import __version__
from stepwatch.exporter.report import RequestReport

OPERATION = "generate_content"
PROVIDER = "diffusers"
SCOPE = "stepwatch.exporter"

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
    return provider.get_tracer(SCOPE, __version__)


class _LazyTracer:
    """Resolves the global provider when a span is due; None while it is a no-op."""

    def get(self) -> Any:
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.NoOpTracerProvider):
            return None
        if isinstance(provider, trace.ProxyTracerProvider):
            return None
        return provider.get_tracer(SCOPE, __version__)


def capture_parent() -> Any:
    return otel_context.get_current() if otel_context is not None else None


def model_name(pipe: Any) -> str:
    """The model a span names: the last part of the directory it was loaded from (never a server path),
    else the pipeline's class (a pipeline built in memory)."""
    config = getattr(pipe, "config", None)
    source = getattr(pipe, "name_or_path", None) or (config.get("_name_or_path") if isinstance(config, Mapping)
                                                      else None)
    if isinstance(source, str) and source.strip("/"):
        return PurePath(source.rstrip("/")).name
    return type(pipe).__name__


def request_attributes(model: str, params: Mapping[str, Any], video: bool) -> dict[str, Any]:
    """The GenAI request attributes of one call, read once when it begins (only with a tracer)."""
    attrs: dict[str, Any] = {"gen_ai.operation.name": OPERATION, "gen_ai.provider.name": PROVIDER,
                             "gen_ai.request.model": model, "gen_ai.output.type": "video" if video else "image"}
    generator = params.get("generator")
    if isinstance(generator, (list, tuple)) and generator:
        generator = generator[0]
    seed = getattr(generator, "initial_seed", None)
    if callable(seed):
        attrs["gen_ai.request.seed"] = int(seed())
    count = params.get("num_videos_per_prompt" if video else "num_images_per_prompt")
    if isinstance(count, int) and count > 0:
        attrs["gen_ai.request.choice.count"] = count
    return attrs


def emit(tracer: Any, report: RequestReport, parent: Any, stage_bounds: dict[str, tuple[float, float]],
         step_bounds: list[tuple[float, float]], request_attrs: Mapping[str, Any] | None = None) -> None:
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

    attrs = dict(request_attrs or {"gen_ai.operation.name": OPERATION, "gen_ai.provider.name": PROVIDER})
    attrs.update(_stepwatch_attributes(report))
    name = f"{attrs['gen_ai.operation.name']} {attrs['gen_ai.request.model']}" \
        if "gen_ai.request.model" in attrs else str(attrs["gen_ai.operation.name"])
    root = tracer.start_span(name, context=parent, start_time=t0, attributes=attrs)
    ctx = trace.set_span_in_context(root)
    hit_steps = {s for s, _b, h in report.cache_decisions if h}
    for i, (a, b) in enumerate(step_bounds):
        root.add_event(
            "step",
            {"stepwatch.step.index": i, "stepwatch.step.seconds": b - a, "stepwatch.step.cache_hit": i in hit_steps},
            timestamp=ns(b),
        )
    for stage, (a, b) in stage_bounds.items():
        span = tracer.start_span(f"diffusion.{stage}", context=ctx, start_time=ns(a),
                                 attributes=_stage_attributes(report, stage, b - a))
        span.end(end_time=ns(b))
    if report.outcome not in ("ok", "cancelled"):
        _failed(root, report)
    root.end(end_time=ns(report.seconds))


def _stepwatch_attributes(report: RequestReport) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "stepwatch.shape": report.shape_label,
        "stepwatch.outcome": report.outcome,
        "stepwatch.steps": len(report.step_seconds),
        "stepwatch.cfg_branches": report.cfg_branches,
    }
    if report.step_flops is not None:
        attrs["stepwatch.ledger.step_flops"] = report.step_flops
    if report.mfu is not None:
        attrs["stepwatch.mfu"] = report.mfu
    if report.cache:
        attrs["stepwatch.cache"] = report.cache
    return attrs


def _stage_attributes(report: RequestReport, stage: str, seconds: float) -> dict[str, Any]:
    attrs: dict[str, Any] = {"stepwatch.stage": stage, "stepwatch.stage.seconds": seconds}
    peak = report.memory_peak_bytes.get(stage)
    if peak:
        attrs["stepwatch.memory.peak_bytes"] = peak
    if stage == "denoise":
        attrs["stepwatch.steps"] = len(report.step_seconds)
    return attrs


def _failed(root: Any, report: RequestReport) -> None:
    """``error.type`` and an ``exception`` event from the failure the report kept ("Type: message")."""
    text = report.error or report.outcome
    error_type, _, message = text.partition(": ")
    if report.outcome == "oom" and not message:
        error_type = "out_of_memory"
    root.set_attribute("error.type", error_type)
    root.add_event("exception", {"exception.type": error_type, "exception.message": message or text})
    root.set_status(trace.Status(trace.StatusCode.ERROR, text))
