"""Per-rank timing for sequence-parallel (context-parallel) pipelines, with no collective of its own.

With Ulysses or ring attention every step waits for the slowest rank, so every rank's wall-clock
step time is the straggler's: wall time cannot name the slow rank.  Nor can "step time minus the
time spent waiting in collectives": a rank starved of CPU (another process beside it, a throttled
clock) also runs its own side of each transfer slowly, so its waits grow with it and its busy time
looks normal.  What does name it is *when each rank arrives* at each collective.

So each rank stamps, with the shared wall clock, its arrival at and its departure from every
collective of diffusers' context-parallel attention (``attention_dispatch._wait_tensor``): two
clock reads and one append per collective, nothing else on the hot path.  A background thread on
each rank ships its new stamps every ``interval`` seconds to rank 0 through the process group's
key-value store (``queue_push``: no collective, so no rank ever waits for the instrumentation, and
a stuck rank cannot stop the others from publishing).  Rank 0 aligns the collectives (the k-th of
request q is the same call on every rank) and charges each rank, per collective, the time from the
group's release by the previous collective (the earliest departure) to its own arrival: the fastest
rank's share is its compute, the straggler's adds every moment the others waited for it, whatever
made it late.  A rank starved of CPU, though, also runs its side of every transfer late: the ranks
then arrive together and wait together for it, and no arrival time shows who held them up.  So each
rank also ships how long its threads waited for a CPU (Linux schedstat: runnable, not running), and
that is charged to it too (``stepwatch_rank_cpu_wait_seconds_total`` on its own as well).  On a GPU
the same starvation delays the rank's kernel launches.  ``stepwatch_rank_busy_seconds_total{rank}``
grows every interval, during a request, not only at its end; the per-request gauges follow when all
ranks have finished a request.

The same stamps give the stall signals: per rank, seconds since it last left a collective while it
runs a request (``stepwatch_rank_progress_age_seconds``) and seconds inside its current collective
(``stepwatch_rank_collective_wait_seconds``).  One rank waiting in a collective while another's
progress age grows outside any is a collective hang, and the latter is the rank to look at.

On CPU (gloo) a rank blocks in the wait, so the stamps are exact.  On CUDA (NCCL) the wait is
enqueued on the stream: the same design takes the stamps from CUDA events recorded around the
collective and resolved later (README, "GPU check"); host stamps there read late arrivals
as early.  Ranks on different hosts compare wall clocks, which NTP/PTP keeps within a millisecond
or so on a GPU cluster; the stamps of one host are exact.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger("stepwatch.exporter.ranks")

_TARGET = ("diffusers.models.attention_dispatch", "_wait_tensor")
INTERVAL_S = 1.0
STALE_REQUEST_S = 120.0  # a request some rank never finishes is dropped from alignment after this
STALE_HEARTBEAT_S = 5 * INTERVAL_S  # a rank silent this long is not shipping: frozen or stuck


class Timeline:
    """One rank's stamps: the hot path appends ``(arrival, departure)`` per collective to ``marks``."""

    def __init__(self, clock: Callable[[], float] = time.time,
                 cpu_wait: Callable[[], float | None] = lambda: None) -> None:
        self.clock, self.cpu_wait = clock, cpu_wait
        self._cpu_at_begin: float | None = None
        self.request_cpu_wait: dict[int, float] = {}  # request -> its threads' waits for a CPU during it
        self.request = -1
        self.marks: list[tuple[float, float]] = []
        self.by_request: dict[int, list[tuple[float, float]]] = {}
        self.ended: dict[int, int | None] = {}  # request -> steps (None until the report says)
        self.in_since: float | None = None  # inside a collective since
        self.progress = clock()  # last departure from a collective, or the request's start
        self.inflight = False

    def begin(self) -> int:
        self.request += 1
        self.marks = self.by_request[self.request] = []
        self.progress = self.clock()
        self.inflight = True
        self._cpu_at_begin = self.cpu_wait()  # once per request: a few /proc reads
        return self.request

    def end(self) -> None:
        self.inflight = False
        self.ended.setdefault(self.request, None)
        now, then = self.cpu_wait(), self._cpu_at_begin
        if now is not None and then is not None:
            self.request_cpu_wait[self.request] = max(0.0, now - then)

    def steps(self, request: int, steps: int) -> None:
        self.ended[request] = steps


