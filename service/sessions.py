"""The server's side of streaming sessions: open, stream the chunks, change the prompt, close, time out.

HTTP (service/app.py):

  POST   /v1/stream/sessions              {prompt, seed?, size?, chunks?, steps?} -> 200 text/event-stream:
                                          ``session`` (id, chunks, frames per chunk), one ``chunk`` per chunk
                                          (index, frames as base64 PNGs, prompt_version, seconds), ``end``
                                          (outcome done | closed | failed, reason, chunks delivered, message,
                                          the session's KV bytes as allocated and as the ledger reserved them);
                                          429 (Retry-After) when every session slot is taken
  POST   /v1/stream/sessions/{id}/prompt  {prompt} -> {applies_from}: the first chunk the new prompt reaches
  DELETE /v1/stream/sessions/{id}         -> {closing_after}: chunks delivered before it stops

The worker runs the session (service/stream_worker.py) and sends its chunks as they are done; they wait here in
the session's queue until its event stream takes them.  A client that goes away closes its session.  One that
stops reading leaves chunks in the queue: past ``stream.send_buffer_mb`` of them (reason ``backpressure``) or
after ``stream.idle_timeout_seconds`` without taking one (reason ``idle``) they are dropped and the session is
closed, so an abandoned session never holds a slot, its KV cache or its chunks.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from stepwatch.procs import malloc_trim
from stepwatch.service import api
from stepwatch.service.config import ServiceConfig, parse_size
from stepwatch.service.messages import ChunkMsg, SessionStartedMsg
from stepwatch.service.worker_client import WorkerClient, WorkerDied
from stepwatch.sse import sse

log = logging.getLogger("stepwatch.service")
OPEN_TIMEOUT = 30.0  # seconds to wait for the worker to start a session (a slot's first call)
REAP_EVERY = 1.0


@dataclass
class StreamSession:
    """One session's events on their way to its client: a queue bounded in bytes.  Past the bound (a client that
    reads slower than the session makes chunks) or the idle timeout, what waits is dropped at once and the stream
    ends with ``end`` (outcome closed, reason backpressure or idle); ``on_drop`` stops the worker's session."""

    id: str
    loop: asyncio.AbstractEventLoop
    limit_bytes: int = 8 << 20
    on_drop: Callable[[str, str], None] | None = None  # (session id, reason)
    events: asyncio.Queue[tuple[str, bytes]] = field(default_factory=asyncio.Queue)
    last_taken: float = field(default_factory=time.monotonic)
    ended: bool = False
    first: tuple[str, bytes] | None = None  # the event open() waited for: its stream sends it before the queue
    buffered: int = 0  # bytes queued and not taken; read and written on the loop only
    dropped: str | None = None  # backpressure or idle, once the queue was dropped

    def put(self, kind: str, payload: bytes) -> None:
        """From any thread: hand an event to the session's stream."""
        self.loop.call_soon_threadsafe(self._enqueue, kind, payload)

    def _enqueue(self, kind: str, payload: bytes) -> None:
        if self.dropped is not None:
            return  # the stream already has its end
        self.buffered += len(payload)
        self.events.put_nowait((kind, payload))
        if self.buffered > self.limit_bytes and kind != "end":
            self.drop("backpressure")

    def drop(self, reason: str) -> None:
        """On the loop: free every waiting event, end the stream, stop the worker's session."""
        if self.dropped is not None:
            return
        self.dropped = reason
        while not self.events.empty():
            self.events.get_nowait()
        self.buffered = 0
        self.events.put_nowait(("end", sse("end", {"outcome": "closed", "reason": reason, "chunks": -1,
                                                   "message": f"the client did not keep up ({reason}): the "
                                                              "session was closed and its waiting chunks dropped"})))
        log.info("session %s: client not reading (%s), waiting chunks dropped", self.id[:8], reason)
        if self.on_drop is not None and not self.ended:
            self.on_drop(self.id, reason)

    async def take(self) -> tuple[str, bytes]:
        if self.first is not None:
            ev, self.first = self.first, None
            return ev
        ev = await self.events.get()
        self.buffered -= len(ev[1])
        self.last_taken = time.monotonic()
        return ev

    def waiting(self) -> int:
        """Events queued and not taken (a length read from another thread: the reaper's estimate)."""
        return self.events.qsize()


