"""The service's HTTP layer in-process (FastAPI's TestClient, a stand-in worker): status codes, headers and
messages as the API pins them, the OpenAPI schema, and `stepwatch serve`'s config wiring."""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from stepwatch import httpclient
from stepwatch.service import api, app, cli_serve, knobs
from stepwatch.service.app import create_app
from stepwatch.service.config import parse
from stepwatch.service.engine import Service

TOKEN = "test-admin-token"
CFG = parse({"pools": {"small": {"sizes": ["256x256"], "slo_seconds": 10}}, "warmup": [], "admin_token": TOKEN})


class AnsweringWorker:
    """Stands in for the worker process: answers generate, knobs and info at once."""

    def __init__(self, ready: bool = True) -> None:
        self.ready = threading.Event()
        if ready:
            self.ready.set()
        self.ready_info = None
        self.seen: list[dict[str, Any]] = []

    def call(self, msg: dict[str, Any]) -> Future[dict[str, Any]]:
        fut: Future[dict[str, Any]] = Future()
        self.seen.append(msg)
        replies = {
            "generate": {"op": "result", "seconds": 0.01, "images": [b"png"], "stages": {"denoise": 0.01},
                         "shape": "256x256_4s", "steps": 4, "cache": None, "nonfinite": 0},
            "knobs": {"op": "knobs", "knobs": msg.get("knobs"), "fingerprint": {"model": "m"}},
            "info": {"op": "info", "pid": 1, "rss_bytes": 2, "vm_bytes": 3, "budget_bytes": None},
        }
        fut.set_result(replies[msg["op"]])
        return fut

    def alive(self) -> bool:
        return self.ready.is_set()

    def kill(self) -> None:
        pass

    def stop(self) -> None:
        pass


def service(ready: bool = True, **cfg: Any) -> Service:
    svc = Service(parse({**CFG.to_raw(), **cfg}) if cfg else CFG, CollectorRegistry())
    svc.worker = AnsweringWorker(ready)
    return svc


@pytest.fixture
def client() -> Iterator[TestClient]:
    svc = service()
    svc._dispatcher.start()
    with TestClient(create_app(svc), client=("127.0.0.1", 40000)) as c:
        yield c
    svc._stop.set()


