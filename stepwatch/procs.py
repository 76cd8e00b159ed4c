"""Processes and ports: child processes that die with their parent or stop with their group, free loopback ports.

The practice stack, the replays, the service's ranks and the benchmarks all start children on free loopback
ports; these are their one set of helpers.

A parent killed by SIGKILL runs no clean-up, so its children would live on: a follower rank
waiting out the gloo timeout, a busy-loop neighbour burning a CPU for good.  Linux's
``prctl(PR_SET_PDEATHSIG)`` has the kernel signal them instead.  Elsewhere the children are
left as before (and the caller may log it).

The signal follows the *thread* that started the child: start such children from a thread
that lives as long as they should (the main thread).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import NoReturn

PR_SET_PDEATHSIG = 1


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20  # blocks from 1 MiB up get mappings of their own
ARENA_MAX = 2


def _mallopt(param: int, value: int) -> bool:
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(param, value))
    except (OSError, AttributeError):
        return False


def keep_address_space_returnable() -> bool:
    """Make freed memory give its address space back: the HTTP process calls it at start-up.

    glibc raises its mmap threshold to the size of any mapped block freed (up to 32 MiB); from then on blocks
    of that size come from the heap and the per-thread arenas, whose address space and pages stay with the
    process once freed.  The HTTP process queues chunks of hundreds of KB for slow stream clients: a fixed
    threshold (which also turns the raising off) keeps every block of a MiB and more in a mapping of its own,
    returned when freed, and two arenas bound what its threads reserve (64 MiB of address space each).
    The worker sets the threshold around each video job only (``large_blocks_returned_when_freed``): for its
    images every tensor of a MiB or more would cost a fresh mapping.  True when glibc took both settings;
    elsewhere nothing changes.
    """
    return _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and _mallopt(M_ARENA_MAX, ARENA_MAX)


def limit_arenas() -> bool:
    """At most ``ARENA_MAX`` malloc arenas in this process: each worker process calls it as it starts.

    glibc gives a thread that finds the arenas busy one of its own, up to 8 per core, and each reserves 64 MiB
    of address space it keeps.  The worker's threads (torch's, a streaming session's, the exporter's) would
    take a new one each, and the worker's memory budget is its address space (RLIMIT_AS).  True when glibc
    took the setting."""
    return _mallopt(M_ARENA_MAX, ARENA_MAX)


MMAP_THRESHOLD_CEILING_BYTES = 32 << 20  # where glibc's dynamic threshold stops rising on 64-bit


def set_mmap_threshold(n_bytes: int) -> bool:
    """Blocks of ``n_bytes`` and more get mappings of their own (and glibc's rising of the threshold stops).

    The trim threshold goes to twice that, as glibc's rising sets it: left at its 128 KiB, every free at the
    heap's top below the new threshold gives pages back that the next request faults in again (an image at
    512x512 x 8 steps took 1.106x as long [1.054, 1.161] with the threshold alone)."""
    return _mallopt(M_MMAP_THRESHOLD, n_bytes) and _mallopt(M_TRIM_THRESHOLD, 2 * n_bytes)


@contextmanager
def large_blocks_returned_when_freed() -> Iterator[None]:
    """Inside: every block of a MiB or more gets a mapping of its own, unmapped when freed.  The worker runs
    each video job in it.

    A video job's tensors of 1-32 MiB otherwise come from the heap and arenas once the dynamic threshold has
    risen, and their address space stays with the process: under the worker's RLIMIT_AS budget one large job
    then leaves every later job out of memory.  Outside, the threshold sits at glibc's own ceiling (setting it
    turns the rising off): an image's per-step tensors reuse the heap, as they would once the threshold had
    risen (a 1 MiB threshold for images made a 512x512 x 8-step image 1.55-1.77x slower on CPU).
    """
    set_mmap_threshold(MMAP_THRESHOLD_BYTES)
    try:
        yield
    finally:
        set_mmap_threshold(MMAP_THRESHOLD_CEILING_BYTES)


def malloc_trim() -> None:
    """Give freed heap back to the OS, so garbage (an OOM's, a dropped stream's) does not stay resident."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def die_with_parent_fn() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child killed with its parent; None where prctl is missing (not Linux).

    prctl is looked up here, in the parent: after a fork only the call itself runs, since loading a
    library or logging in a forked child of a threaded process can deadlock on a lock held by another thread.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    return arm


def die_with_parent() -> bool:
    """Have this process killed when its parent dies; False where that is unavailable."""
    arm = die_with_parent_fn()
    if arm is not None:
        arm()
    return arm is not None


def exit_without_finalizing(code: int = 0) -> NoReturn:
    """End a process that ran gloo collectives: logs and stdio flushed, then ``os._exit``, no finalization.

    CPython's finalization ends any thread that then asks for the GIL with ``pthread_exit``.  A gloo worker
    thread asks for it when it drops the last reference to a finished collective (the tensors of an
    ``AsyncAllgatherWork`` hold Python objects), and ``destroy_process_group`` leaves gloo's threads running.
    If it is still waiting for the GIL when the main thread begins finalizing (a rank crowded on its CPU, its
    main thread busy), it is ended on getting it; the forced unwind meets that noexcept destructor and
    ``std::terminate`` aborts the rank ("terminate called without an active exception";
    the core's backtrace: ``~AsyncAllgatherWork`` in ``ProcessGroupGloo::runLoop`` under
    ``PyThread_exit_thread``).  ``os._exit`` ends those threads with the process instead.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to lose
            pass
    os._exit(code)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the project's one free-port helper)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """While inside, SIGTERM raises SystemExit (143), so ``finally`` blocks stop children and restore faults.

    CI stops a job with SIGTERM; Python's default for it ends the process at once,
    leaving the service, Prometheus and a fault in place.  Only the main thread can
    install a handler: elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Child:
    """A child process with its output in a log file.

    It leads a process group of its own (``start_new_session``), so ``stop()``
    also ends what it started (the service's worker and rank processes).
    """

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, cwd=cwd)
        except BaseException:
            self._log.close()
            raise

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 3000) -> str:
        self._log.flush()
        try:
            return self.log_path.read_text()[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to the child (it stops its own children), then SIGKILL to whatever is left of its group."""
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    pass
            self._kill_group()
            if self.proc.poll() is None:
                self.proc.wait(timeout=10)
        finally:
            self._log.close()

    def crash(self) -> None:
        """SIGKILL to the child's whole group, as a node or an OOM killer ends it: nothing runs its finally."""
        self._kill_group()
        self.proc.wait(timeout=10)
        self._log.close()

    def _kill_group(self) -> None:
        # The group id is the child's pid (start_new_session); grandchildren that outlived it are still in it.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the whole group is gone already