SESSION_FIELDS = ("prompt", "size", "chunks", "steps", "seed")


def parse_request(body: Any, cfg: ServiceConfig) -> dict[str, Any]:
    """A session's opening request, checked as a video job's is: unknown fields, types, the size menu, the prompt's
    text and the chunk and step ranges each get a 400 that names the field."""
    if not isinstance(body, dict):
        raise api.ApiError(400, "request body must be a JSON object", None, "invalid_json")
    st = cfg.stream
    api.refuse_unknown(body, SESSION_FIELDS, "a streaming session")
    prompt = api.prompt_field(body)
    w, h = parse_size(api.size_choice(body, st.sizes, st.default_size, "a stream size"))
    return {"prompt": prompt, "width": w, "height": h, "seed": api.int_field(body, "seed", 0, 0, 2**32 - 1),
            "chunks": api.int_field(body, "chunks", st.default_chunks, 2, st.max_chunks),
            # None: the worker's default (the stream_steps knob)
            "steps": None if body.get("steps") is None else api.int_field(body, "steps", st.steps, 1, st.max_steps)}


def prompt_of(body: Any) -> str:
    """A prompt change's body: ``{"prompt": ...}`` and nothing else, checked as an opening prompt is."""
    if not isinstance(body, dict):
        raise api.ApiError(400, "request body must be a JSON object", None, "invalid_json")
    api.refuse_unknown(body, ("prompt",), "a prompt change")
    return api.prompt_field(body)


