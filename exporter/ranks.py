"""Per-rank step times and rank skew for sequence-parallel (context-parallel) pipelines.

With Ulysses or ring attention every step waits for the slowest rank, so every
rank's wall-clock step time is the straggler's: wall time cannot name the
slow rank.  What differs is how long each rank *works* per step versus how
long it sits in collectives waiting for the others.  The reporter times the
collective waits of diffusers' context-parallel attention
(``attention_dispatch._wait_tensor``) and, once per request, gathers each
rank's busy time per step (step wall time minus collective wait) with one
small ``all_gather_object`` - never one per step.  Rank 0 publishes
``stepwatch_rank_step_duration_seconds{rank}`` and
``stepwatch_rank_skew_ratio`` = (max - min) / min for the request, and the
counters ``stepwatch_rank_busy_seconds_total`` / ``stepwatch_rank_steps_total``
that rules average over a window (a single request's skew is noisy when steps
take milliseconds).

On CPU (gloo) collectives block the host, so host timing of the waits is
exact.  On CUDA (NCCL) the wait is on the device stream; host timing then
under-counts it and the skew reads low (documented limitation).
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from typing import Any

_TARGET = ("diffusers.models.attention_dispatch", "_wait_tensor")


class RankReporter:
    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist  # lazy: importing stepwatch.exporter must not import torch

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self._wait = 0.0
        self._lock = threading.Lock()
        self._orig: Callable[..., Any] | None = None
        self.last: list[float] = []
        self.install()

    def install(self) -> None:
        mod = importlib.import_module(_TARGET[0])  # by name, when a reporter is made: diffusers is heavy
        current = getattr(mod, _TARGET[1])
        if getattr(current, "_stepwatch_rank_reporter", None) is not None:
            return
        orig = current
        reporter = self

        def timed_wait(tensor: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(tensor)
            finally:
                reporter._add_wait(time.perf_counter() - t0)

        timed_wait._stepwatch_rank_reporter = self  # type: ignore[attr-defined]
        self._orig = orig
        setattr(mod, _TARGET[1], timed_wait)

    def uninstall(self) -> None:
        if self._orig is None:
            return
        mod = importlib.import_module(_TARGET[0])
        setattr(mod, _TARGET[1], self._orig)
        self._orig = None

    def _add_wait(self, seconds: float) -> None:
        with self._lock:
            self._wait += seconds

    def take_wait(self) -> float:
        with self._lock:
            w, self._wait = self._wait, 0.0
        return w

    def report(self, report: Any, metrics: Any) -> None:
        """Called once per request on every rank, in the same order (a collective)."""
        steps = len(report.step_seconds)
        wait = self.take_wait()
        busy = max(0.0, sum(report.step_seconds) - wait) / steps if steps else 0.0
        values: list[Any] = [None] * self.world
        self._dist.all_gather_object(values, (busy, steps), group=self.group)
        self.last = [float(v[0]) for v in values]
        if self.rank != 0 or not steps:
            return
        publish_ranks(values, report, metrics)


def publish_ranks(values: list[tuple[float, int]], report: Any, metrics: Any) -> None:
    """Rank 0's part: every rank's (busy seconds per step, steps) of one request into the metrics and
    the report (the only rank that serves /metrics)."""
    for r, (b, n) in enumerate(values):
        metrics.rank_step_duration_seconds.labels(rank=str(r)).set(b)
        metrics.rank_busy_seconds_total.labels(rank=str(r)).inc(b * n)
        metrics.rank_steps_total.labels(rank=str(r)).inc(n)
    busy = [float(b) for b, _n in values]
    fastest = min(busy)
    skew = (max(busy) - fastest) / fastest if fastest > 0 else 0.0
    metrics.rank_skew_ratio.set(skew)
    report.extra["rank_step_seconds"] = busy
    report.extra["rank_skew"] = skew
