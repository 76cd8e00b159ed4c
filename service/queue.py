"""Admission and queueing: per-pool queues, shortest-predicted-first with aging.

Duration is fixed at admission by (H, W, frames, steps, CFG) and the worker's
efficiency, so a request's GPU-seconds can be predicted before it runs: from
the observed median of its shape, else from the FLOPs ledger scaled by the
observed FLOP rate.  The worker takes the queued request with the smallest
``predicted - aging x waited``: short requests go first, and every waiting
request gains priority with time, so nothing starves.

A pool's estimated wait is what a new request of that pool would wait: the
in-flight remainder plus every queued request that would run before it (those
of its pool, and shorter ones of other pools); one worker serves them all.  Past
the pool's hard limit the request is refused with 429 and Retry-After.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from stepwatch.exporter.ledger import LedgerModel
from stepwatch.service.api import GenerationRequest
from stepwatch.service.config import PoolConfig


@dataclass(frozen=True)
class LedgerParams:
    """What the main process needs of the worker's ledger (``exporter.ledger`` imports no torch): the
    model, the VAE's compression and the text tokens, to predict a step's FLOPs from a request's size."""

    model: LedgerModel
    vae_scale: int
    text_tokens: int

    def step_flops(self, width: int, height: int, cfg: bool) -> float:
        n = self.model.tokens(height, width, None, self.vae_scale, 1)
        return self.model.forward_flops(n, self.text_tokens) * (2 if cfg else 1)


class Predictor:
    """Predicted seconds of a request on one worker."""

    def __init__(self, window: int = 20) -> None:
        self._by_shape: dict[tuple[str, int], deque[float]] = {}
        self._denoise_rate: deque[float] = deque(maxlen=50)  # FLOP/s in denoising
        self._other_rate: deque[float] = deque(maxlen=50)  # seconds per megapixel outside denoising
        self._video_rate: deque[float] = deque(maxlen=50)  # seconds per video work unit (see _video_units)
        self._window = window
        self.ledger: LedgerParams | None = None
        self._lock = threading.Lock()

    def observe(self, req: GenerationRequest, seconds: float, stages: dict[str, float]) -> None:
        with self._lock:
            q = self._by_shape.setdefault((req.shape, req.n), deque(maxlen=self._window))
            q.append(seconds)
            denoise = stages.get("denoise")
            if self.ledger is not None and denoise and denoise > 0 and not req.is_video:
                flops = self.ledger.step_flops(req.width, req.height, req.cfg) * req.steps * req.n
                self._denoise_rate.append(flops / denoise)
            if req.is_video:
                self._video_rate.append(seconds / _video_units(req))
                return
            mpix = req.width * req.height * req.n / 1e6
            self._other_rate.append(max(0.0, seconds - (denoise or 0.0)) / mpix)

    def predict(self, req: GenerationRequest) -> float:
        with self._lock:
            q = self._by_shape.get((req.shape, req.n))
            if q and len(q) >= 3:
                return statistics.median(q)
            if req.is_video and self._video_rate:
                return statistics.median(self._video_rate) * _video_units(req)
            mpix = req.width * req.height * req.n * req.frames / 1e6
            other = statistics.median(self._other_rate) * mpix if self._other_rate else 0.5 * mpix
            if self.ledger is not None and self._denoise_rate and not req.is_video:
                flops = self.ledger.step_flops(req.width, req.height, req.cfg) * req.steps * req.n
                return flops / statistics.median(self._denoise_rate) + other
            if q:
                return statistics.median(q)
            return other + 0.05 * req.steps * (2 if req.cfg else 1) * mpix


def _video_units(req: GenerationRequest) -> float:
    """A video's work in units its observed seconds scale by, for a shape not seen three times yet: pixels x
    frames x (transformer calls + 2: the decode and the encoding cost about two calls' worth on the practice
    model).  An estimate for the queue and the stall limit; each shape's own median replaces it."""
    calls = req.steps * (2 if req.cfg else 1)
    return req.width * req.height * req.frames / 1e6 * (calls + 2)


@dataclass
class Ticket:
    request: GenerationRequest
    pool: str
    predicted: float
    enqueued: float
    future: Future[Any] = field(default_factory=Future)
    started: float | None = None
    seq: int = field(default_factory=itertools.count().__next__)
    on_start: Callable[[], None] | None = None  # called when the worker takes it (a video job turns running)
    call_id: str = ""  # the id of its worker call ("": one is made up); a video job's progress carries it