class SessionManager:
    """The sessions this server streams; the worker holds their state, this holds their event queues."""

    def __init__(self, cfg: ServiceConfig, worker: WorkerClient) -> None:
        self.cfg = cfg
        self.worker = worker
        worker.on_session = self.on_worker_event
        self.sessions: dict[str, StreamSession] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._reap, daemon=True, name="stepwatch-sessions").start()

    async def open(self, body: Any) -> StreamSession:
        """Start a session on the worker and wait until it runs: its ``session`` event is the first one queued.
        A refusal (every slot taken) is a 429; a worker that cannot start it, a 503."""
        opened_at = time.perf_counter()
        req = parse_request(body, self.cfg)
        sess = StreamSession(uuid.uuid4().hex, asyncio.get_running_loop(),
                             int(self.cfg.stream.send_buffer_mb * (1 << 20)), self.close)
        with self._lock:
            self.sessions[sess.id] = sess
        fut = self.worker.call({"op": "session", "id": sess.id, "request": req, "opened_at": opened_at})
        fut.add_done_callback(lambda f: self._ended(sess, f))
        try:
            kind, payload = await asyncio.wait_for(sess.take(), OPEN_TIMEOUT)
        except TimeoutError:
            self.close(sess.id, "closed")
            self.forget(sess.id)
            raise api.ApiError(503, "the worker did not start the session in time", None, "unavailable",
                               "server_error", {"Retry-After": "5"}) from None
        if kind == "end":
            self.forget(sess.id)
            raise _refusal(json.loads(payload.decode().split("data: ", 1)[1]))
        sess.first = (kind, payload)  # a chunk may already be queued behind it: the stream sends it first
        return sess

    def on_worker_event(self, msg: SessionStartedMsg | ChunkMsg) -> None:
        """From the worker's reader thread: a session started, or one of its chunks is done."""
        sess = self.sessions.get(msg["id"])
        if sess is None:
            return
        if msg["op"] == "session_started":
            # fps: what the player plays the frames at, so a viewer can tell a late chunk from a slow stream
            sess.put("session", sse("session", {"id": msg["id"], "chunks": msg["chunks"],
                                                "frames_per_chunk": msg["frames_per_chunk"],
                                                "fps": self.cfg.stream.fps}))
            return
        frames = [base64.b64encode(f).decode("ascii") for f in msg["frames"]]
        sess.put("chunk", sse("chunk", {"index": msg["index"], "frames": frames,
                                        "prompt_version": msg["prompt_version"], "seconds": round(msg["seconds"], 4)}))

    def _ended(self, sess: StreamSession, fut: Future[Any]) -> None:
        """The worker's last word on a session: its end, a refusal, or the worker's death."""
        try:
            reply = fut.result()
        except WorkerDied as e:
            reply = {"op": "session_end", "outcome": "failed", "reason": "worker_died", "chunks": -1,
                     "message": f"the worker died: {e}"}
        sess.ended = True
        if reply.get("op") == "error":
            data = {"outcome": "refused" if reply.get("kind") == "busy" else "failed", "reason": reply.get("kind"),
                    "chunks": 0, "message": reply.get("message", "")}
        else:
            data = {k: reply.get(k) for k in ("outcome", "reason", "chunks", "message", "kv_bytes", "kv_ledger_bytes")}
        sess.put("end", sse("end", data))

    def set_prompt(self, sid: str, body: Any) -> dict[str, Any]:
        """Change a running session's prompt (blocking: run it on a thread)."""
        prompt = prompt_of(body)
        ack = self._ask({"op": "session_prompt", "id": "", "session": sid, "prompt": prompt})
        return {"id": sid, "applies_from": ack["applies_from"], "message": ack["message"]}

    def close_and_wait(self, sid: str) -> dict[str, Any]:
        ack = self._ask({"op": "session_close", "id": "", "session": sid, "reason": "closed"})
        return {"id": sid, "closing_after": ack["applies_from"], "message": ack["message"]}

    def _ask(self, msg: Any) -> dict[str, Any]:
        if msg["session"] not in self.sessions:
            raise api.ApiError(404, f"no such session {msg['session']}", None, "not_found")
        try:
            ack = self.worker.call(msg).result(timeout=10)
        except WorkerDied as e:
            raise api.ApiError(503, f"the worker is unavailable: {e}", None, "unavailable", "server_error") from None
        if ack.get("op") != "session_ack" or not ack.get("ok"):
            raise api.ApiError(404, str(ack.get("message", "no such session")), None, "not_found")
        return dict(ack)

    def close(self, sid: str, reason: str) -> None:
        """Ask the worker to stop a session, without waiting (a client that went away, the idle timeout)."""
        sess = self.sessions.get(sid)
        if sess is not None and not sess.ended:
            self.worker.call({"op": "session_close", "id": "", "session": sid, "reason": reason})

    def forget(self, sid: str) -> None:
        with self._lock:
            sess = self.sessions.pop(sid, None)
        if sess is not None and sess.dropped is not None:
            malloc_trim()  # the dropped chunks' heap back to the OS: a burst of unread streams leaves no trace

    def _reap(self) -> None:
        """Drop the waiting events of sessions whose client stopped reading (chunks waiting, none taken for the idle
        timeout): a running session is closed (reason idle), an ended one holds nothing more for its client."""
        limit = self.cfg.stream.idle_timeout_seconds
        while not self._stop.wait(REAP_EVERY):
            now = time.monotonic()
            for sess in list(self.sessions.values()):
                if sess.dropped is None and sess.waiting() > 0 and now - sess.last_taken > limit:
                    log.info("session %s idle for %.0f s: closing it", sess.id[:8], now - sess.last_taken)
                    sess.last_taken = now  # asked once per timeout
                    sess.loop.call_soon_threadsafe(sess.drop, "idle")

    def stop(self) -> None:
        self._stop.set()


def _refusal(end: dict[str, Any]) -> api.ApiError:
    if end.get("outcome") == "refused":
        return api.ApiError(429, str(end.get("message")), None, "sessions_full", "server_error", {"Retry-After": "5"})
    return api.ApiError(503, f"the session could not start: {end.get('message')}", None, "unavailable",
                        "server_error", {"Retry-After": "5"})
