"""Boundary marks that cost nothing on the host and never synchronize the device.

On CPU a mark is a perf_counter reading.  On CUDA it is an event recorded on
the current stream; durations are resolved after the
request, once the events have completed (``ready``), so instrumentation adds
no synchronization to the pipeline.
"""

from __future__ import annotations

import time
from typing import Any, Protocol


class Clock(Protocol):
    def mark(self) -> Any: ...

    def seconds(self, a: Any, b: Any) -> float: ...

    def offsets(self, start: Any, marks: list[Any]) -> list[float]:
        """``seconds(start, m)`` for every mark: a request's step ends, resolved in one call."""

    def ready(self, m: Any) -> bool: ...

    def wait(self, m: Any) -> None:
        """Block until the mark has completed (only where the host waits anyway)."""


class HostClock:
    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, a: float, b: float) -> float:
        return b - a

    def offsets(self, start: float, marks: list[float]) -> list[float]:
        return [m - start for m in marks]

    def ready(self, m: float) -> bool:
        return True

    def wait(self, m: float) -> None:
        pass


class CudaClock:
    def __init__(self) -> None:
        import torch  # lazy: importing stepwatch.exporter must not import torch (sidecar, rules tools)

        self._event = torch.cuda.Event

    def mark(self) -> Any:
        e = self._event(enable_timing=True)
        e.record()
        return e

    def seconds(self, a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) / 1000.0

    def offsets(self, start: Any, marks: list[Any]) -> list[float]:
        elapsed = start.elapsed_time
        return [float(elapsed(m)) / 1000.0 for m in marks]

    def ready(self, m: Any) -> bool:
        return bool(m.query())

    def wait(self, m: Any) -> None:
        m.synchronize()


def clock_for(device: Any) -> Clock:
    """A CUDA clock when the pipeline runs on a CUDA device, else host time."""
    if getattr(device, "type", str(device)) == "cuda":
        return CudaClock()
    return HostClock()
