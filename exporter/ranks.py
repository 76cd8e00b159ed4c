"""Per-rank timing for sequence-parallel (context-parallel) pipelines, with no collective of its own.

With Ulysses or ring attention every step waits for the slowest rank, so every rank's wall-clock
step time is the straggler's: wall time cannot name the slow rank.  Nor can "step time minus the
time spent waiting in collectives": a rank starved of CPU (another process beside it, a throttled
clock) also runs its own side of each transfer slowly, so its waits grow with it and its busy time
looks normal.  What does name it is *when each rank arrives* at each collective.

So each rank stamps, with the shared wall clock, its arrival at and its departure from every
collective of diffusers' context parallelism: the attention's (``attention_dispatch._wait_tensor``),
the output's all-gather at the end of each transformer call (``EquipartitionSharder.unshard``), and
any the host marks with ``RankReporter.stamp`` (the practice service: its cache's agreement
all-reduce, rank 0's broadcast of each request).  Two clock reads and one append per collective,
nothing else on the hot path.  A collective left unstamped is invisible to the stall signals: a rank
waiting in it looks like a rank stuck in its own code (the two-rank stall drill in CI named a hung
worker twice, rank 0 waiting for a frozen rank 1 in one of these while its stamped wait read 0).  A background thread on
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

Requests are matched across ranks by their index on each rank's timeline: every rank of a
sequence-parallel group runs the same requests (a rank that skipped one would hang the group's
collectives), and the instrumentation begins and ends a request before anything of its own can fail.
Each rank also ships when it began a request; a rank that began its request after another already
left the request's first collective is counting a different request, and that request is dropped.

On CPU (gloo) a rank blocks in the wait, so the stamps are exact.  On CUDA (NCCL) the wait is
enqueued on the stream, so host stamps read late arrivals as early.  Not implemented yet: taking
the stamps from CUDA events recorded around the collective and resolved later (the design is in the
README, "GPU check").  Ranks on different hosts compare wall clocks, which NTP/PTP keeps within a millisecond
or so on a GPU cluster; the stamps of one host are exact.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from stepwatch.exporter.cpu import ThreadTotals
from stepwatch.metrics import ExporterMetrics

log = logging.getLogger("stepwatch.exporter.ranks")

_TARGET = ("diffusers.models.attention_dispatch", "_wait_tensor")
# The other collective of every transformer call: the output's all-gather (funcol, waited on lazily when the
# tensor is used, so not through _wait_tensor).  Stamped by waiting for it through the stamped wait.
_GATHER = ("diffusers.hooks.context_parallel", "EquipartitionSharder", "unshard")
INTERVAL_S = 1.0
STALE_REQUEST_S = 120.0  # a request no rank has shipped anything of for this long is dropped from alignment
STALE_HEARTBEAT_S = 5 * INTERVAL_S  # a rank silent this long is not shipping: frozen or stuck
BEGIN_TOLERANCE_S = 0.02  # clocks of ranks on different hosts differ by about a millisecond
MAX_QUEUED_CHUNKS = 120  # a follower stops pushing while this many wait for rank 0 (two minutes' worth)
RETIRED_KEPT = 1024  # finished request indices remembered, so a late chunk of one is not a new request


class _Discard(list[tuple[float, float]]):
    """Where stamps go between requests (a warm-up outside the pipeline's call, another model): nowhere."""

    def append(self, _item: object) -> None:
        pass


_DISCARD: list[tuple[float, float]] = _Discard()


class Timeline:
    """One rank's stamps: the hot path appends ``(arrival, departure)`` per collective to ``marks``."""

    def __init__(self, clock: Callable[[], float] = time.time,
                 cpu_wait: Callable[[], float | None] = lambda: None) -> None:
        self.clock, self.cpu_wait = clock, cpu_wait
        self._cpu_at_begin: float | None = None
        self.request_cpu_wait: dict[int, float] = {}  # request -> its threads' waits for a CPU during it
        self.request = -1
        self.marks: list[tuple[float, float]] = _DISCARD
        self.by_request: dict[int, list[tuple[float, float]]] = {}
        self.began: dict[int, float] = {}  # request -> when this rank began it (until shipped)
        self.ended: dict[int, int | None] = {}  # request -> steps (None until the report says)
        self.in_since: float | None = None  # inside a collective since
        self.progress = clock()  # last departure from a collective, or the request's start
        self.inflight = False

    def begin(self) -> int:
        if self.inflight:  # the previous request never ended (its end failed): no report will come for it
            self.end()
            self.ended[self.request] = 0
        self.request += 1
        self.marks = self.by_request[self.request] = []
        self.progress = self.began[self.request] = self.clock()
        self.inflight = True
        self._cpu_at_begin = self.cpu_wait()  # once per request: a few /proc reads
        return self.request

    def end(self) -> None:
        self.inflight = False
        self.marks = _DISCARD
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
    began: dict[int, float] = field(default_factory=dict)  # request -> when the rank began it
    in_since: float | None = None
    progress: float = 0.0
    inflight: bool = False
    request: int = -1  # the request the rank is on (or last ran)
    cpu_wait: float | None = None  # cumulative seconds its threads waited for a CPU (None: not on Linux)

    def encode(self) -> bytes:
        """JSON, not pickle: rank 0 reads what any process that can reach the store wrote."""
        d = {k: getattr(self, k) for k in ("rank", "sent", "ended", "ended_cpu_wait", "began", "in_since",
                                           "progress", "inflight", "request", "cpu_wait")}
        d["marks"] = {q: [start, flat.tolist()] for q, (start, flat) in self.marks.items()}
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Chunk:
        """The chunk ``encode`` wrote; ValueError (or TypeError) on anything else."""
        d = json.loads(data)
        return cls(int(d["rank"]), float(d["sent"]),
                   marks={int(q): (int(at), array("d", map(float, flat))) for q, (at, flat) in d["marks"].items()},
                   ended={int(q): int(v) for q, v in d["ended"].items()},
                   ended_cpu_wait={int(q): float(v) for q, v in d["ended_cpu_wait"].items()},
                   began={int(q): float(v) for q, v in d["began"].items()},
                   in_since=_float_or_none(d["in_since"]), progress=float(d["progress"]),
                   inflight=bool(d["inflight"]), request=int(d["request"]), cpu_wait=_float_or_none(d["cpu_wait"]))


def _float_or_none(v: Any) -> float | None:
    return None if v is None else float(v)


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
            if q in tl.began:
                c.began[q] = tl.began.pop(q)
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
    """Followers push encoded chunks onto a queue per rank in the process group's store; rank 0 pops them.

    The store is the rendezvous TCPStore every process group already has: no extra port, no collective.
    Keys carry the group's name, so reporters of two subgroups in one job do not read each other's chunks.
    A follower whose rank 0 stopped popping stops pushing at ``MAX_QUEUED_CHUNKS`` (the requests it
    misses are dropped by rank 0 as broken): the store does not grow without bound.
    """

    def __init__(self, store: Any, world: int, prefix: str = "stepwatch/ranks") -> None:
        self.store, self.world, self.prefix = store, world, prefix
        self.dropped = self.undecodable = 0

    def send(self, chunk: Chunk) -> None:
        key = f"{self.prefix}/{chunk.rank}"
        if int(self.store.queue_len(key)) >= MAX_QUEUED_CHUNKS:
            self.dropped += 1
            return
        self.store.queue_push(key, chunk.encode())

    def receive(self) -> list[Chunk]:
        out: list[Chunk] = []
        for r in range(1, self.world):
            key = f"{self.prefix}/{r}"
            for _ in range(int(self.store.queue_len(key))):
                try:
                    out.append(Chunk.decode(self.store.queue_pop(key, False)))
                except (ValueError, TypeError, KeyError, AttributeError):
                    self.undecodable += 1  # not ours: the requests it carried will read as broken
        return out


@dataclass
class _Request:
    marks: dict[int, list[float]] = field(default_factory=dict)  # rank -> flat (arrival, departure)...
    steps: dict[int, int] = field(default_factory=dict)
    busy: dict[int, float] = field(default_factory=dict)
    done: int = 1  # collectives charged so far; the first has no previous release to count from
    last_seen: float = 0.0  # when a chunk last carried anything of it
    began: dict[int, float] = field(default_factory=dict)
    checked: bool = False  # the ranks agree it is the same request (see ``_same_request``)
    broken: bool = False


class Aligner:
    """Rank 0: merges every rank's chunks, charges busy time per aligned collective, finishes requests."""

    def __init__(self, world: int, clock: Callable[[], float] = time.time) -> None:
        self.world, self.clock = world, clock
        self.requests: dict[int, _Request] = {}
        self.retired: dict[int, None] = {}  # finished or dropped request indices, oldest first
        self.heartbeats: dict[int, Chunk] = {}
        self.last: tuple[int, list[float], float] | None = None  # (request, busy s per step per rank, skew)
        self.cpu_wait: dict[int, float] = {}  # per rank, waited for a CPU since the last take
        self.late = self.mismatched = 0  # chunks of retired requests; requests the ranks disagreed on

    def add(self, c: Chunk) -> None:
        prev = self.heartbeats.get(c.rank)
        self.heartbeats[c.rank] = c
        for q, (start, flat) in c.marks.items():
            req = self._request(q)
            if req is None:
                continue
            have = req.marks.setdefault(c.rank, [])
            if start != len(have) // 2:
                req.broken = True  # a lost chunk: this request can no longer be aligned
            have.extend(flat)
        for q, began in c.began.items():
            if (req := self._request(q)) is not None:
                req.began[c.rank] = began
        for q, steps in c.ended.items():
            if (req := self._request(q)) is not None:
                req.steps[c.rank] = steps
                req.busy[c.rank] = req.busy.get(c.rank, 0.0) + c.ended_cpu_wait.get(q, 0.0)
        if prev is not None and prev.cpu_wait is not None and c.cpu_wait is not None and c.cpu_wait >= prev.cpu_wait:
            self.cpu_wait[c.rank] = self.cpu_wait.get(c.rank, 0.0) + c.cpu_wait - prev.cpu_wait

    def _request(self, q: int) -> _Request | None:
        """Request q, made when first heard of and marked as seen now; None once it is retired."""
        if q in self.retired:
            self.late += 1
            return None
        req = self.requests.get(q)
        if req is None:
            req = self.requests[q] = _Request()
        req.last_seen = self.clock()
        return req

    def charge(self) -> dict[int, float]:
        """Busy seconds per rank newly charged from the collectives every rank has now stamped."""
        new = dict.fromkeys(range(self.world), 0.0)
        for req in self.requests.values():
            if req.broken or len(req.marks) < self.world:
                continue
            n = min(len(m) // 2 for m in req.marks.values())
            if n and not req.checked and not self._same_request(req):
                continue
            for k in range(req.done, n):
                released = min(m[2 * k - 1] for m in req.marks.values())
                for r, m in req.marks.items():
                    dt = max(0.0, m[2 * k] - released)
                    req.busy[r] = req.busy.get(r, 0.0) + dt
                    new[r] += dt
            req.done = max(req.done, n)
        return new

    def _same_request(self, req: _Request) -> bool:
        """Whether every rank began this request before any left its first collective (which needs them
        all): a rank that began after that is counting another request.  Such a request is broken."""
        if len(req.began) < self.world:
            return True  # a chunk of a rank that does not say (left to the start-index check)
        first_release = min(m[1] for m in req.marks.values())
        if max(req.began.values()) > first_release + BEGIN_TOLERANCE_S:
            req.broken = True
            self.mismatched += 1
            if self.mismatched == 1:
                log.warning("ranks disagree on which request they run (began %s, first collective left at %.3f): "
                            "such requests are dropped from the per-rank timing (logged once)",
                            {r: round(b, 3) for r, b in sorted(req.began.items())}, first_release)
            return False
        req.checked = True
        return True

    def take_cpu_wait(self) -> dict[int, float]:
        out, self.cpu_wait = self.cpu_wait, {}
        return out

    def finished(self) -> list[tuple[int, _Request]]:
        """Requests every rank has finished and that are fully charged (or broken: not charged), or stale
        (nothing heard of them for ``STALE_REQUEST_S``: marked broken): removed, and remembered as retired.
        A broken request waits for every rank's end all the same, so its steps are counted once."""
        out = []
        now = self.clock()
        for q, req in sorted(self.requests.items()):
            ended = len(req.steps) == self.world
            complete = ended and (req.broken or all(len(m) // 2 == req.done for m in req.marks.values()))
            if not complete and now - req.last_seen > STALE_REQUEST_S:
                req.broken = complete = True
            if complete:
                out.append((q, req))
                del self.requests[q]
                self.retired[q] = None
        while len(self.retired) > RETIRED_KEPT:
            del self.retired[next(iter(self.retired))]
        return out

    def stall(self, rank: int) -> tuple[float, float]:
        """(seconds since the rank last made progress while running a request, seconds in its collective).

        A rank waiting in a collective keeps shipping heartbeats (the wait releases the GIL), so a silent
        rank is not known to wait: frozen inside a wait, it must not look like the rank waiting for it.
        A silent rank while another runs a request, or waits in a collective (rank 0 sending the next
        request), counts from its last heartbeat even if that said idle: it should be there too."""
        hb = self.heartbeats.get(rank)
        if hb is None:
            return 0.0, 0.0
        now = self.clock()
        silent = now - hb.sent > STALE_HEARTBEAT_S
        others_busy = any(h.inflight or (h.in_since is not None and now - h.sent <= STALE_HEARTBEAT_S)
                          for r, h in self.heartbeats.items() if r != rank)
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

    metrics: ExporterMetrics | None = None

    def bind(self, metrics: ExporterMetrics) -> None:
        self.metrics = metrics

    def begin_request(self) -> int:
        return 0

    def end_request(self) -> None:
        pass


def stamping(orig: Callable[..., Any], tl: Timeline) -> Callable[..., Any]:
    """``orig`` (a collective's wait) with the rank's arrival and departure stamped: the whole hot path.
    Between requests ``tl.marks`` is a list that keeps nothing.  A wait of one parameter (diffusers'
    ``_wait_tensor(tensor)``) gets a one-argument wrapper: packing ``*args, **kwargs`` costs ~70 ns per
    collective, a third of the stamp; any other signature gets the general one."""
    clock = tl.clock

    def stamped_wait(tensor: Any) -> Any:
        t0 = tl.in_since = clock()
        try:
            return orig(tensor)
        finally:
            t1 = tl.progress = clock()
            tl.in_since = None
            tl.marks.append((t0, t1))

    def stamped_wait_any(*args: Any, **kwargs: Any) -> Any:
        t0 = tl.in_since = clock()
        try:
            return orig(*args, **kwargs)
        finally:
            t1 = tl.progress = clock()
            tl.in_since = None
            tl.marks.append((t0, t1))

    return stamped_wait if _one_positional(orig) else stamped_wait_any


def _one_positional(fn: Callable[..., Any]) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD)


class RankReporter:
    """Installs the stamps on this rank and runs its shipping thread (rank 0: the aligning one).

    ``instrument(..., rank_reporter=RankReporter())`` on every rank; only rank 0's metrics are served.
    ``channel`` defaults to the process group's store; tests pass their own, and ``hook=False`` to feed
    the timeline themselves, and ``interval=None`` to call ``tick()`` themselves instead of a thread.
    ``uninstall()`` restores diffusers (``install()`` again re-stamps); ``close()`` also stops the thread.
    """

    def __init__(self, group: Any = None, channel: Channel | None = None, interval: float | None = INTERVAL_S,
                 clock: Callable[[], float] = time.time, rank: int | None = None, world: int | None = None,
                 hook: bool = True, cpu_wait: Callable[[], float | None] | None = None) -> None:
        self.rank, self.world = _rank_and_world(group, rank, world)
        # The waits as a counter that never falls (a thread that ends keeps its seconds): a plain sum over
        # the live threads fell when one ended, and a rank's waits over a request read 0 (clamped).
        self.timeline = Timeline(clock, cpu_wait or ThreadTotals().waited)
        self._claimed: str | None = None
        if channel is None and self.world > 1:
            channel = _store_channel(group, self.world)
            self._claimed = _claim(channel.prefix)
        self.channel = channel
        self._shipper = Shipper(self.timeline, self.rank)
        self.aligner = Aligner(self.world, clock) if self.rank == 0 else None
        self.metrics: ExporterMetrics | None = None
        self._orig: Callable[..., Any] | None = None
        self._orig_gather: tuple[Any, Any] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._failed = False
        self._silent: set[int] = set()  # ranks rank 0 has logged as silent
        if hook:
            self.install()
        self._thread: threading.Thread | None = None
        if interval is not None:
            self._thread = threading.Thread(target=self._loop, args=(interval,), name="stepwatch-ranks",
                                            daemon=True)
            self._thread.start()

    @property
    def last(self) -> list[float]:
        """Busy seconds per step of each rank in the last request every rank finished (rank 0; else [])."""
        return self.aligner.last[1] if self.aligner is not None and self.aligner.last is not None else []

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
        self._install_gather(stamped_wait)

    def _install_gather(self, stamped_wait: Callable[..., Any]) -> None:
        try:
            sharder = getattr(importlib.import_module(_GATHER[0]), _GATHER[1])
        except (ImportError, AttributeError):  # another diffusers: the attention waits are stamped all the same
            log.info("no %s.%s in this diffusers: the output all-gather is not stamped", *_GATHER[:2])
            return
        orig = sharder.__dict__[_GATHER[2]]
        unshard = orig.__func__

        def stamped_unshard(cls: Any, tensor: Any, dim: int, mesh: Any) -> Any:
            return stamped_wait(unshard(cls, tensor, dim, mesh))

        self._orig_gather = (sharder, orig)
        setattr(sharder, _GATHER[2], classmethod(stamped_unshard))

    def uninstall(self) -> None:
        if self._orig is None:
            return
        mod = importlib.import_module(_TARGET[0])
        setattr(mod, _TARGET[1], self._orig)
        self._orig = None
        if self._orig_gather is not None:
            sharder, orig = self._orig_gather
            setattr(sharder, _GATHER[2], orig)
            self._orig_gather = None

    def close(self, timeout: float = 10.0) -> None:
        """Stop the shipping thread and wait for it: a tick still inside the store when the host then
        destroys its process group (or exits) aborts the process ("terminate called without an active
        exception", seen once in CI on a follower rank)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("rank %d: the shipping thread did not stop within %.0f s", self.rank, timeout)
            self._thread = None
        self.uninstall()
        if self._claimed is not None:
            _CLAIMED.discard(self._claimed)
            self._claimed = None

    def bind(self, metrics: ExporterMetrics) -> None:
        """Rank 0 publishes into ``metrics`` (the exporter's MetricSet)."""
        self.metrics = metrics

    def stamp(self, collective: Callable[..., Any]) -> Callable[..., Any]:
        """``collective`` (a blocking collective of the host's own, e.g. an all-reduce that makes the ranks
        agree on a cache decision) stamped like diffusers' attention waits.  A rank frozen while another
        waits in an unstamped collective looks, to the stall signals, like every rank stuck in its own code
        (a hung worker, not a collective hang).  Every rank must stamp the same collectives: the k-th
        stamp of a request is the same call on every rank."""
        return stamping(collective, self.timeline)

    def begin_request(self) -> int:
        """A request starts on this rank: its index, the same on every rank (they run the same requests)."""
        return self.timeline.begin()

    def end_request(self) -> None:
        self.timeline.end()

    def report(self, report: Any, request: int) -> None:
        """Once per request, after it resolved (0 steps when it could not be): its steps, and on rank 0
        the ranks of the last request every rank has finished (usually the one before: no rank waits for
        the others), with how many requests before this one it was."""
        self.timeline.steps(request, len(report.step_seconds))
        last = self.aligner.last if self.aligner is not None else None
        if last is not None:
            q, per_step, skew_ = last
            report.extra["rank_step_seconds"] = list(per_step)
            report.extra["rank_skew"] = skew_
            report.extra["rank_requests_ago"] = request - q

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
        for q, req in finished:
            finish_request(self.aligner, q, req, m)
        self._note_silent()
        for r in range(self.world):
            age, waiting = self.aligner.stall(r)
            m.rank_progress_age_seconds.labels(rank=str(r)).set(age)
            m.rank_collective_wait_seconds.labels(rank=str(r)).set(waiting)


    def _note_silent(self) -> None:
        """Log (once per silence) a follower that stopped shipping: its gauges keep their last values."""
        assert self.aligner is not None
        now = self.aligner.clock()
        for r in range(1, self.world):
            hb = self.aligner.heartbeats.get(r)
            silent = hb is not None and now - hb.sent > STALE_HEARTBEAT_S
            if silent and r not in self._silent:
                log.warning("rank %d has shipped nothing for %.0f s (frozen, stuck or gone): its per-rank "
                            "gauges keep their last values", r, now - hb.sent)  # type: ignore[union-attr]
                self._silent.add(r)
            elif not silent and r in self._silent:
                log.info("rank %d ships its timings again", r)
                self._silent.discard(r)


def finish_request(aligner: Aligner, q: int, req: _Request, metrics: ExporterMetrics) -> None:
    """A request every rank finished: its steps into the counters, its per-step busy time into the gauges.
    Only a whole one sets the gauges: every rank's stamps, and at least one collective charged."""
    for r, steps in req.steps.items():
        metrics.rank_steps_total.labels(rank=str(r)).inc(steps)
    steps = max(req.steps.values(), default=0)
    whole = len(req.marks) == aligner.world and req.done > 1 and len(req.steps) == aligner.world
    if req.broken or not steps or not whole:
        return
    per_step = [req.busy.get(r, 0.0) / steps for r in range(aligner.world)]
    publish_ranks(per_step, metrics)
    aligner.last = (q, per_step, skew(per_step))


def skew(per_step: list[float]) -> float:
    fastest = min(per_step)
    return (max(per_step) - fastest) / fastest if fastest > 0 else 0.0


def publish_ranks(per_step: list[float], metrics: ExporterMetrics) -> None:
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


def _store_channel(group: Any, world: int) -> StoreChannel:
    """The default store, with keys under the group's name (the default group's when ``group`` is None)."""
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    name = dist.distributed_c10d._get_process_group_name(pg)  # type: ignore[arg-type]
    return StoreChannel(dist.distributed_c10d._get_default_store(), world, prefix=f"stepwatch/ranks/{name}")


_CLAIMED: set[str] = set()  # store prefixes with a live reporter in this process


def _claim(prefix: str) -> str:
    """One reporter per group and process: two would pop each other's chunks and stamp every wait twice."""
    if prefix in _CLAIMED:
        raise ValueError(f"a RankReporter for this process group already runs in this process ({prefix}); "
                         "close() it first, or pass the one you have to instrument()")
    _CLAIMED.add(prefix)
    return prefix
