"""How long a process's threads waited for a CPU: the host side of a step delayed by another process.

A GPU pipeline's host thread launches kernels, runs the scheduler and Python between them; another
process on its CPUs (a noisy neighbour, a co-located job, a data loader) makes each of those late, and
neither GPU-Util nor the step time says why.  Linux keeps the answer per thread: schedstat's run delay,
the time a thread was runnable but not running.  Waits alone do not tell a starved process from a busy
one (two ranks on one host, or a service compiling, wait a little on every thread they run), so the run
time is read beside them: per second of running, a process behind a neighbour waits far longer.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable


def schedstat_threads() -> dict[str, tuple[int, int]] | None:
    """Per live thread id: (ran, waited) nanoseconds on and waiting for a CPU (Linux schedstat), or None
    where there is no schedstat."""
    out: dict[str, tuple[int, int]] = {}
    try:
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/schedstat") as f:
                    fields = f.read().split()
                out[task] = int(fields[0]), int(fields[1])
            except (OSError, IndexError, ValueError):
                continue  # a thread that just ended
    except OSError:
        return None
    return out


def schedstat_seconds() -> tuple[float, float] | None:
    """(ran, waited): seconds this process's live threads ran on a CPU and were runnable but waited for one
    (summed over the threads), or None where there is no schedstat.  A thread that ends takes its seconds
    with it: for a counter, ``ThreadTotals``.

    Thread-seconds: two threads waiting one second count two."""
    threads = schedstat_threads()
    if threads is None:
        return None
    return sum(r for r, _ in threads.values()) / 1e9, sum(w for _, w in threads.values()) / 1e9


class ThreadTotals:
    """The process's (ran, waited) seconds as counters: the live threads' sums plus the last reading of every
    thread that has ended since, so the totals never go down.

    A plain sum over /proc/self/task drops an ended thread's seconds: a streaming session's thread ending
    would make the scraped counter fall, Prometheus reads a fall as a reset, and the CPU check of a stall
    triage would look at nonsense.  What an ended thread did after the last reading is lost (an
    undercount of at most one scrape interval of one thread); a thread id reused with smaller counters is a
    new thread.  Safe to call from several threads (the rank reporter reads it from the pipeline's and
    from its shipping thread): two readings at once would count an ended thread twice."""

    def __init__(self, read: Callable[[], dict[str, tuple[int, int]] | None] = schedstat_threads) -> None:
        self._read = read
        self._last: dict[str, tuple[int, int]] = {}
        self._ended = (0, 0)
        self._lock = threading.Lock()

    def __call__(self) -> tuple[float, float] | None:
        with self._lock:
            now = self._read()
            if now is None:
                return None
            ran_ended, waited_ended = self._ended
            for tid, (ran, waited) in self._last.items():
                seen = now.get(tid)
                if seen is None or seen[0] < ran or seen[1] < waited:
                    ran_ended, waited_ended = ran_ended + ran, waited_ended + waited
            self._ended, self._last = (ran_ended, waited_ended), now
        return ((ran_ended + sum(r for r, _ in now.values())) / 1e9,
                (waited_ended + sum(w for _, w in now.values())) / 1e9)

    def waited(self) -> float | None:
        """The waited seconds alone (the rank reporter's per-request reading)."""
        both = self()
        return None if both is None else both[1]


class SchedstatReader:
    """The run and wait counters of one scrape from one walk of /proc/self/task (an open and a read per
    thread; a torch process has dozens): the two counters ask within microseconds of each other, so a
    reading younger than ``fresh_s`` is reused.  Scrapes come seconds apart; a counter read twice inside
    a second gives the same value twice, which a counter may."""

    def __init__(self, read: Callable[[], tuple[float, float] | None], fresh_s: float = 1.0) -> None:
        self._read = read
        self._fresh_s = fresh_s
        self._at = -math.inf
        self._last: tuple[float, float] | None = None

    def _reading(self) -> tuple[float, float] | None:
        now = time.monotonic()
        if now - self._at >= self._fresh_s:
            self._last, self._at = self._read(), now
        return self._last

    def ran(self) -> float | None:
        both = self._reading()
        return None if both is None else both[0]

    def waited(self) -> float | None:
        both = self._reading()
        return None if both is None else both[1]
