"""How to instrument a pipeline (InstrumentOptions), and the guard that keeps hook errors out of it.

Hook bodies never raise into the pipeline: the ``Guard`` counts each error in
``stepwatch_exporter_errors_total`` and logs it once per component.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from stepwatch.exporter import chunks
from stepwatch.exporter.clock import Clock
from stepwatch.exporter.memory import MemoryProbe
from stepwatch.exporter.report import RequestReport
from stepwatch.exporter.shapes import ShapeLabeler
from stepwatch.metrics import ExporterMetrics

log = logging.getLogger("stepwatch.exporter")


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


class Guard:
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


class InstrumentationState:
    """What an Instrumentation holds, declared once for the parts it is made of (its request lifecycle and its
    streaming sessions), which read it."""

    pipe: Any
    options: InstrumentOptions
    metrics: ExporterMetrics
    _guard: Guard
    clock: Clock
    memory: MemoryProbe
    labeler: ShapeLabeler
    phase: str
    _local: threading.local
    _chunks: chunks.ChunkModel | None
    _stream: chunks.StreamPublisher | None
    _guarded: Callable[..., None]
