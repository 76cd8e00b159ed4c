"""Streaming sessions over real HTTP against the real service (one start): sessions read as they stream, a prompt
changed mid-session, a close, a refusal past the slots, and the chunk series on /metrics against what the
clients saw (chunks observed = chunks delivered, KV bytes back to idle, first-chunk latency within 10%)."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from stepwatch.sse import parse_sse
from tests.promtext import total, value
from tests.servicefixture import ServiceProc
from tests.test_exposition_lint import assert_lint_clean
from tests.test_service_sessions import FUZZ, assert_client_safe

OVERRIDES = {"compile": {"enabled": False}, "warmup": ["256x256"], "video": {"enabled": False},
             "stream": {"enabled": True, "max_sessions": 2, "sizes": ["64x64", "128x128"]}}


@dataclass
class Seen:
    """What one client saw of its session."""

    status: int = 0
    id: str = ""
    fps: int | None = None
    first_frames_s: float | None = None
    chunks: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] = field(default_factory=dict)
    prompt_ack: dict[str, Any] = field(default_factory=dict)
    close_ack: dict[str, Any] = field(default_factory=dict)


def run_session(client: httpx.Client, url: str, body: dict[str, Any], seen: Seen, change_at: int | None = None,
                close_at: int | None = None, started: threading.Event | None = None) -> None:
    """Open a session and read it to its end; change the prompt after chunk ``change_at``, close after ``close_at``."""
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/stream/sessions", json=body, timeout=120) as r:
        seen.status = r.status_code
        if r.status_code != 200:
            r.read()
            seen.end = r.json()
            return
        for kind, data in parse_sse(r.iter_lines()):
            if kind == "session":
                seen.id, seen.fps = data["id"], data.get("fps")
                if started is not None:
                    started.set()
            elif kind == "chunk":
                if seen.first_frames_s is None:
                    seen.first_frames_s = time.perf_counter() - t0
                seen.chunks.append({k: data[k] for k in ("index", "prompt_version")} | {"frames": len(data["frames"])})
                if data["index"] == change_at:
                    seen.prompt_ack = client.post(f"{url}/v1/stream/sessions/{seen.id}/prompt",
                                                  json={"prompt": "a red kite over a grey sea"}).json()
                if data["index"] == close_at:
                    seen.close_ack = client.delete(f"{url}/v1/stream/sessions/{seen.id}").json()
            elif kind == "end":
                seen.end = data


def stream_counts(svc: ServiceProc) -> dict[str, float]:
    m = svc.metrics()
    c = {o: value(m, "stepwatch_stream_sessions_total", outcome=o) for o in ("done", "closed", "failed")}
    c["chunks"] = value(m, "stepwatch_stream_chunk_duration_seconds_count")
    c["first_n"] = value(m, "stepwatch_stream_first_chunk_seconds_count")
    c["first_sum"] = value(m, "stepwatch_stream_first_chunk_seconds_sum")
    c["kv"] = total(m, "stepwatch_stream_kv_cache_bytes")
    c["ledger"] = value(m, "stepwatch_stream_kv_cache_ledger_bytes")
    c["active"] = value(m, "stepwatch_stream_sessions_active")
    return c


@pytest.mark.heavy
def test_streaming_sessions_over_http(tmp_path: Path) -> None:
    svc = ServiceProc(tmp_path, OVERRIDES)
    try:
        with httpx.Client() as client:
            client.get(svc.url + "/readyz")  # the connection and the client's set-up, outside the timing
            before = stream_counts(svc)
            assert before["kv"] == 0 and before["active"] == 0 and before["chunks"] == 0
            _first_chunk_matches_the_client(svc, client, before)
            _two_sessions_a_change_a_close_and_a_refusal(svc, client)
            _a_window_past_the_kv_memory_fails_that_session(svc, client)
            _bad_bodies_get_clean_400s(svc, client)
        m = svc.metrics()
        assert total(m, "stepwatch_compile_total", phase="serving") == 0  # both stream sizes were warmed up
        assert_lint_clean(svc.get("/metrics")[1], "the service with streaming sessions")
    finally:
        svc.close()


def _bad_bodies_get_clean_400s(svc: ServiceProc, client: httpx.Client) -> None:
    """Every fuzz body, sent as bytes (a lone surrogate travels as its JSON escape), gets a 400 in OpenAI's shape
    that names the field and carries no traceback or path; a prompt change is checked before the session is
    looked up."""
    for body, param in FUZZ:
        r = client.post(svc.url + "/v1/stream/sessions", content=json.dumps(body),
                        headers={"content-type": "application/json"})
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), body
        assert_client_safe(r.json())
    r = client.post(svc.url + "/v1/stream/sessions/0123/prompt", content=json.dumps({"prompt": "\ud800"}),
                    headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert_client_safe(r.json())


def _first_chunk_matches_the_client(svc: ServiceProc, client: httpx.Client, before: dict[str, float]) -> None:
    """One session alone at 128x128: /metrics' first-chunk latency within 10% of the client's wait."""
    seen = Seen()
    run_session(client, svc.url, {"prompt": "a lighthouse at dusk", "size": "128x128", "chunks": 4}, seen)
    assert seen.status == 200 and seen.end["outcome"] == "done", seen
    assert [c["frames"] for c in seen.chunks] == [1, 8, 8, 8]
    assert seen.fps == 16  # the config's stream.fps: what the player plays the frames at
    after = stream_counts(svc)
    assert after["first_n"] - before["first_n"] == 1
    served = after["first_sum"] - before["first_sum"]
    assert seen.first_frames_s is not None
    print(f"first chunk: /metrics {served:.4f} s, client {seen.first_frames_s:.4f} s")
    assert abs(served - seen.first_frames_s) <= 0.10 * seen.first_frames_s, (served, seen.first_frames_s)


def _two_sessions_a_change_a_close_and_a_refusal(svc: ServiceProc, client: httpx.Client) -> None:
    before = stream_counts(svc)
    a, b = Seen(), Seen()
    a_started, b_started = threading.Event(), threading.Event()
    ta = threading.Thread(target=run_session, args=(httpx.Client(), svc.url, {"prompt": "a cat", "chunks": 16}, a),
                          kwargs={"change_at": 1, "started": a_started})
    tb = threading.Thread(target=run_session, args=(httpx.Client(), svc.url, {"prompt": "a dog", "chunks": 32}, b),
                          kwargs={"close_at": 3, "started": b_started})
    ta.start()
    tb.start()
    assert a_started.wait(60) and b_started.wait(60)
    refused = Seen()
    run_session(client, svc.url, {"prompt": "a third"}, refused)  # both slots are taken
    ta.join(120)
    tb.join(120)
    assert refused.status == 429 and "slots" in refused.end["error"]["message"], refused
    # A: every chunk, the new prompt from the chunk the server named on.
    assert {k: a.end[k] for k in ("outcome", "reason", "chunks", "message")} == {
        "outcome": "done", "reason": "done", "chunks": 16, "message": ""}, a.end
    # The session's own KV cache, from its tensors, is the ledger's (64x64 x 16 chunks, window 3: 208 tokens).
    assert a.end["kv_bytes"] == a.end["kv_ledger_bytes"] == 2 * 24 * 2 * 4 * (3 * 2 * 16 + 14 * 2 * 4), a.end
    assert [c["index"] for c in a.chunks] == list(range(16))
    applies = a.prompt_ack["applies_from"]
    assert 2 <= applies < 16, a.prompt_ack
    assert [c["prompt_version"] for c in a.chunks] == [0] * applies + [1] * (16 - applies)
    # B: closed by its client after chunk 3; it stops within a chunk.
    assert b.end["outcome"] == "closed" and b.end["reason"] == "closed", b.end
    assert 4 <= len(b.chunks) == b.end["chunks"] <= 6, b
    after = _settled(svc, before)
    assert after["chunks"] - before["chunks"] == len(a.chunks) + len(b.chunks)  # observed = delivered
    assert after["done"] - before["done"] == 1 and after["closed"] - before["closed"] == 1
    assert after["failed"] == before["failed"]
    assert after["kv"] == 0 and after["ledger"] == 0 and after["active"] == 0  # the KV cache left with the calls


def _a_window_past_the_kv_memory_fails_that_session(svc: ServiceProc, client: httpx.Client) -> None:
    """Window 32 at 128x128 x 32 chunks needs 1,585,152 KV bytes by the ledger, past the 1.25 MiB the worker
    gives its sessions: that session fails at once as an out-of-memory of stage kv_cache; the next one runs."""
    status, answer, _ = svc.knobs(stream_kv_cache=False)
    assert status == 400 and answer["error"]["param"] == "stream_kv_cache", answer
    status, answer, _ = svc.knobs(stream_window_chunks=32)
    assert status == 200 and answer["knobs"]["stream_window_chunks"] == 32, answer
    m = svc.metrics()
    assert value(m, "stepwatch_service_knob_override_active", knob="stream_window_chunks") == 1
    assert value(m, "stepwatch_stream_kv_cache_capacity_bytes") == 1.25 * 2**20
    big = Seen()
    run_session(client, svc.url, {"prompt": "a long take", "size": "128x128", "chunks": 32}, big)
    assert big.status == 200 and big.chunks == [], big
    assert big.end["outcome"] == "failed" and big.end["reason"] == "oom", big.end
    assert "KV cache out of memory" in big.end["message"] and "1,585,152" in big.end["message"], big.end
    assert "stream_window_chunks" in big.end["message"]  # the fix
    assert total(svc.metrics(), "stepwatch_oom_total", stage="kv_cache") == 1
    svc.knobs(stream_window_chunks=3)
    after = Seen()
    run_session(client, svc.url, {"prompt": "a long take", "size": "128x128", "chunks": 4}, after)
    assert after.end["outcome"] == "done" and len(after.chunks) == 4, after.end
    assert value(svc.metrics(), "stepwatch_stream_sessions_total", outcome="failed") == 1


def _settled(svc: ServiceProc, before: dict[str, float], timeout: float = 10) -> dict[str, float]:
    """The counts once both sessions' ends are on /metrics (a session's end is recorded as its thread ends)."""
    deadline = time.monotonic() + timeout
    while True:
        now = stream_counts(svc)
        if now["done"] + now["closed"] - before["done"] - before["closed"] >= 2 or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def _open_unread(port: int, body: dict[str, Any]) -> socket.socket:
    """A session whose client reads its headers and first event, then nothing: a small receive window, so what
    waits for it waits in the server, not in the kernel."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(f"POST /v1/stream/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    return s