@dataclass
class Chunk:
    """What one rank ships per interval: new stamps per request, finished requests, its heartbeat."""

    rank: int
    sent: float
    marks: dict[int, tuple[int, array[float]]] = field(default_factory=dict)  # request -> (first index, flat)
    ended: dict[int, int] = field(default_factory=dict)  # request -> steps
    ended_cpu_wait: dict[int, float] = field(default_factory=dict)  # request -> CPU waits during it
    in_since: float | None = None
    progress: float = 0.0
    inflight: bool = False
    request: int = -1  # the request the rank is on (or last ran)
    cpu_wait: float | None = None  # cumulative seconds its threads waited for a CPU (None: not on Linux)


def runqueue_wait_seconds() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU (Linux schedstat), or None.

    A rank starved of CPU (another process on its CPUs, a throttled host) runs its side of every transfer
    late: the ranks then arrive together and wait together, and only this shows who held them up."""
    total = 0
    try:
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/schedstat") as f:
                    total += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # a thread that just ended
    except OSError:
        return None
    return total / 1e9


class Shipper:
    """Cuts a rank's timeline into chunks, each stamp once; a request leaves when it is shipped whole."""

    def __init__(self, timeline: Timeline, rank: int) -> None:
        self.tl, self.rank = timeline, rank
        self._sent: dict[int, int] = {}

    def cut(self) -> Chunk:
        tl = self.tl
        c = Chunk(self.rank, tl.clock(), in_since=tl.in_since, progress=tl.progress, inflight=tl.inflight,
                  request=tl.request, cpu_wait=tl.cpu_wait())
        for q, marks in list(tl.by_request.items()):
            steps = tl.ended.get(q)  # first: once the steps are known no stamp can follow, so n is final
            start, n = self._sent.get(q, 0), len(marks)  # appends only grow the list: a stable prefix
            if n > start:
                c.marks[q] = (start, array("d", [t for pair in marks[start:n] for t in pair]))
                self._sent[q] = n
            if steps is not None:
                c.ended[q] = steps
                c.ended_cpu_wait[q] = tl.request_cpu_wait.pop(q, 0.0)
                del tl.by_request[q], tl.ended[q], self._sent[q]
        return c


class Channel(Protocol):
    def send(self, chunk: Chunk) -> None: ...

    def receive(self) -> list[Chunk]: ...


class StoreChannel:
    """Followers push pickled chunks onto a queue per rank in the process group's store; rank 0 pops them.

    The store is the rendezvous TCPStore every process group already has: no extra port, no collective.
    """

    def __init__(self, store: Any, world: int, prefix: str = "stepwatch/ranks") -> None:
        self.store, self.world, self.prefix = store, world, prefix

    def send(self, chunk: Chunk) -> None:
        self.store.queue_push(f"{self.prefix}/{chunk.rank}", pickle.dumps(chunk, protocol=5))

    def receive(self) -> list[Chunk]:
        out: list[Chunk] = []
        for r in range(1, self.world):
            key = f"{self.prefix}/{r}"
            for _ in range(int(self.store.queue_len(key))):
                out.append(pickle.loads(self.store.queue_pop(key, False)))  # our own ranks' chunks
        return out


@dataclass
class _Request:
    marks: dict[int, list[float]] = field(default_factory=dict)  # rank -> flat (arrival, departure)...
    steps: dict[int, int] = field(default_factory=dict)
    busy: dict[int, float] = field(default_factory=dict)
    done: int = 1  # collectives charged so far; the first has no previous release to count from
    first_seen: float = 0.0
    broken: bool = False