def test_generation_answers_in_openai_shape(client: TestClient) -> None:
    r = client.post("/v1/images/generations", json={"prompt": "a", "size": "256x256", "seed": 3, "steps": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["data"] == [{"b64_json": "cG5n"}]
    assert body["stepwatch"]["pool"] == "small" and body["stepwatch"]["seed"] == 3
    assert r.headers.get("connection") != "close"  # keep-alive on answers


def test_openapi_lists_the_images_endpoint(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    post = schema["paths"]["/v1/images/generations"]["post"]
    body = post["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["prompt"]
    assert {"size", "n", "steps", "seed", "guidance_scale"} <= set(body["properties"])
    assert {"400", "411", "413", "429", "503", "507"} <= set(post["responses"])


@pytest.mark.parametrize("method,path,allow", [
    ("GET", "/v1/images/generations", "POST"),
    ("PUT", "/v1/images/generations", "POST"),
    ("DELETE", "/admin/knobs", "POST"),
    ("POST", "/healthz", "GET"),
    ("PATCH", "/metrics", "GET"),
])
def test_wrong_method_gets_405_with_allow(client: TestClient, method: str, path: str, allow: str) -> None:
    r = client.request(method, path)
    assert r.status_code == 405
    assert r.headers["allow"] == allow
    assert r.json()["error"]["message"] == f"use {allow} for {path}"
    assert r.json()["error"]["code"] == "method_not_allowed"


def test_unknown_path_is_404_in_the_error_shape(client: TestClient) -> None:
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["message"] == "no such path /nope"


def test_body_without_length_is_411_and_too_large_is_413(client: TestClient) -> None:
    r = client.post("/v1/images/generations", content=iter([b'{"prompt": "a"}']))  # chunked: no Content-Length
    assert r.status_code == 411 and r.json()["error"]["code"] == "length_required"
    assert r.headers["connection"] == "close"  # the body may be unread
    r = client.post("/v1/images/generations", content=b" " * (64 * 1024 + 1))
    assert r.status_code == 413 and "the limit is 65536" in r.json()["error"]["message"]


@pytest.mark.parametrize("body,message,param", [
    ({"size": "256x256"}, "'prompt' is required", "prompt"),
    ({"prompt": "a", "n": "two"}, "'n' must be an integer, got str", "n"),
    ({"prompt": "a", "size": "250x256"}, "'size' '250x256': width and height must be positive multiples of 16", "size"),
])
def test_bad_input_is_400_naming_the_field_not_422(client: TestClient, body: Any, message: str, param: str) -> None:
    r = client.post("/v1/images/generations", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == message and r.json()["error"]["param"] == param


def test_not_ready_is_503_with_retry_after() -> None:
    with TestClient(create_app(service(ready=False))) as c:
        r = c.post("/v1/images/generations", json={"prompt": "a"})
        assert r.status_code == 503 and r.headers["retry-after"] == "10"
        assert c.get("/readyz").status_code == 503


def test_overload_is_429_with_retry_after() -> None:
    svc = service(queue={"max_queued": 1})
    svc.scheduler.submit(api.GenerationRequest("p", 1, 256, 256, 4, 1.0, 0), "small")  # no dispatcher: stays queued
    with TestClient(create_app(svc)) as c:
        r = c.post("/v1/images/generations", json={"prompt": "a", "size": "256x256"})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"


def test_admin_knobs_guard_and_validation(client: TestClient) -> None:
    assert client.post("/admin/knobs", json={"vae_tiling": True}).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = client.post("/admin/knobs", json={"colour": "blue"}, headers=auth)
    assert r.status_code == 400 and "unknown knob 'colour'" in r.json()["error"]["message"]
    r = client.post("/admin/knobs", json={"vae_tiling": False}, headers=auth)
    assert r.status_code == 200 and r.json()["knobs"] == {"vae_tiling": False}
    with TestClient(client.app) as remote:  # the default test client is not on loopback
        assert remote.post("/admin/knobs", json={"vae_tiling": True}, headers=auth).status_code == 403


@pytest.mark.parametrize("path,raw,param", [
    ("/admin/knobs", b'{"\\ud800": 1}', "\ud800"),  # the unknown knob is named in param
    ("/admin/knobs", b'{"baselines": {"\\ud800": {}}}', "baselines"),
    ("/v1/images/generations", b'{"prompt": "\\ud800"}', "prompt"),
    ("/v1/images/generations", b'{"prompt": "a", "size": "\\ud800x512"}', "size"),
    ("/v1/images/generations", b'{"prompt": "a", "size": "\\u00b2x512"}', "size"),
])
def test_lone_surrogates_and_odd_digits_get_400_not_500(client: TestClient, path: str, raw: bytes,
                                                        param: str) -> None:
    r = client.post(path, content=raw, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.content.isascii()


def test_knob_validation_is_shared() -> None:
    with pytest.raises(knobs.KnobError) as e:
        knobs.validate({"rank_delay_seconds": {"1": 0.5}}, ranks=1)
    assert e.value.param == "rank_delay_seconds"
    assert knobs.validate({"cache_threshold": 0.3, "rank_delay_seconds": {"1": 0.5}}, ranks=2)
    bad: dict[str, Any]
    for bad in ({"cache_threshold": float("nan")}, {"cache": "teacache"}, {"baselines": {"shapes": {"x": {}}}},
                {"vae_tiling": 1}, {}):
        with pytest.raises(knobs.KnobError):
            knobs.validate(bad, ranks=1)


def serve_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli_serve.add_arguments(p)
    return p.parse_args(argv)


def test_serve_honours_the_config_files_port(tmp_path: Path) -> None:
    conf = tmp_path / "service.yaml"
    conf.write_text(yaml.safe_dump({"port": 8123, "host": "127.0.0.2"}))
    cfg = cli_serve.config_from_args(serve_args("--config", str(conf)))
    assert (cfg.port, cfg.host) == (8123, "127.0.0.2")
    assert cli_serve.config_from_args(serve_args("--config", str(conf), "--port", "8124")).port == 8124
    assert cli_serve.config_from_args(serve_args("--config", str(conf), "--port", "8000")).port == 8000
    conf.write_text(yaml.safe_dump({"warmup": []}))
    assert cli_serve.config_from_args(serve_args("--config", str(conf))).port == 8000


# ----- over a real uvicorn (in a thread): connections, disconnects, timeouts ------------------------------------
@contextmanager
def live(svc: Service, client_timeout: float = 60.0) -> Iterator[int]:
    """``svc``'s API served by uvicorn in a thread, as ``stepwatch serve`` serves it; yields the port."""
    sock = app.bind("127.0.0.1", 0)
    server = app.make_server(svc, client_timeout)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        sock.close()
        svc._stop.set()


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def raw_post(port: int, body: bytes, length: int | None = None) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % (len(body) if length is None else length) + body)
    return s


def read_to_eof(s: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection (fails if it does not within ``timeout``)."""
    s.settimeout(timeout)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def depth(svc: Service) -> float:
    return svc.scheduler.snapshot()["small"]["depth"]


def patient(**cfg: Any) -> Service:
    """A service whose small pool never 429s in these tests; no dispatcher: what is admitted stays queued."""
    return service(pools={"small": {"sizes": ["256x256"], "slo_seconds": 10, "max_wait_seconds": 10000}},
                   queue={"max_queued": 500}, **cfg)


GEN = json.dumps({"prompt": "a", "size": "256x256"}).encode()


def test_a_client_that_disconnects_while_queued_is_cancelled_and_never_runs() -> None:
    svc = patient()
    with live(svc) as port:
        s = raw_post(port, GEN)
        wait_for(lambda: depth(svc) == 1)
        s.close()
        wait_for(lambda: depth(svc) == 0)  # out of the queue at once: it no longer counts toward 429s
        svc._dispatcher.start()
        time.sleep(0.3)
    assert not [m for m in svc.worker.seen if m["op"] == "generate"]  # type: ignore[attr-defined]
    assert svc.m.service_requests_total.labels(pool="small", code="499")._value.get() == 1


def test_health_and_metrics_answer_while_many_generations_wait() -> None:
    svc = patient()
    with live(svc) as port:
        waiting = [raw_post(port, GEN) for _ in range(60)]  # past anyio's 40 default threads
        wait_for(lambda: depth(svc) == 60)
        url = f"http://127.0.0.1:{port}"
        for path in ("/healthz", "/readyz", "/metrics"):
            assert httpclient.request("GET", url + path, timeout=3).status_code == 200, path
        r = httpclient.request("POST", url + "/v1/images/generations", content=b'{"prompt": 1}', timeout=3)
        assert r.status_code == 400  # admission is not stuck behind the waiting ones either
        for s in waiting:
            s.close()
        wait_for(lambda: depth(svc) == 0)


def test_a_client_that_stalls_is_cut_off() -> None:
    svc = patient()
    with live(svc, client_timeout=0.5) as port:
        silent = socket.create_connection(("127.0.0.1", port))
        half_head = socket.create_connection(("127.0.0.1", port))
        half_head.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\n")
        half_body = raw_post(port, b'{"prompt"', length=40)
        t0 = time.monotonic()
        assert read_to_eof(silent) == b"" and read_to_eof(half_head) == b""
        answer = read_to_eof(half_body)
        assert answer.startswith(b"HTTP/1.1 408 ") and b"connection: close" in answer.lower()
        assert b"did not arrive within 0.5s" in answer
        assert time.monotonic() - t0 < 4
        assert depth(svc) == 0


def test_an_error_answers_and_closes_without_reading_the_body() -> None:
    with live(patient()) as port:
        s = raw_post(port, b"", length=api.MAX_BODY_BYTES + 1)  # 413 before any body is sent
        answer = read_to_eof(s)
        assert answer.startswith(b"HTTP/1.1 413 ") and b"connection: close" in answer.lower()
        assert b"content-type: application/json" in answer.lower()
