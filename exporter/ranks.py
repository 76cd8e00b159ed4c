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
waiting in it looks like a rank stuck in its own code (the two-rank stall drill then names a hung
worker: rank 0 waits for a frozen rank 1 in one of these while its stamped wait reads 0).  A background thread on
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
the stamps from CUDA events recorded around the collective and resolved later (the design is in
docs/benchmarks.md, "GPU check").  Ranks on different hosts compare wall clocks, which NTP/PTP keeps
within a millisecond or so on a GPU cluster; the stamps of one host are exact.

Here: the ``RankReporter`` that installs the stamps and runs the shipping thread.  Each rank's side
(stamps, chunks, the store channel) is in ``rank_timeline.py``; rank 0's alignment in ``rank_align.py``.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from stepwatch.exporter.cpu import ThreadTotals
from stepwatch.exporter.rank_align import STALE_HEARTBEAT_S, Aligner, finish_request
from stepwatch.exporter.rank_timeline import INTERVAL_S, Channel, Shipper, StoreChannel, Timeline, stamping
from stepwatch.metrics import ExporterMetrics

log = logging.getLogger("stepwatch.exporter.ranks")

_TARGET = ("diffusers.models.attention_dispatch", "_wait_tensor")
# The other collective of every transformer call: the output's all-gather (funcol, waited on lazily when the
# tensor is used, so not through _wait_tensor).  Stamped by waiting for it through the stamped wait.
_GATHER = ("diffusers.hooks.context_parallel", "EquipartitionSharder", "unshard")


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
        exception", on a follower rank)."""
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
            quiet_s = now - hb.sent if hb is not None else 0.0
            silent = quiet_s > STALE_HEARTBEAT_S
            if silent and r not in self._silent:
                log.warning("rank %d has shipped nothing for %.0f s (frozen, stuck or gone): its per-rank "
                            "gauges keep their last values", r, quiet_s)
                self._silent.add(r)
            elif not silent and r in self._silent:
                log.info("rank %d ships its timings again", r)
                self._silent.discard(r)


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
