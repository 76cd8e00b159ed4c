"""Stall detection: a generation far past its prediction means a hung worker.

The worker runs one generation at a time, and the queue predicts each one's seconds at
admission (``Ticket.predicted``).  A worker frozen by a signal, stuck in a collective
that another rank never enters, or spinning in a deadlock answers nothing: its own
metrics may be gone with it, and its process is still alive to a liveness check.  So the
HTTP process, which stays alive, measures it: seconds on the generation in flight
against ``threshold`` x its prediction, never below ``min_seconds`` (both from
``alerts.worker_stalled`` in stepwatch/thresholds.yaml, the alert's own numbers, of the
profile the service is configured with).  Past
that limit the worker is stalled (``/readyz`` 503, StepwatchWorkerStalled); past twice
the limit the service restarts it, failing the request with a 504 that says so.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from stepwatch.thresholds import Thresholds, load, stall_floor


@dataclass(frozen=True)
class StallPolicy:
    factor: float
    min_seconds: float

    @classmethod
    def from_thresholds(cls, th: Thresholds | None = None, profile: str = "production") -> StallPolicy:
        spec = (th or load()).alert("worker_stalled")
        return cls(spec.threshold, stall_floor(spec, profile))

    def limit(self, expected_seconds: float) -> float:
        """Seconds after which a generation predicted to take ``expected_seconds`` is stalled."""
        return max(self.min_seconds, self.factor * max(0.0, expected_seconds))


@dataclass(frozen=True)
class Busy:
    pool: str
    seconds: float
    expected_seconds: float


class InFlight:
    """The generation the worker is on: its pool, since when, and its predicted seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._current: tuple[str, float, float] | None = None

    def start(self, pool: str, expected_seconds: float) -> None:
        with self._lock:
            self._current = (pool, self._clock(), expected_seconds)

    def finish(self) -> None:
        with self._lock:
            self._current = None

    def busy(self) -> Busy | None:
        with self._lock:
            current = self._current
        if current is None:
            return None
        pool, started, expected = current
        return Busy(pool, self._clock() - started, expected)


def stalled_seconds(busy: Busy | None, policy: StallPolicy) -> float:
    """Seconds on the generation in flight when past the stall limit, else 0."""
    if busy is None or busy.seconds <= policy.limit(busy.expected_seconds):
        return 0.0
    return busy.seconds


def restart_due(busy: Busy | None, policy: StallPolicy) -> bool:
    """Past twice the stall limit: the alert has had its chance; restart the worker."""
    return busy is not None and busy.seconds > 2 * policy.limit(busy.expected_seconds)
