"""Each rank's side of the per-rank timing: its stamps, the chunks it ships, and the channel they go by.

``stamping`` wraps a collective's wait so that every call appends the rank's
arrival and departure to its ``Timeline``; a ``Shipper`` cuts the timeline into
``Chunk``s, each stamp once, and a ``StoreChannel`` carries them to rank 0
through the process group's store.  Why the stamps name the slow rank:
``exporter/ranks.py``.
"""

from __future__ import annotations

import inspect
import json
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

INTERVAL_S = 1.0
MAX_QUEUED_CHUNKS = 120  # a follower stops pushing while this many wait for rank 0 (two minutes' worth)


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