class QueueFull(Exception):
    def __init__(self, pool: str, estimated_wait: float, limit: float, retry_after: int) -> None:
        super().__init__(f"pool {pool}: estimated wait {estimated_wait:.1f}s is past its limit {limit:.0f}s")
        self.pool = pool
        self.estimated_wait = estimated_wait
        self.limit = limit
        self.retry_after = retry_after


class Scheduler:
    """Per-pool queues feeding one worker; thread-safe."""

    def __init__(self, pools: list[PoolConfig], predictor: Predictor, policy: str = "spf", aging: float = 1.0,
                 max_queued: int = 256, clock: Callable[[], float] = time.monotonic) -> None:
        self.pools = {p.name: p for p in pools}
        self.predictor = predictor
        self.policy = policy
        self.aging = aging
        self.max_queued = max_queued
        self._clock = clock
        self._queues: dict[str, list[Ticket]] = {p: [] for p in self.pools}
        self._inflight: Ticket | None = None
        self._cv = threading.Condition()

    # ----- admission ----------------------------------------------------------------------
    def submit(self, req: GenerationRequest, pool: str, on_start: Callable[[], None] | None = None,
               call_id: str = "") -> Ticket:
        """Queue a request, or raise QueueFull (-> 429) when its pool's wait is past the limit."""
        predicted = self.predictor.predict(req)
        with self._cv:
            limit = self.pools[pool].max_wait_seconds
            wait = self._estimated_wait_locked(pool, predicted)
            queued = sum(len(q) for q in self._queues.values())
            if wait > limit or queued >= self.max_queued:
                retry = max(1, int(wait - limit + 0.999)) if wait > limit else 5
                raise QueueFull(pool, wait, limit, retry)
            t = Ticket(req, pool, predicted, self._clock(), on_start=on_start, call_id=call_id)
            self._queues[pool].append(t)
            self._cv.notify_all()
            return t

    def take(self, timeout: float | None = None) -> Ticket | None:
        """The next ticket to run (blocks until one is queued); marks it in flight."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._cv:
            while True:
                t = self._pick_locked()
                if t is not None:
                    self._queues[t.pool].remove(t)
                    t.started = self._clock()
                    self._inflight = t
                    return t
                remaining = None if deadline is None else deadline - self._clock()
                if remaining is not None and remaining <= 0:
                    return None
                self._cv.wait(remaining if remaining is not None else 1.0)

    def done(self, t: Ticket) -> None:
        with self._cv:
            if self._inflight is t:
                self._inflight = None
            self._cv.notify_all()

    def remove(self, t: Ticket) -> bool:
        """Take a still-queued ticket out of its queue (its client gave up); False if it is not queued."""
        with self._cv:
            q = self._queues.get(t.pool, [])
            for i, queued in enumerate(q):
                if queued is t:
                    del q[i]
                    self._cv.notify_all()
                    return True
            return False

    def drain(self) -> list[Ticket]:
        """Remove and return everything queued (shutdown)."""
        with self._cv:
            out = [t for q in self._queues.values() for t in q]
            for q in self._queues.values():
                q.clear()
            return out

    def _pick_locked(self) -> Ticket | None:
        now = self._clock()
        best: Ticket | None = None
        best_key = (0.0, 0)
        for q in self._queues.values():
            for t in q:
                prio = t.enqueued if self.policy == "fifo" else t.predicted - self.aging * (now - t.enqueued)
                key = (prio, t.seq)
                if best is None or key < best_key:
                    best, best_key = t, key
        return best

    # ----- estimates --------------------------------------------------------------------
    def _inflight_remaining_locked(self) -> float:
        t = self._inflight
        if t is None or t.started is None:
            return 0.0
        return max(0.0, t.predicted - (self._clock() - t.started))

    def _estimated_wait_locked(self, pool: str, predicted: float) -> float:
        ahead = self._inflight_remaining_locked()
        for name, q in self._queues.items():
            for t in q:
                if name == pool or t.predicted <= predicted or self.policy == "fifo":
                    ahead += t.predicted
        return ahead

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per pool: queue depth and the estimated wait a new request of the pool's typical size would see."""
        with self._cv:
            out = {}
            for name, q in self._queues.items():
                typical = statistics.median([t.predicted for t in q]) if q else 0.0
                out[name] = {"depth": float(len(q)), "estimated_wait": self._estimated_wait_locked(name, typical)}
            return out