class Aligner:
    """Rank 0: merges every rank's chunks, charges busy time per aligned collective, finishes requests."""

    def __init__(self, world: int, clock: Callable[[], float] = time.time) -> None:
        self.world, self.clock = world, clock
        self.requests: dict[int, _Request] = {}
        self.heartbeats: dict[int, Chunk] = {}
        self.last: list[float] = []  # busy seconds per step of each rank, last finished request
        self.last_skew: float | None = None
        self.cpu_wait: dict[int, float] = {}  # per rank, waited for a CPU since the last take

    def add(self, c: Chunk) -> None:
        prev = self.heartbeats.get(c.rank)
        self.heartbeats[c.rank] = c
        for q, (start, flat) in c.marks.items():
            req = self.requests.setdefault(q, _Request(first_seen=self.clock()))
            have = req.marks.setdefault(c.rank, [])
            if start != len(have) // 2:
                req.broken = True  # a lost chunk: this request can no longer be aligned
            have.extend(flat)
        for q, steps in c.ended.items():
            req = self.requests.setdefault(q, _Request(first_seen=self.clock()))
            req.steps[c.rank] = steps
            req.busy[c.rank] = req.busy.get(c.rank, 0.0) + c.ended_cpu_wait.get(q, 0.0)
        if prev is not None and prev.cpu_wait is not None and c.cpu_wait is not None and c.cpu_wait >= prev.cpu_wait:
            self.cpu_wait[c.rank] = self.cpu_wait.get(c.rank, 0.0) + c.cpu_wait - prev.cpu_wait

    def charge(self) -> dict[int, float]:
        """Busy seconds per rank newly charged from the collectives every rank has now stamped."""
        new = dict.fromkeys(range(self.world), 0.0)
        for req in self.requests.values():
            if req.broken or len(req.marks) < self.world:
                continue
            n = min(len(m) // 2 for m in req.marks.values())
            for k in range(req.done, n):
                released = min(m[2 * k - 1] for m in req.marks.values())
                for r, m in req.marks.items():
                    dt = max(0.0, m[2 * k] - released)
                    req.busy[r] = req.busy.get(r, 0.0) + dt
                    new[r] += dt
            req.done = max(req.done, n)
        return new

    def take_cpu_wait(self) -> dict[int, float]:
        out, self.cpu_wait = self.cpu_wait, {}
        return out

    def finished(self) -> list[tuple[int, _Request]]:
        """Requests every rank has finished and that are fully charged (or broken, or stale): removed."""
        out = []
        now = self.clock()
        for q, req in sorted(self.requests.items()):
            complete = len(req.steps) == self.world and all(len(m) // 2 == req.done for m in req.marks.values())
            if complete or req.broken or now - req.first_seen > STALE_REQUEST_S:
                out.append((q, req))
                del self.requests[q]
        return out

    def stall(self, rank: int) -> tuple[float, float]:
        """(seconds since the rank last made progress while running a request, seconds in its collective).

        A rank waiting in a collective keeps shipping heartbeats (the wait releases the GIL), so a silent
        rank is not known to wait: frozen inside a wait, it must not look like the rank waiting for it.
        A silent rank while another runs a request counts from its last heartbeat even if that said idle:
        it should be in the request too."""
        hb = self.heartbeats.get(rank)
        if hb is None:
            return 0.0, 0.0
        now = self.clock()
        silent = now - hb.sent > STALE_HEARTBEAT_S
        others_busy = any(h.inflight for r, h in self.heartbeats.items() if r != rank)
        if hb.inflight:
            age = now - hb.progress
        elif others_busy and silent:
            age = now - hb.sent
        else:
            age = 0.0
        return age, now - hb.in_since if hb.in_since is not None and not silent else 0.0


class PerRequestReporter:
    """The rank-reporter interface for stand-ins that publish once per request from ``report`` alone (the
    exposition bench's fake ranks, the bench's pre-issue-18 reporter): no timeline to begin or end."""

    metrics: Any = None

    def bind(self, metrics: Any) -> None:
        self.metrics = metrics

    def begin_request(self) -> int:
        return 0

    def end_request(self) -> None:
        pass


def stamping(orig: Callable[[Any], Any], tl: Timeline) -> Callable[[Any], Any]:
    """``orig`` (a collective's wait) with the rank's arrival and departure stamped: the whole hot path."""
    clock = tl.clock

    def stamped_wait(tensor: Any) -> Any:
        t0 = tl.in_since = clock()
        try:
            return orig(tensor)
        finally:
            t1 = tl.progress = clock()
            tl.in_since = None
            tl.marks.append((t0, t1))

    return stamped_wait


class RankReporter:
    """Installs the stamps on this rank and runs its shipping thread (rank 0: the aligning one).

    ``instrument(..., rank_reporter=RankReporter())`` on every rank; only rank 0's metrics are served.
    ``channel`` defaults to the process group's store; tests pass their own, and ``hook=False`` to feed
    the timeline themselves, and ``interval=None`` to call ``tick()`` themselves instead of a thread.
    ``uninstall()`` restores diffusers (``install()`` again re-stamps); ``close()`` also stops the thread.
    """

    def __init__(self, group: Any = None, channel: Channel | None = None, interval: float | None = INTERVAL_S,
                 clock: Callable[[], float] = time.time, rank: int | None = None, world: int | None = None,
                 hook: bool = True, cpu_wait: Callable[[], float | None] = runqueue_wait_seconds) -> None:
        self.rank, self.world = _rank_and_world(group, rank, world)
        self.timeline = Timeline(clock, cpu_wait)
        self.channel = channel if channel is not None or self.world == 1 else _store_channel(self.world)
        self._shipper = Shipper(self.timeline, self.rank)
        self.aligner = Aligner(self.world, clock) if self.rank == 0 else None
        self.metrics: Any = None
        self._orig: Callable[..., Any] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._failed = False
        if hook:
            self.install()
        if interval is not None:
            threading.Thread(target=self._loop, args=(interval,), name="stepwatch-ranks", daemon=True).start()

    @property
    def last(self) -> list[float]:
        return self.aligner.last if self.aligner is not None else []

    # ----- hooks ---------------------------------------------------------------------------
    def install(self) -> None:
        mod = importlib.import_module(_TARGET[0])  # by name, when a reporter is made: diffusers is heavy
        current = getattr(mod, _TARGET[1])
        if getattr(current, "_stepwatch_rank_reporter", None) is not None:
            return
        stamped_wait = stamping(current, self.timeline)
        stamped_wait._stepwatch_rank_reporter = self  # type: ignore[attr-defined]
        self._orig = current
        setattr(mod, _TARGET[1], stamped_wait)

    def uninstall(self) -> None:
        if self._orig is None:
            return
        mod = importlib.import_module(_TARGET[0])
        setattr(mod, _TARGET[1], self._orig)
        self._orig = None

    def close(self) -> None:
        self._stop.set()
        self.uninstall()

    def bind(self, metrics: Any) -> None:
        """Rank 0 publishes into ``metrics`` (the exporter's MetricSet)."""
        self.metrics = metrics

    def begin_request(self) -> int:
        """A request starts on this rank: its index, the same on every rank (they run the same requests)."""
        return self.timeline.begin()

    def end_request(self) -> None:
        self.timeline.end()

    def report(self, report: Any, request: int) -> None:
        """Once per request, after it resolved (0 steps when it could not be): its steps, and on rank 0
        the ranks of the last request every rank has finished (usually the one before: no rank waits)."""
        self.timeline.steps(request, len(report.step_seconds))
        if self.aligner is not None and self.aligner.last:
            report.extra["rank_step_seconds"] = list(self.aligner.last)
            report.extra["rank_skew"] = self.aligner.last_skew

    # ----- the shipping thread -------------------------------------------------------------
    def _loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.tick()

    def tick(self) -> None:
        """Ship this rank's new stamps (rank 0: align and publish everyone's).  Never raises."""
        try:
            with self._lock:
                chunk = self._shipper.cut()
                if self.aligner is None:
                    if self.channel is not None:
                        self.channel.send(chunk)
                    return
                self.aligner.add(chunk)
                for c in self.channel.receive() if self.channel is not None else []:
                    self.aligner.add(c)
                self._publish()
        except Exception:
            if not self._failed:
                log.exception("rank %d: shipping rank timings failed (logged once; retried every tick)",
                              self.rank)
            self._failed = True

    def _publish(self) -> None:
        assert self.aligner is not None
        m = self.metrics
        charged = self.aligner.charge()
        starved = self.aligner.take_cpu_wait()
        finished = self.aligner.finished()
        if m is None:
            return
        for r in range(self.world):
            waited = starved.get(r, 0.0)
            m.rank_busy_seconds_total.labels(rank=str(r)).inc(charged.get(r, 0.0) + waited)
            m.rank_cpu_wait_seconds_total.labels(rank=str(r)).inc(waited)
        for _q, req in finished:
            finish_request(self.aligner, req, m)
        for r in range(self.world):
            age, waiting = self.aligner.stall(r)
            m.rank_progress_age_seconds.labels(rank=str(r)).set(age)
            m.rank_collective_wait_seconds.labels(rank=str(r)).set(waiting)


def finish_request(aligner: Aligner, req: _Request, metrics: Any) -> None:
    """A request every rank finished: its steps into the counters, its per-step busy time into the gauges."""
    for r, steps in req.steps.items():
        metrics.rank_steps_total.labels(rank=str(r)).inc(steps)
    steps = max(req.steps.values(), default=0)
    if req.broken or not steps or len(req.busy) < aligner.world:
        return
    per_step = [req.busy[r] / steps for r in range(aligner.world)]
    publish_ranks(per_step, metrics)
    aligner.last = per_step
    aligner.last_skew = skew(per_step)


def skew(per_step: list[float]) -> float:
    fastest = min(per_step)
    return (max(per_step) - fastest) / fastest if fastest > 0 else 0.0


def publish_ranks(per_step: list[float], metrics: Any) -> None:
    """The per-request gauges: each rank's busy seconds per step, and the skew between the ranks."""
    for r, b in enumerate(per_step):
        metrics.rank_step_duration_seconds.labels(rank=str(r)).set(b)
    metrics.rank_skew_ratio.set(skew(per_step))


def _rank_and_world(group: Any, rank: int | None, world: int | None) -> tuple[int, int]:
    if rank is not None and world is not None:
        return rank, world
    import torch.distributed as dist  # lazy: importing stepwatch.exporter must not import torch

    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _store_channel(world: int) -> StoreChannel:
    import torch.distributed as dist

    return StoreChannel(dist.distributed_c10d._get_default_store(), world)
