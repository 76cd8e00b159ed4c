"""Alertmanager's webhook receiver on loopback: every notification kept with its arrival time."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from stepwatch.asgi import ThreadedServer

log = logging.getLogger("stepwatch.stack")


@dataclass
class Notification:
    """One Alertmanager webhook delivery, as received."""

    received: float
    status: str
    alerts: list[dict[str, Any]]
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    def names(self, status: str | None = "firing") -> set[str]:
        return {a["labels"].get("alertname", "") for a in self.alerts if status is None or a.get("status") == status}

    def fired_since(self, alertname: str, since: float) -> bool:
        """Does it notify ``alertname`` firing, as an alert that became active at ``since`` or later?

        A repeat notification of an alert already active before (Alertmanager resends firing alerts
        every repeat interval, and on each group change) proves nothing about a fault injected since.
        """
        return any(a["labels"].get("alertname") == alertname and a.get("status") == "firing"
                   and (starts_at(a.get("startsAt")) or 0.0) >= since - 1.0 for a in self.alerts)


def starts_at(stamp: Any) -> float | None:
    """Unix seconds of an RFC 3339 ``startsAt`` (nanoseconds cut to microseconds), or None."""
    if not isinstance(stamp, str) or not stamp or stamp.startswith("0001-"):
        return None
    head, _, frac = stamp.rstrip("Z").partition(".")
    digits = "".join(ch for ch in frac if ch.isdigit())[:6]
    try:
        t = datetime.fromisoformat(head).replace(tzinfo=timezone.utc)
    except ValueError:
        return None
    return t.timestamp() + (int(digits) / 10 ** len(digits) if digits else 0.0)


class WebhookReceiver:
    """Alertmanager's webhook receiver: records every notification with its arrival time.

    A tiny Starlette app on uvicorn in a thread, the ASGI stack the service and the triage
    receiver run on; any path takes a POST, since Alertmanager posts to the URL it was given.
    """

    def __init__(self, port: int = 0, on_notification: Callable[[Notification], None] | None = None) -> None:
        self.received: list[Notification] = []
        self._lock = threading.Lock()
        self.on_notification = on_notification
        app = Starlette(routes=[Route("/{path:path}", self._post, methods=["POST"])])
        self.server = ThreadedServer(app, "127.0.0.1", port, name="stepwatch-webhook")
        self.url = f"{self.server.url}/alerts"

    async def _post(self, request: Request) -> Response:
        try:
            body = json.loads(await request.body() or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError):
            return Response("the body is not JSON\n", status_code=400)
        if not isinstance(body, dict):
            return Response("the body is not a JSON object\n", status_code=400)
        await run_in_threadpool(self.record, body)  # the callback may block (it may triage)
        return Response(status_code=200)

    def record(self, body: dict[str, Any]) -> Notification:
        """Keep one delivery and hand it to the callback (whose errors are logged, never raised)."""
        note = Notification(time.time(), body.get("status", ""), list(body.get("alerts", [])), body)
        with self._lock:
            self.received.append(note)
        if self.on_notification is not None:
            try:
                self.on_notification(note)
            except Exception:
                log.exception("webhook callback failed")
        return note

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def first_firing(self, alertname: str, since: float) -> Notification | None:
        with self._lock:
            for n in self.received:
                if n.received >= since and n.fired_since(alertname, since):
                    return n
        return None

    def snapshot(self) -> list[Notification]:
        with self._lock:
            return list(self.received)
