"""Rank 0's side of the per-rank timing: align every rank's chunks and charge each rank its share.

The ``Aligner`` merges the chunks, charges per aligned collective the time from
the group's release by the previous collective to each rank's arrival, finishes
the requests every rank has finished, and answers the stall signals;
``finish_request`` and ``publish_ranks`` set the per-request gauges.  Why:
``exporter/ranks.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stepwatch.exporter.rank_timeline import INTERVAL_S, Chunk
from stepwatch.metrics import ExporterMetrics

log = logging.getLogger("stepwatch.exporter.ranks")

STALE_REQUEST_S = 120.0  # a request no rank has shipped anything of for this long is dropped from alignment
STALE_HEARTBEAT_S = 5 * INTERVAL_S  # a rank silent this long is not shipping: frozen or stuck
BEGIN_TOLERANCE_S = 0.02  # clocks of ranks on different hosts differ by about a millisecond
RETIRED_KEPT = 1024  # finished request indices remembered, so a late chunk of one is not a new request


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
