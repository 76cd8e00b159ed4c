"""Receive Alertmanager webhooks on /alerts, triage each notification, write reports (and forward them).

Each notification's firing alerts are triaged against Prometheus (with the
other alerts firing on the same hosts as context, so that alerts sharing a
cause form one incident even when Alertmanager notifies them apart).  For
every notification the reports go to --out as <time>-<id>.txt / .md / .json
and latest.txt / .md / .json; with --forward the JSON report is POSTed there.
The webhook is answered at once; the report follows within a second or two.

Endpoints: POST /alerts (Alertmanager webhook, version 4), GET /healthz,
GET /latest (the latest JSON report).
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import json
import logging
import os
import queue
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

log = logging.getLogger("stepwatch.triage.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prometheus", required=True, metavar="URL", help="Prometheus base URL")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    p.add_argument("--port", type=int, default=9466, help="listen port (default: %(default)s)")
    p.add_argument("--out", default="triage-reports", help="report directory (default: %(default)s)")
    p.add_argument("--forward", metavar="URL", help="POST each JSON report to this URL")
    p.add_argument("--no-context", action="store_true",
                   help="triage only the notified alerts (no grouping with other firing alerts)")


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class TriageServer:
    """The webhook receiver and its one worker thread (notifications are triaged in arrival order)."""

    def __init__(self, prometheus: str, out: str | Path, host: str = "127.0.0.1", port: int = 9466,
                 forward: str | None = None, context: bool = True, at: float | None = None) -> None:
        """``at`` evaluates every notification at that fixed time (replays and tests); None is now."""
        from stepwatch.promapi import Prometheus

        self.prom = Prometheus(prometheus, timeout=5.0)
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.forward = forward
        self.context = context
        self.at = at
        self.queue: queue.Queue[tuple[float, dict[str, Any]] | None] = queue.Queue()
        self.written: list[dict[str, Any]] = []  # {received, written, latency_s, files, status}
        self.latest: dict[str, Any] | None = None
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                log.debug("%s " + format, self.address_string(), *args)

            def _reply(self, code: int, body: bytes = b"", ctype: str = "text/plain") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                received = time.time()
                if self.path.rstrip("/") != "/alerts":
                    self._reply(404, b"POST Alertmanager webhooks to /alerts\n")
                    return
                n = int(self.headers.get("Content-Length") or 0)
                try:
                    payload = json.loads(self.rfile.read(n) or b"{}")
                    if not isinstance(payload, dict) or not isinstance(payload.get("alerts", []), list):
                        raise ValueError("not an Alertmanager webhook payload")
                except ValueError as e:
                    self._reply(400, f"bad payload: {e}\n".encode())
                    return
                server.queue.put((received, payload))
                self._reply(200, b"queued\n")

            def do_GET(self) -> None:
                if self.path == "/healthz":
                    self._reply(200, b"ok\n")
                elif self.path == "/latest":
                    body = json.dumps(server.latest or {}).encode()
                    self._reply(200 if server.latest else 404, body, "application/json")
                else:
                    self._reply(404, b"not found\n")

        self.httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_port}"
        self._threads = [threading.Thread(target=self.httpd.serve_forever, daemon=True, name="triage-http"),
                         threading.Thread(target=self._work, daemon=True, name="triage-worker")]

    def start(self) -> TriageServer:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self.queue.put(None)
        self.httpd.shutdown()
        self.httpd.server_close()
        self._threads[1].join(timeout=30)

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
        """Triage one notification and write its reports; returns the JSON report."""
        from stepwatch.promapi import PromError
        from stepwatch.triage.engine import Engine, alerts_from_webhook, firing_at
        from stepwatch.triage.render import markdown, terminal

        notified = alerts_from_webhook(payload)
        keys = {a.key for a in notified}
        engine = Engine(self.prom, at=self.at)
        extra = []
        if notified and self.context:
            hosts = {a.host for a in notified}
            try:
                extra = [a for a in firing_at(self.prom, self.at) if a.key not in keys and a.host in hosts]
            except PromError:
                extra = []
        report = engine.run(notified + extra)
        report.incidents = [i for i in report.incidents if any(a.key in keys for a in i.alerts)]
        data = report.to_json()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(received))
        ident = hashlib.sha256(json.dumps(sorted(keys)).encode()).hexdigest()[:8]
        if not notified:
            resolved = sorted({str((a.get("labels") or {}).get("alertname", "")) for a in payload.get("alerts", [])})
            text = f"RESOLVED: {', '.join(resolved) or 'nothing'} (no firing alert in this notification)\n"
            md = f"# stepwatch triage: resolved\n\n{text}"
            data["status"] = "resolved"
        else:
            text, md = terminal(report), markdown(report)
        base = f"{stamp}-{ident}"
        data.update({"notification": {"status": payload.get("status"), "groupKey": payload.get("groupKey"),
                                      "receiver": payload.get("receiver"),
                                      "alerts": [a.short() for a in notified]},
                     "received_at_unix": received, "files": [f"{base}.txt", f"{base}.md", f"{base}.json"]})
        _write(self.out / f"{base}.txt", text)
        _write(self.out / f"{base}.md", md)
        data["latency_s"] = round(time.time() - received, 3)
        body = json.dumps(data, indent=2)
        _write(self.out / f"{base}.json", body)
        for ext, content in (("txt", text), ("md", md), ("json", body)):
            _write(self.out / f"latest.{ext}", content)
        self.latest = data
        self.written.append({"received": received, "written": time.time(), "latency_s": data["latency_s"],
                             "files": data["files"], "status": data["status"]})
        log.info("triaged %s -> %s (%s) in %.2fs", ", ".join(a.name for a in notified) or "resolved",
                 ", ".join(str(i.cause) for i in report.incidents) or "-", base, data["latency_s"])
        if self.forward:
            try:
                req = urllib.request.Request(self.forward, data=body.encode(), method="POST",
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=5) as r:
                    r.read()
            except OSError as e:
                log.warning("forwarding the report to %s failed: %s", self.forward, e)
        return data


def run(args: argparse.Namespace) -> int:
    try:
        server = TriageServer(args.prometheus, args.out, args.host, args.port, args.forward,
                              context=not args.no_context).start()
    except OSError as e:
        print(f"stepwatch triage serve: cannot listen on {args.host}:{args.port}: {e}")
        return 2
    print(f"stepwatch triage: webhook on {server.url}/alerts, Prometheus {args.prometheus}, reports in {args.out}",
          flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
