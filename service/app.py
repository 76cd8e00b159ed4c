"""The practice service's HTTP API: FastAPI, served by uvicorn (the stack vLLM and SGLang serve on).

Endpoints: ``POST /v1/images/generations`` (OpenAI's images API), video jobs (``POST /v1/videos``,
``GET /v1/videos/{id}``, ``GET /v1/videos/{id}/content``, ``DELETE /v1/videos/{id}``), streaming sessions
(``POST /v1/stream/sessions``, ``POST /v1/stream/sessions/{id}/prompt``, ``DELETE /v1/stream/sessions/{id}``;
service/sessions.py), ``GET /healthz``,
``/readyz``, ``/metrics``, ``/v1/stepwatch/info``, ``POST /admin/knobs`` (only
with an admin token, loopback only) and ``GET /openapi.json``.

The request body is read and checked here by hand rather than by a Pydantic
body parameter, because the answers are pinned: 411 without a Content-Length,
413 past the limit before the body is read, and a 400 in OpenAI's error shape
naming the field (``api.validate``), where Pydantic would answer 422 in its
own.  ``ImagesRequest`` is the typed model of that body for the OpenAPI schema.
Errors close the connection (the body may be unread); answers keep it alive.

The ``Service`` blocks (on the queue's lock and the worker): its calls run on
worker threads, never on the event loop.  A generation holds a thread only to be
admitted and to be answered; while it waits in the queue or on the worker it is
an asyncio wait on its ticket, raced against the client's disconnect: a client
that goes away has its queued request cancelled (it never runs) and taken out of
the queue.  ``/healthz`` and ``/readyz`` are async and ``/metrics`` has its own
threads, so they answer however many generations wait.

Clients that stall are cut off after a socket timeout
(uvicorn alone times out only idle keep-alive connections): a connection that
sends no request head for ``CLIENT_TIMEOUT`` seconds is closed, and a body that
has not arrived by then gets a 408.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from types import FrameType
from typing import Any, Literal, TypeVar

import anyio
import h11
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from stepwatch import versions
from stepwatch.exposition import CONTENT_TYPE
from stepwatch.service import api, app_videos
from stepwatch.service.engine import Admission, Answer, Service
from stepwatch.service.http import (
    ERRORS,
    AsciiJSON,
    ClientGone,
    error_response,
    in_thread,
    internal_error,
    read_body,
    service_of,
)
from stepwatch.service.messages import Reply
from stepwatch.service.sessions import SessionManager, StreamSession
from stepwatch.service.stall import restart_due

log = logging.getLogger("stepwatch.service")
T = TypeVar("T")
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")  # the last: an IPv4 client of a dual-stack "::" socket
CLIENT_TIMEOUT = 60.0  # seconds a client may stall sending a request head or body


class ImagesRequest(BaseModel):
    """``POST /v1/images/generations``: OpenAI's fields plus ``steps``, ``guidance_scale`` and ``seed``.
    Other OpenAI fields (model, quality, style, user) are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    prompt: str = Field(min_length=1, max_length=api.MAX_PROMPT_CHARS)
    n: int = Field(1, ge=1, description="images per request, up to the config's max_n")
    size: str | None = Field(None, pattern=r"^\d+x\d+$", description="WxH, multiples of 16 (default: the config's)")
    response_format: Literal["b64_json"] = "b64_json"
    steps: int | None = Field(None, ge=1, description="denoising steps, up to the config's max_steps")
    guidance_scale: float = Field(1.0, ge=0.0, le=30.0, description="> 1 runs classifier-free guidance")
    seed: int | None = Field(None, ge=0, le=2**32 - 1, description="same deployment + same seed: same image")


class ImageData(BaseModel):
    b64_json: str


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    stepwatch: dict[str, Any] = Field(description="shape, pool, queue and stage seconds, cache hits, fingerprint")


IMAGES_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": ImagesRequest.model_json_schema()}}}}