def _http_rss_mb(svc: ServiceProc) -> float:
    """Resident memory of the service's HTTP process (its worker is another process)."""
    status = Path(f"/proc/{svc.proc.pid}/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS:")).split()[1]) / 1024


@pytest.mark.heavy
def test_unread_sessions_are_closed_and_their_memory_given_back(tmp_path: Path) -> None:
    """Twenty clients that stop reading (two at a time, the slots): each session is closed once a MiB waits for
    its client (outcome closed, reason backpressure), and the HTTP process's memory after they are gone is within
    10% of what it was after one session read to its end."""
    stream = {**OVERRIDES["stream"], "send_buffer_mb": 1, "idle_timeout_seconds": 10}
    svc = ServiceProc(tmp_path, {**OVERRIDES, "stream": stream})
    big = {"prompt": "a harbour at night", "size": "128x128", "chunks": 32}
    try:
        with httpx.Client() as client:
            seen = Seen()
            run_session(client, svc.url, {**big, "chunks": 8}, seen)
            assert seen.end["outcome"] == "done", seen
        time.sleep(1)
        before, closed0 = _http_rss_mb(svc), stream_counts(svc)["closed"]
        for i in range(10):
            socks = [_open_unread(svc.port, big) for _ in range(2)]
            deadline = time.monotonic() + 120
            while stream_counts(svc)["closed"] < closed0 + 2 * (i + 1) and time.monotonic() < deadline:
                time.sleep(0.5)
            for s in socks:
                s.close()
        time.sleep(2)
        after, counts = _http_rss_mb(svc), stream_counts(svc)
        assert counts["closed"] - closed0 == 20 and counts["active"] == 0, counts
        assert after <= 1.10 * before, (before, after)
        assert "backpressure" in svc.log()
    finally:
        svc.close()
