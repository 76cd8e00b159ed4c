"""Streaming sessions without a worker process: the server's request checks, its idle reaper and its refusals,
the stream config and knobs, and the chunk helpers the worker uses."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import Future
from typing import Any

import pytest

from stepwatch.service import api, knobs
from stepwatch.service.config import ConfigError, parse
from stepwatch.service.sessions import SessionManager, StreamSession, parse_request, prompt_of


class FakeWorker:
    """What the session manager sends, and Futures it answers by hand."""

    def __init__(self) -> None:
        self.on_session: Any = None
        self.sent: list[dict[str, Any]] = []

    def call(self, msg: dict[str, Any]) -> Future[Any]:
        self.sent.append(dict(msg))
        return Future()


def _cfg(**stream: Any) -> Any:
    return parse({"stream": {"enabled": True, **stream}})


def test_a_session_request_is_checked_field_by_field() -> None:
    cfg = _cfg()
    ok = parse_request({"prompt": "a kite", "size": "128x128", "chunks": 4, "seed": 3}, cfg)
    assert ok == {"prompt": "a kite", "width": 128, "height": 128, "seed": 3, "chunks": 4, "steps": None}
    for body, param in (({"prompt": ""}, "prompt"), ({"prompt": "x", "size": "96x96"}, "size"),
                        ({"prompt": "x", "chunks": 1}, "chunks"), ({"prompt": "x", "chunks": 33}, "chunks"),
                        ({"prompt": "x", "steps": 0}, "steps"), ({"prompt": "x", "seed": True}, "seed")):
        with pytest.raises(api.ApiError) as e:
            parse_request(body, cfg)
        assert (e.value.status, e.value.param) == (400, param), body


# Bodies a careless or hostile client sends: each must get a 400 naming the field, in the video API's shape.
FUZZ: tuple[tuple[Any, str | None], ...] = (
    ({"prompt": "x", "size": {}}, "size"), ({"prompt": "x", "size": 128}, "size"),
    ({"prompt": "x", "size": "1x1"}, "size"),
    ({"prompt": "x", "colour": "red"}, "colour"), ({"prompt": "\ud800"}, "prompt"), ({"prompt": ["x"]}, "prompt"),
    ({"prompt": None}, "prompt"), ({"prompt": "  "}, "prompt"), ({"prompt": "x" * 4001}, "prompt"),
    ({"prompt": "x", "chunks": "4"}, "chunks"), ({"prompt": "x", "chunks": 10**30}, "chunks"),
    ({"prompt": "x", "steps": 2.5}, "steps"), ({"prompt": "x", "seed": -1}, "seed"), ({}, "prompt"),
    ([], None), ("x", None),
)


def assert_client_safe(body: dict[str, Any]) -> None:
    """An error body a client sees: OpenAI's shape, no traceback and no server path (API routes are not paths)."""
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    text = json.dumps(body)
    assert "Traceback" not in text and ".py" not in text, text
    assert "/" not in text.replace("/v1/", ""), text


def test_every_bad_session_body_gets_a_400_naming_its_field() -> None:
    cfg = _cfg()
    for body, param in FUZZ:
        with pytest.raises(api.ApiError) as e:
            parse_request(body, cfg)
        assert (e.value.status, e.value.param) == (400, param), body
        assert_client_safe(e.value.body())


def test_the_sidecars_stream_probe_asks_for_the_session_it_means() -> None:
    """The stream probe's body passes the service's checks, and its size is the one served (not the default)."""
    from stepwatch.exporter.sidecar.config import default_stream_probe_set

    item = default_stream_probe_set(size="128x128", chunks=4).items[0]
    req = parse_request(item.session_body(), _cfg())
    assert (req["width"], req["height"], req["chunks"], req["seed"]) == (128, 128, 4, item.seed)


def test_a_prompt_change_is_checked_as_an_opening_prompt() -> None:
    assert prompt_of({"prompt": "a kite"}) == "a kite"
    for body in ({"prompt": "\udfff"}, {"prompt": ""}, {"prompt": 3}, {"prompt": "x", "seed": 1}, [], {}):
        with pytest.raises(api.ApiError) as e:
            prompt_of(body)
        assert e.value.status == 400, body
        assert_client_safe(e.value.body())


def test_the_video_api_refuses_the_same_bodies() -> None:
    cfg = parse({"video": {"enabled": True}})
    for body, param in FUZZ:
        if not isinstance(body, dict) or param in ("chunks", "colour"):
            continue
        with pytest.raises(api.ApiError) as e:
            api.validate_video(body, cfg)
        assert (e.value.status, e.value.param) == (400, param), body
        assert_client_safe(e.value.body())


