"""What one pipeline call measured, once device timings are resolved."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from stepwatch.exporter.shapes import ShapeKey


@dataclass
class CompileEvent:
    start: float  # host perf_counter
    seconds: float
    phase: str  # warmup | serving


@dataclass
class RequestReport:
    shape: ShapeKey | None
    shape_label: str
    outcome: str  # ok | error | oom | cancelled
    seconds: float
    stages: dict[str, float]  # text_encode, denoise, vae_decode
    step_seconds: list[float]
    cfg_branches: int
    cache: str | None
    # (step index, branch name, hit) for every transformer call a cache decided on
    cache_decisions: list[tuple[int, str, bool]]
    compiles: list[CompileEvent]
    memory_peak_bytes: dict[str, int]  # per stage and "request"
    memory_capacity_bytes: int
    device: str
    step_flops: float | None
    mfu: float | None
    failed_stage: str | None = None
    error: str | None = None
    start_unix: float = 0.0
    stream: Any = None  # chunks.StreamReport of a chunked autoregressive video call
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hits(self) -> int:
        return sum(1 for _, _, h in self.cache_decisions if h)

    @property
    def misses(self) -> int:
        return sum(1 for _, _, h in self.cache_decisions if not h)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = str(self.shape) if self.shape else None
        return d
