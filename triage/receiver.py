"""The triage webhook receiver: an ASGI app (FastAPI on uvicorn) and its one worker thread.

Endpoints: ``POST /alerts`` (Alertmanager webhook, version 4; answered at once
with ``queued``), ``GET /healthz``, ``GET /latest`` (the latest JSON report, 404
before the first), ``GET /openapi.json``.  A notification is triaged by the
worker in arrival order (``triage/notification.py``), its reports written to the
output directory and, with ``forward``, the JSON report POSTed there.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from stepwatch import httpclient
from stepwatch.asgi import ThreadedServer
from stepwatch.promapi import Prometheus
from stepwatch.triage.notification import triage_notification, write_reports

log = logging.getLogger("stepwatch.triage.serve")


class WebhookPayload(BaseModel):
    """Alertmanager's webhook body (version 4), for the OpenAPI schema.

    The receiver checks bodies itself (a JSON object whose ``alerts`` is a list) so
    that a bad one gets the plain ``400 bad payload: ...`` it always got.
    """

    model_config = ConfigDict(extra="allow")
    version: str = "4"
    groupKey: str = ""
    truncatedAlerts: int = 0
    status: str = "firing"
    receiver: str = ""
    groupLabels: dict[str, str] = {}
    commonLabels: dict[str, str] = {}
    commonAnnotations: dict[str, str] = {}
    externalURL: str = ""
    alerts: list[dict[str, Any]] = []


def parse_webhook(body: bytes) -> dict[str, Any]:
    """The JSON object of a webhook body (empty: ``{}``); ValueError says what is wrong."""
    payload = json.loads(body or b"{}")
    if not isinstance(payload, dict) or not isinstance(payload.get("alerts", []), list):
        raise ValueError("not an Alertmanager webhook payload")
    return payload


class TriageServer:
    """The webhook receiver and its one worker thread (notifications are triaged in arrival order).

    The listening socket is bound here (an address in use raises OSError at once);
    ``start`` serves it, ``stop`` shuts down the HTTP server and then the worker.
    """

    def __init__(self, prometheus: str, out: str | Path, host: str = "127.0.0.1", port: int = 9466,
                 forward: str | None = None, context: bool = True, at: float | None = None) -> None:
        """``at`` evaluates every notification at that fixed time (replays and tests); None is now."""
        self.app = make_app(self)
        self._http = ThreadedServer(self.app, host, port, name="triage-http")  # first: a taken port leaks nothing
        self.url = self._http.url
        self.prom = Prometheus(prometheus, timeout=5.0)
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.forward = forward
        self.context = context
        self.at = at
        self.queue: queue.Queue[tuple[float, dict[str, Any]] | None] = queue.Queue()
        self.written: list[dict[str, Any]] = []  # {received, written, latency_s, files, status}
        self.latest: dict[str, Any] | None = None
        # Redirects followed, as urllib did: a forward target behind a redirect still gets its report.
        self._forwarder = httpclient.client(timeout=5.0, follow_redirects=True) if forward else None
        self._worker = threading.Thread(target=self._work, daemon=True, name="triage-worker")

    def start(self) -> TriageServer:
        self._worker.start()
        try:
            self._http.start()
        except OSError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self._http.stop()
        self.queue.put(None)
        if self._worker.is_alive():
            self._worker.join(timeout=30)
        self.prom.close()
        if self._forwarder is not None:
            self._forwarder.close()

    def _work(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            try:
                self.handle(*item)
            except Exception:  # one bad notification must not stop the receiver
                log.exception("triage of a notification failed")

    def handle(self, received: float, payload: dict[str, Any]) -> dict[str, Any]:
        """Triage one notification, write its reports and forward them; returns the JSON report."""
        reports = triage_notification(self.prom, payload, received, at=self.at, context=self.context)
        body = write_reports(self.out, reports)
        data = reports.data
        self.latest = data
        self.written.append({"received": received, "written": time.time(), "latency_s": data["latency_s"],
                             "files": data["files"], "status": data["status"]})
        log.info("triaged %s (%s) in %.2fs", reports.summary, reports.base, data["latency_s"])
        self._forward(body)
        return data

    def _forward(self, body: str) -> None:
        """POST the JSON report to ``forward``; a failure is logged, never raised (the report is on disk)."""
        if self._forwarder is None or not self.forward:
            return
        try:
            r = self._forwarder.post(self.forward, content=body.encode(),
                                     headers={"Content-Type": "application/json"})
            r.raise_for_status()
        except httpx.HTTPError as e:
            log.warning("forwarding the report to %s failed: %s", self.forward, e)


_WEBHOOK_BODY = {"requestBody": {"required": False, "content": {
    "application/json": {"schema": WebhookPayload.model_json_schema()}}}}


def make_app(server: TriageServer) -> FastAPI:
    """The receiver's routes; ``server`` holds the queue and the latest report."""
    app = FastAPI(title="stepwatch triage", summary="Alertmanager webhook receiver that triages alerts",
                  version="1")

    @app.post("/alerts", response_class=PlainTextResponse, openapi_extra=_WEBHOOK_BODY,
              responses={400: {"description": "bad payload: not JSON, or not a webhook payload"}})
    async def alerts(request: Request) -> Response:
        """Queue one notification for triage; answered at once, the report follows on disk."""
        received = time.time()
        try:
            payload = parse_webhook(await request.body())
        except ValueError as e:
            return PlainTextResponse(f"bad payload: {e}\n", status_code=400)
        server.queue.put((received, payload))
        return PlainTextResponse("queued\n")

    app.add_api_route("/alerts/", alerts, methods=["POST"], include_in_schema=False)

    @app.get("/healthz", response_class=PlainTextResponse)
    async def healthz() -> Response:
        return PlainTextResponse("ok\n")

    @app.get("/latest", responses={404: {"description": "no report yet (body: {})"}})
    async def latest() -> Response:
        """The latest JSON report, as written to ``latest.json``."""
        return Response(json.dumps(server.latest or {}), status_code=200 if server.latest else 404,
                        media_type="application/json")

    app.add_exception_handler(HTTPException, _not_found)
    return app


async def _not_found(request: Request, exc: Exception) -> Response:
    """Unknown paths answer in plain words (a POST is told where webhooks go); other errors as usual
    (a known path with another method: 405 with ``Allow``)."""
    assert isinstance(exc, HTTPException)  # registered for HTTPException only
    if exc.status_code != 404:
        return await http_exception_handler(request, exc)
    text = "POST Alertmanager webhooks to /alerts\n" if request.method == "POST" else "not found\n"
    return PlainTextResponse(text, status_code=404)