router = APIRouter()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (call it once the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _wait(request: Request, svc: Service, adm: Admission) -> Reply:
    """The worker's reply to an admitted request, waited for without a thread; a client that disconnects
    first, or a wait past the limit (504), abandons the request: still queued, it is cancelled and dropped."""
    waiter = asyncio.wrap_future(adm.ticket.future)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({waiter, gone}, timeout=svc.answer_timeout(adm),
                                     return_when=asyncio.FIRST_COMPLETED)
        if waiter in done:
            return waiter.result()  # or the ApiError the dispatcher set (503 worker died, 504)
        if gone in done:
            raise ClientGone
        raise svc.timed_out()
    finally:
        gone.cancel()
        if not waiter.done():
            svc.abandon(adm)
            waiter.cancel()


async def _generate(request: Request, svc: Service, body: dict[str, Any]) -> Answer:
    adm = await in_thread(request, svc.admit, body)  # validation and the queue's lock: a thread, briefly
    reply = await _wait(request, svc, adm)
    return await in_thread(request, svc.finish, adm, reply)  # base64 of the images: a thread


@router.post("/v1/images/generations", response_model=ImagesResponse, responses=ERRORS, openapi_extra=IMAGES_BODY)
async def generations(request: Request) -> Response:
    """Generate images; counted in the service's request metrics whatever the outcome."""
    svc = service_of(request)
    t0 = time.monotonic()
    pool, status = "other", 500
    try:
        body = api.parse_json(await read_body(request))
        pool = svc.pool_of(body)
        status, answer, headers = await _generate(request, svc, body)
        response: Response = AsciiJSON(answer, status, headers)
    except ClientGone:
        status, response = 499, Response(status_code=499)  # nobody to answer
    except api.ApiError as e:
        status, response = e.status, error_response(e)
    except Exception as e:  # never take the instance down for one request
        log.exception("unexpected error serving a request")
        status, response = 500, error_response(internal_error(e))
    if await request.is_disconnected():
        status = 499  # the client went away before the answer
    svc.count(pool, status, t0)
    return response


class SessionRequest(BaseModel):
    """``POST /v1/stream/sessions``: open a streaming session; the answer is its event stream."""

    prompt: str = Field(min_length=1, max_length=api.MAX_PROMPT_CHARS)
    size: str | None = Field(None, description="one of the service's stream sizes (GET /v1/stepwatch/info)")
    chunks: int | None = Field(None, ge=2, description="chunks in the session (default and maximum: the config's)")
    steps: int | None = Field(None, ge=1, description="denoising steps per chunk")
    seed: int | None = Field(None, ge=0, le=2**32 - 1)


SESSION_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": SessionRequest.model_json_schema()}}}}


def _sessions(request: Request) -> SessionManager:
    svc = service_of(request)
    if svc.sessions is None:
        raise api.ApiError(404, "streaming sessions are off on this service (stream.enabled)", None, "not_found")
    if not svc.ready:
        raise api.ApiError(503, "warming up", None, "unavailable", "server_error", {"Retry-After": "5"})
    return svc.sessions


@router.post("/v1/stream/sessions", responses=ERRORS, openapi_extra=SESSION_BODY)
async def open_session(request: Request) -> Response:
    """Open a streaming session: server-sent events ``session``, one ``chunk`` per chunk as it is done, ``end``.
    The session stops when its client goes away or stops reading (the idle timeout)."""
    try:
        manager = _sessions(request)
        sess = await manager.open(api.parse_json(await read_body(request)))
    except ClientGone:
        return Response(status_code=499)
    except api.ApiError as e:
        return error_response(e)
    except Exception as e:  # never take the instance down for one session
        log.exception("unexpected error opening a session")
        return error_response(internal_error(e))
    return StreamingResponse(_session_events(manager, sess), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


async def _session_events(manager: SessionManager, sess: StreamSession) -> AsyncIterator[bytes]:
    """The session's events until its ``end``; a client that leaves first closes the session."""
    try:
        while True:
            kind, payload = await sess.take()
            yield payload
            if kind == "end":
                return
    finally:
        if not sess.ended:
            manager.close(sess.id, "closed")  # no await here: this may run as the stream is cancelled
        manager.forget(sess.id)


async def _session_call(request: Request, what: str, call: Callable[[SessionManager], Callable[..., Any]],
                        *args: Any, with_body: bool = False) -> Response:
    """One blocking SessionManager call on a thread (after reading the body if it takes one), answered as JSON."""
    try:
        manager = _sessions(request)
        if with_body:
            args = (*args, api.parse_json(await read_body(request)))
        return AsciiJSON(await anyio.to_thread.run_sync(partial(call(manager), *args)))
    except ClientGone:
        return Response(status_code=499)
    except api.ApiError as e:
        return error_response(e)
    except Exception as e:
        log.exception("session %s failed", what)
        return error_response(internal_error(e))


@router.post("/v1/stream/sessions/{session_id}/prompt", responses=ERRORS)
async def session_prompt(request: Request, session_id: str) -> Response:
    """Change a running session's prompt; the answer says from which chunk on it applies."""
    return await _session_call(request, "prompt change", lambda m: m.set_prompt, session_id, with_body=True)


@router.delete("/v1/stream/sessions/{session_id}", responses=ERRORS)
async def close_session(request: Request, session_id: str) -> Response:
    """Close a session: it stops at its next step and its stream ends with ``end`` (outcome closed)."""
    return await _session_call(request, "close", lambda m: m.close_and_wait, session_id)


@router.post("/admin/knobs", responses=ERRORS)
async def admin_knobs(request: Request) -> Response:
    """Change runtime knobs (cache, threshold, VAE tiling, compile, baselines, rank delays)."""
    svc = service_of(request)
    try:
        _check_admin(svc, request)
        knobs = api.parse_json(await read_body(request))
        # The default threads (with /info), not the generation limiter: a knob change waits on the worker.
        return AsciiJSON(await anyio.to_thread.run_sync(svc.set_knobs, knobs))
    except ClientGone:
        return Response(status_code=499)
    except api.ApiError as e:
        return error_response(e)
    except Exception as e:
        log.exception("admin request failed")
        return error_response(internal_error(e))


def _check_admin(svc: Service, request: Request) -> None:
    token = svc.cfg.admin_token
    if not token:
        raise api.ApiError(404, "admin endpoint is off (no admin_token configured)", None, "not_found")
    if request.client is None or request.client.host not in LOOPBACK:
        raise api.ApiError(403, "admin endpoint is loopback only", None, "forbidden")
    auth = request.headers.get("authorization", "")
    if not hmac.compare_digest(auth.encode(), f"Bearer {token}".encode()):
        raise api.ApiError(401, "missing or wrong admin token", None, "unauthorized")


@router.get("/healthz")
async def healthz(request: Request) -> JSONResponse:
    """Alive unless the worker is hung past the restart point (the service is restarting it then)."""
    svc = service_of(request)
    busy = svc.inflight.busy()
    if restart_due(busy, svc.stall):
        return AsciiJSON({"status": "stalled", "worker_up": svc.worker.alive(),
                          "stalled_seconds": round(busy.seconds if busy else 0.0, 1)}, 503)
    return AsciiJSON({"status": "ok", "worker_up": svc.worker.alive()}, 200)


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Ready once warmed up, and not while the worker is stalled on a generation (StepwatchWorkerStalled)."""
    svc = service_of(request)
    stalled = svc.stalled_seconds()
    ready = svc.ready and not stalled
    body: dict[str, Any] = {"ready": ready}
    if stalled:
        body["stalled_seconds"] = round(stalled, 1)
    return AsciiJSON(body, 200 if ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    # On threads of its own (it asks the worker's exporter over HTTP): never behind /info or generations.
    text = await anyio.to_thread.run_sync(service_of(request).metrics_text, limiter=request.app.state.metrics_limiter)
    return Response(text, media_type=CONTENT_TYPE)


@router.get("/v1/stepwatch/info")
def info(request: Request) -> dict[str, Any]:
    # A plain def: FastAPI runs it on a thread, since it asks the worker.
    return service_of(request).info()


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Routing errors in the API's error shape: 404 for an unknown path, 405 (with Allow) for a wrong method."""
    assert isinstance(exc, StarletteHTTPException)
    path = request.url.path
    if exc.status_code == 404:
        return error_response(api.ApiError(404, f"no such path {path}", None, "not_found"))
    if exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow", "")
        return error_response(api.ApiError(405, f"use {allow} for {path}", None, "method_not_allowed",
                                   headers={"Allow": allow}))
    return error_response(api.ApiError(exc.status_code, str(exc.detail), None, "http_error"))


def create_app(svc: Service, client_timeout: float = CLIENT_TIMEOUT) -> FastAPI:
    """The ASGI app of one Service (docs pages off: they load scripts from a CDN; /openapi.json stays)."""
    app = FastAPI(title="stepwatch practice service", version="1", docs_url=None, redoc_url=None,
                  default_response_class=AsciiJSON)
    app.state.service = svc
    app.state.client_timeout = client_timeout
    app.state.limiter = anyio.CapacityLimiter(64)  # generations' brief calls: admission, answers
    app.state.metrics_limiter = anyio.CapacityLimiter(4)
    app.include_router(router)
    app.include_router(app_videos.router)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    return app


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the worker starts so a taken port fails fast (OSError)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class _StallTimeout(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a socket timeout for request heads: a connection that
    opens, or starts a request, and then sends nothing for ``client_timeout`` seconds is closed.  (uvicorn
    itself times out only idle keep-alive connections, after an answer; a stalled body is the app's 408.)"""

    client_timeout = CLIENT_TIMEOUT
    _stall: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._unwatch()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """(Re)arm the stall timer while a request head is awaited and uvicorn's keep-alive timer is not."""
        self._unwatch()
        if (self.conn.their_state is h11.IDLE and self.timeout_keep_alive_task is None
                and not self.transport.is_closing()):
            self._stall = self.loop.call_later(self.client_timeout, self._stalled)

    def _unwatch(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        self._stall = None
        if not self.transport.is_closing():
            self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn's server with the service's own SIGTERM/SIGINT handling.

    A signal stops accepting and, at once, stops the service (what is queued gets a 503, the worker
    stops), so in-flight requests end instead of holding the shutdown; then serve() returns and the
    process exits 0.  uvicorn's own handling would re-raise the signal after the shutdown instead.
    """

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        before = {sig: signal.signal(sig, self._exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    def _exit(self, _signum: int, _frame: FrameType | None) -> None:
        self.should_exit = True
        threading.Thread(target=self._on_signal, daemon=True, name="stepwatch-stop").start()


def make_server(svc: Service, client_timeout: float = CLIENT_TIMEOUT) -> uvicorn.Server:
    """The uvicorn server of ``svc``'s API; ``run(sockets=[sock])`` serves until SIGTERM/SIGINT (in the main
    thread) or until ``should_exit`` is set; the caller starts and stops ``svc``."""
    protocol: Any = "h11"  # uvicorn's own, without the stall timeout, on a version it was not tested with
    if versions.enabled("stall_timeout"):
        protocol = type("StallTimeoutH11", (_StallTimeout,), {"client_timeout": client_timeout})
    config = uvicorn.Config(create_app(svc, client_timeout), http=protocol, lifespan="off", log_config=None,
                            log_level="warning", access_log=False, timeout_graceful_shutdown=10,
                            server_header=False, headers=[("server", "stepwatch")])
    return _Server(config, svc.stop)


def serve(svc: Service, sock: socket.socket) -> None:
    """Serve the API on ``sock`` until SIGTERM/SIGINT; the caller starts and stops ``svc``."""
    make_server(svc).run(sockets=[sock])
