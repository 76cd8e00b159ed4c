"""Boundary marks that cost nothing on the host and never synchronize the device.

On CPU a mark is a perf_counter reading.  On CUDA it is an event recorded on
the current stream plus the host time; durations are resolved after the
request, once the events have completed (``ready``), so instrumentation adds
no synchronization to the pipeline.
"""

from __future__ import annotations

import time
from typing import Any, Protocol


class Clock(Protocol):
    device_kind: str

    def mark(self) -> Any: ...

    def seconds(self, a: Any, b: Any) -> float: ...

    def ready(self, m: Any) -> bool: ...

    def host(self, m: Any) -> float: ...


class HostClock:
    device_kind = "cpu"

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, a: float, b: float) -> float:
        return b - a

    def ready(self, m: float) -> bool:
        return True

    def host(self, m: float) -> float:
        return m


class CudaClock:
    device_kind = "cuda"

    def __init__(self) -> None:
        import torch

        self._event = torch.cuda.Event

    def mark(self) -> tuple[Any, float]:
        e = self._event(enable_timing=True)
        e.record()
        return (e, time.perf_counter())

    def seconds(self, a: tuple[Any, float], b: tuple[Any, float]) -> float:
        return float(a[0].elapsed_time(b[0])) / 1000.0

    def ready(self, m: tuple[Any, float]) -> bool:
        return bool(m[0].query())

    def host(self, m: tuple[Any, float]) -> float:
        return m[1]


def clock_for(device: Any) -> Clock:
    """A CUDA clock when the pipeline runs on a CUDA device, else host time."""
    if getattr(device, "type", str(device)) == "cuda":
        return CudaClock()
    return HostClock()