def test_a_session_nobody_reads_is_closed_after_the_idle_timeout() -> None:
    worker = FakeWorker()
    manager = SessionManager(_cfg(idle_timeout_seconds=0.3), worker)
    loop = asyncio.new_event_loop()
    try:
        read, unread = (StreamSession(sid, loop, on_drop=manager.close) for sid in ("read", "unread"))
        manager.sessions.update({"read": read, "unread": unread})
        unread.put("chunk", b"...")  # a chunk waits; its stream never takes it
        deadline = time.monotonic() + 5
        while not any(m.get("session") == "unread" for m in worker.sent) and time.monotonic() < deadline:
            read.last_taken = time.monotonic()  # the other session's client keeps reading
            loop.run_until_complete(asyncio.sleep(0.05))
        closes = [m for m in worker.sent if m["op"] == "session_close"]
        assert closes and closes[0]["session"] == "unread" and closes[0]["reason"] == "idle", worker.sent
        assert all(m["session"] != "read" for m in closes)
        assert unread.dropped == "idle" and unread.buffered == 0 and _only_end(unread, "idle")
    finally:
        manager.stop()
        loop.close()


def _only_end(sess: StreamSession, reason: str) -> bool:
    """The session's queue holds its end alone, with ``reason``."""
    kind, payload = sess.events.get_nowait()
    return sess.events.empty() and kind == "end" and f'"reason":"{reason}"' in payload.decode()


def test_a_client_that_reads_too_slowly_is_closed_and_its_chunks_freed() -> None:
    """Past the send buffer the waiting chunks are dropped at once, the worker's session is closed (reason
    backpressure) and later chunks are not queued; a session read in time never gets there."""
    worker = FakeWorker()
    manager = SessionManager(_cfg(), worker)
    loop = asyncio.new_event_loop()
    try:
        slow = StreamSession("slow", loop, limit_bytes=1000, on_drop=manager.close)
        manager.sessions["slow"] = slow
        for _ in range(3):
            slow.put("chunk", b"x" * 400)
            loop.run_until_complete(asyncio.sleep(0))
        assert slow.dropped == "backpressure" and slow.buffered == 0
        slow.put("chunk", b"x" * 400)  # the worker's next chunk, before its close lands
        loop.run_until_complete(asyncio.sleep(0))
        assert _only_end(slow, "backpressure")
        assert [(m["session"], m["reason"]) for m in worker.sent if m["op"] == "session_close"] == \
            [("slow", "backpressure")]
        kept = StreamSession("kept", loop, limit_bytes=1000, on_drop=manager.close)
        for _ in range(5):
            kept.put("chunk", b"x" * 400)
            loop.run_until_complete(kept.take())
        assert kept.dropped is None and kept.buffered == 0
    finally:
        manager.stop()
        loop.close()


def test_a_refusal_and_a_dead_worker_end_the_stream_with_their_reason() -> None:
    worker = FakeWorker()
    manager = SessionManager(_cfg(), worker)
    loop = asyncio.new_event_loop()
    try:
        for reply, outcome in (({"op": "error", "kind": "busy", "message": "all 2 session slots are taken"}, "refused"),
                               ({"op": "session_end", "outcome": "failed", "reason": "oom", "chunks": 0,
                                 "message": "KV cache out of memory"}, "failed")):
            sess = StreamSession(outcome, loop)
            fut: Future[Any] = Future()
            fut.set_result(reply)
            manager._ended(sess, fut)
            loop.run_until_complete(asyncio.sleep(0))
            kind, payload = sess.events.get_nowait()
            assert sess.ended and kind == "end" and f'"outcome":"{outcome}"' in payload.decode(), payload
    finally:
        manager.stop()
        loop.close()


def test_stream_config_and_knobs_refuse_what_the_pipeline_cannot_run() -> None:
    with pytest.raises(ConfigError, match="kv_cache"):
        _cfg(kv_cache=False)
    with pytest.raises(ConfigError, match="default_size"):
        _cfg(default_size="256x256")
    with pytest.raises(ConfigError, match="default_chunks"):
        _cfg(default_chunks=40)
    assert not parse({"ranks": 2, "stream": {"enabled": True}}).stream_active  # one rank only
    for bad, param in (({"stream_window_chunks": 1}, "stream_window_chunks"),
                       ({"stream_steps": 0}, "stream_steps"), ({"stream_kv_cache": False}, "stream_kv_cache")):
        with pytest.raises(knobs.KnobError) as e:
            knobs.validate(bad, 1, stream=True)
        assert e.value.param == param
    with pytest.raises(knobs.KnobError, match="no streaming"):
        knobs.validate({"stream_steps": 8}, 1, stream=False)
    assert knobs.validate({"stream_window_chunks": 8, "stream_steps": 16}, 1, stream=True)


def test_chunk_frames_follow_the_causal_vae() -> None:
    from stepwatch.service.stream_worker import frames_per_chunk, partition

    assert partition(4) == [1, 2, 2, 2]
    assert frames_per_chunk(4) == [1, 8, 8, 8]  # 1 + 4 (T - 1) frames in all: 25 for 7 latent frames
    assert sum(frames_per_chunk(8)) == 1 + 4 * (sum(partition(8)) - 1)


def test_the_session_event_goes_out_before_a_chunk_that_arrived_while_open_returned() -> None:
    loop = asyncio.new_event_loop()
    try:
        sess = StreamSession("s", loop)
        sess.events.put_nowait(("chunk", b"chunk 0"))  # queued while open() held the session event
        sess.first = ("session", b"session")
        order = [loop.run_until_complete(sess.take())[0] for _ in range(2)]
        assert order == ["session", "chunk"]
    finally:
        loop.close()
