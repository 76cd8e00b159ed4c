"""The one HTTP client of stepwatch: httpx, with a transport tests can swap.

Every client the project has (Prometheus and Alertmanager APIs, the practice service, the
triage forwarder, the bench and the demo) goes through :func:`client` or :func:`request`,
so a test can run any of them in-process by installing an ``httpx.MockTransport`` or an
``httpx.ASGITransport`` with :func:`use_transport`, without a socket.

Errors stay httpx's (``httpx.HTTPError`` and subclasses): a caller that must not raise
catches that one base class, as it caught ``OSError`` from urllib before.
"""

from __future__ import annotations

import functools
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

_lock = threading.Lock()
_transport: httpx.BaseTransport | None = None


class _Shared(httpx.BaseTransport):
    """A test's transport lent to one client: closing the client leaves it open for the others."""

    def __init__(self, transport: httpx.BaseTransport) -> None:
        self.transport = transport

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.transport.handle_request(request)

    def close(self) -> None:
        pass  # the test that installed it closes it


@contextmanager
def use_transport(transport: httpx.BaseTransport) -> Iterator[None]:
    """Route every client made inside the block through ``transport`` (tests only).

    Clients keep the transport they were made with, after the block too; closing one of
    them does not close ``transport``, which stays the caller's to close.
    """
    global _transport
    with _lock:
        before, _transport = _transport, transport
    try:
        yield
    finally:
        with _lock:
            _transport = before


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One verifying TLS context for every client: loading the CA bundle costs ~40 ms, a client with it ~0.5 ms."""
    return httpx.create_ssl_context()


def client(base_url: str = "", timeout: float = 10.0, **kwargs: Any) -> httpx.Client:
    """A client; the caller closes it (``with client(...) as c``).

    Keep-alive is on (one client per long-lived caller reuses its connection); proxies from
    the environment are ignored, since every target of stepwatch is on loopback or in-cluster.
    """
    transport = _Shared(_transport) if _transport is not None else None
    kwargs.setdefault("verify", _ssl_context())
    return httpx.Client(base_url=base_url, timeout=timeout, transport=transport, trust_env=False, **kwargs)


def request(method: str, url: str, *, timeout: float = 10.0, **kwargs: Any) -> httpx.Response:
    """One request on a fresh client: for callers that talk to a URL once."""
    with client(timeout=timeout) as c:
        return c.request(method, url, **kwargs)


def ok(url: str, timeout: float = 2.0) -> bool:
    """True when GET ``url`` answers 200 (readiness polls): any failure is just 'not yet'."""
    try:
        return request("GET", url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False
