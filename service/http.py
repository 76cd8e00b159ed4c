"""What every route of the service's HTTP API shares: the error shape, the ASCII JSON answer, the body read
with its limits, the blocking call on a worker thread.  ``app.py`` (images, streams, admin) and
``app_videos.py`` (video jobs) both use it."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from stepwatch.service import api
from stepwatch.service.engine import Service

T = TypeVar("T")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorBody(BaseModel):
    error: ErrorDetail


ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text} for code, text in (
        (400, "bad input; ``param`` names the field"), (404, "no such path, or no such video job"),
        (409, "the video job has no video (yet): its status is in the message"),
        (411, "no Content-Length"), (413, "body too large"),
        (429, "the pool is overloaded (Retry-After)"), (503, "warming up or the worker died (Retry-After)"),
        (504, "generation timed out"), (507, "out of memory: the stage, the shape and the fix"))}


class AsciiJSON(JSONResponse):
    """JSON escaped to ASCII, as ``json.dumps`` writes it: a lone surrogate a client sent (a knob's name, say)
    comes back as ``\\ud800`` in a 400, where Starlette's UTF-8 rendering would fail with a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":"), allow_nan=False).encode("ascii")


class ClientGone(Exception):
    """The client disconnected before its answer (counted as 499, nginx's convention)."""


def error_response(e: api.ApiError) -> JSONResponse:
    return AsciiJSON(e.body(), e.status, {**e.headers, "Connection": "close"})


def internal_error(e: Exception) -> api.ApiError:
    return api.ApiError(500, f"internal error: {type(e).__name__}", None, "internal_error", "server_error")


def service_of(request: Request) -> Service:
    svc: Service = request.app.state.service
    return svc


async def in_thread(request: Request, fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking Service call on a worker thread of the service's limiter."""
    return await anyio.to_thread.run_sync(partial(fn, *args), limiter=request.app.state.limiter)


async def read_body(request: Request) -> bytes:
    """The body, checked: 411 without a Content-Length, 413 past the limit (unread), 408 if it stalls."""
    length = request.headers.get("content-length")
    if length is None or not (length.isascii() and length.isdigit()):
        raise api.ApiError(411, "Content-Length is required", None, "length_required")
    n = int(length)
    if n > api.MAX_BODY_BYTES:
        raise api.ApiError(413, f"request body is {n} bytes; the limit is {api.MAX_BODY_BYTES}", None,
                           "body_too_large")
    timeout: float = request.app.state.client_timeout
    try:
        with anyio.fail_after(timeout):
            return await request.body()
    except TimeoutError:
        raise api.ApiError(408, f"the request body did not arrive within {timeout:g}s", None,
                           "request_timeout") from None
    except ClientDisconnect:
        raise ClientGone from None
