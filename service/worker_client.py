"""The server's side of the worker pipe: start the worker process, send it requests, match the replies.

Requests are answered out of band: ``call`` returns a Future that a reader thread
resolves when the reply with the same id arrives.  A worker that dies fails every
pending Future with ``WorkerDied`` (so no caller hangs) and is reported to
``on_died``, which decides whether to restart it.  The messages are in
``messages.py``, shared with the worker.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, cast

from stepwatch.service.config import ServiceConfig
from stepwatch.service.messages import (
    ChunkMsg,
    FromWorker,
    ProgressMsg,
    ReadyMsg,
    Reply,
    Request,
    SessionStartedMsg,
)

log = logging.getLogger("stepwatch.service")


class WorkerDied(Exception):
    """The worker exited (or could not be reached) before it answered."""


def exit_text(code: int | None) -> str:
    """A worker's exit code in words: 'worker killed by SIGKILL', 'worker exited with code 1'."""
    if code is None:
        return "worker exited"
    if code < 0:
        try:
            return f"worker killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"worker killed by signal {-code}"
    return f"worker exited with code {code}"


def _target(cfg: ServiceConfig, cancel: Any) -> tuple[Callable[..., None], tuple[Any, ...], bool]:
    """The worker's entry point, its extra arguments and whether it is a daemon (ranks start children)."""
    # Imported here: the worker modules are only the spawned process's; the server never runs them.
    if cfg.ranks > 1:
        from stepwatch.service.ranks import ranks_main

        return ranks_main, (cfg.ranks,), False
    from stepwatch.service.worker import worker_main

    return worker_main, (cancel,), True


class WorkerClient:
    """The worker process: start, talk to, watch, restart."""

    def __init__(self, cfg: ServiceConfig, on_ready: Callable[[ReadyMsg], None], on_fatal: Callable[[str], None],
                 on_died: Callable[[int | None], None],
                 on_progress: Callable[[ProgressMsg], None] | None = None,
                 on_session: Callable[[SessionStartedMsg | ChunkMsg], None] | None = None) -> None:
        self.cfg = cfg
        self._on_ready, self._on_fatal, self._on_died = on_ready, on_fatal, on_died
        self._on_progress = on_progress
        self.on_session = on_session  # a session's started and chunk messages (service/sessions.py)
        # The number of the video job to stop, shared with the worker (it reads it after every step): a job
        # cancelled while it runs stops within a step instead of holding the worker to its end.
        self.cancel = mp.get_context("spawn").Value("q", 0, lock=False)
        self.proc: Any = None
        self.conn: Connection | None = None
        self.ready_info: ReadyMsg | None = None
        self._send_lock = threading.Lock()
        self._pending: dict[str, Future[Reply]] = {}
        self._lock = threading.Lock()
        self.generation = 0  # bumped by every start and by stop: a death of an older generation is expected
        self.ready = threading.Event()
        self.stopped = False  # after stop(), no request is sent and none is left waiting

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        target, extra, daemon = _target(self.cfg, self.cancel)
        proc = ctx.Process(target=target, args=(self.cfg.to_raw(), child, *extra), daemon=daemon,
                           name="stepwatch-worker")
        proc.start()
        child.close()
        self.proc, self.conn = proc, parent
        self.generation += 1
        self.ready.clear()
        self.ready_info = None
        threading.Thread(target=self._reader, args=(parent, proc, self.generation), daemon=True,
                         name="stepwatch-worker-reader").start()

    def _reader(self, conn: Connection, proc: Any, generation: int) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._deliver(msg)
            except Exception:
                # A reader that stopped silently would wedge the service: treat it as a worker death.
                log.exception("bad message from the worker; restarting it")
                proc.kill()
                break
        proc.join(timeout=5)
        code = proc.exitcode
        self._fail_pending(exit_text(code))
        if generation == self.generation:
            self.ready.clear()
            self._on_died(code)

    def _deliver(self, msg: FromWorker) -> None:
        if msg["op"] == "ready":
            self.ready_info = msg
            self.ready.set()
            self._on_ready(msg)
        elif msg["op"] == "fatal":
            log.error("worker failed to start:\n%s", msg["message"])
            self._on_fatal(msg["message"])
        elif msg["op"] == "progress":
            if self._on_progress is not None:
                self._on_progress(msg)
        elif msg["op"] in ("session_started", "chunk"):
            if self.on_session is not None:
                self.on_session(msg)
        else:
            with self._lock:
                fut = self._pending.pop(str(msg.get("id")), None)
            if fut is not None and not fut.done():
                fut.set_result(cast(Reply, msg))

    def call(self, msg: Request) -> Future[Reply]:
        """Send a request; the Future gets its reply, or WorkerDied."""
        fut: Future[Reply] = Future()
        if self.stopped:  # the worker is gone for good: nobody would ever answer
            fut.set_exception(WorkerDied("the service is shutting down"))
            return fut
        msg["id"] = msg.get("id") or uuid.uuid4().hex
        with self._lock:
            self._pending[msg["id"]] = fut
        try:
            with self._send_lock:
                self.conn.send(msg)  # type: ignore[union-attr]  # None before start: caught below
        except (OSError, BrokenPipeError, AttributeError) as e:
            with self._lock:
                self._pending.pop(msg["id"], None)
            fut.set_exception(WorkerDied(f"cannot reach the worker ({e})"))
        return fut

    def kill(self) -> None:
        """Kill a hung worker; the reader sees it die and the service restarts it.  Not ready from now on:
        a request admitted before the reader notices would reach a dead worker."""
        self.ready.clear()
        if self.proc is not None:
            self.proc.kill()

    def alive(self) -> bool:
        return self.proc is not None and bool(self.proc.is_alive())

    def pid(self) -> int | None:
        """The worker process's pid while it runs (warming up included), else None."""
        return int(self.proc.pid) if self.alive() and self.proc.pid else None

    def stop(self) -> None:
        self.generation += 1  # a death from here on is expected
        self.stopped = True
        try:
            with self._send_lock:
                self.conn.send({"op": "shutdown"})  # type: ignore[union-attr]
        except Exception:
            pass
        if self.proc is not None:
            self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=5)
        self._fail_pending("the service is shutting down")

    def _fail_pending(self, why: str) -> None:
        """Every request still waiting for a reply gets WorkerDied, so no caller (and no HTTP client) hangs."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(WorkerDied(why))
