"""The Prometheus text exposition: rendered fast for /metrics, and read back into numbers.

``Renderer`` writes exactly what prometheus_client's ``generate_latest`` writes (text format
0.0.4, byte for byte; tests compare them), but builds each series' line prefix (its name and
escaped, sorted labels) once and keeps it: label sets are bounded by design, and the prefix is
most of generate_latest's per-sample cost.  At 50 shapes x 8 ranks that halves the render
(``stepwatch bench exposition``).  ``serve_metrics`` serves a registry with it, in place of
prometheus_client's ``start_http_server``, which renders with generate_latest.
"""

from __future__ import annotations

import gzip
import logging
import socket
import sys
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

Key = tuple[str, tuple[tuple[str, str], ...]]
# What generate_latest writes (legacy names, no UTF-8 escaping) is text format 0.0.4, which every
# Prometheus 2.x parses; prometheus_client now labels the same bytes 1.0.0.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
log = logging.getLogger("stepwatch.exposition")

# Samples generate_latest moves into a gauge family of their own after the metric's other samples.
_LATE_SUFFIXES = ("_created", "_gsum", "_gcount")
_PROBE = "stepwatch_render_probe"


def parse_exposition(text: str) -> dict[Key, float]:
    """{(sample name, sorted label pairs): value} for every sample."""
    out: dict[Key, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class _Families:
    """A collector answering with given families: generate_latest renders exactly those."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> list[Metric]:
        return self._families


def _header(metric: Metric) -> str:
    return generate_latest(_Families([Metric(metric.name, metric.documentation, metric.type)])).decode()


def _prefix(sample: Sample) -> str:
    """The line of ``sample`` up to its value, as generate_latest writes it (a probe sample at 0.0)."""
    probe = Metric(_PROBE, "", "untyped")
    probe.samples = [Sample(sample.name, sample.labels, 0.0)]
    line = generate_latest(_Families([probe])).decode().splitlines()[-1]
    return line[: -len("0.0")]


class Renderer:
    """generate_latest for one registry, with line prefixes and family headers cached.

    The cache is bounded (``max_series``): past it, it starts again, which costs one slow render.
    A sample with a timestamp (no stepwatch collector sets one) is rendered by generate_latest's own
    path for the whole exposition."""

    def __init__(self, registry: Any, max_series: int = 200_000) -> None:
        self.registry = registry
        self.max_series = max_series
        self._prefixes: dict[Key, str] = {}
        self._headers: dict[tuple[str, str, str], str] = {}
        self._lock = threading.Lock()  # one render at a time: the caches are shared

    def render(self) -> bytes:
        with self._lock:
            return self._render()

    def _render(self) -> bytes:
        families = list(self.registry.collect())
        if any(s.timestamp is not None for m in families for s in m.samples):
            return generate_latest(_Families(families))
        if len(self._prefixes) > self.max_series:
            self._prefixes.clear()
        out: list[str] = []
        for metric in families:
            self._family(metric, out)
        return "".join(out).encode("utf-8")

    def _family(self, metric: Metric, out: list[str]) -> None:
        key = (metric.name, metric.type, metric.documentation)
        header = self._headers.get(key)
        if header is None:
            header = self._headers[key] = _header(metric)
        out.append(header)
        prefixes, base = self._prefixes, metric.name
        late: dict[str, list[str]] = {}
        for s in metric.samples:
            pkey = (s.name, tuple(s.labels.items()))
            prefix = prefixes.get(pkey)
            if prefix is None:
                prefix = prefixes[pkey] = _prefix(s)
            line = f"{prefix}{floatToGoString(s.value)}\n"
            suffix = s.name[len(base):] if s.name.startswith(base) else ""
            if suffix in _LATE_SUFFIXES:
                late.setdefault(suffix, []).append(line)
            else:
                out.append(line)
        for suffix, lines in sorted(late.items()):
            out.append(_header(Metric(base + suffix, metric.documentation, "gauge")))
            out.extend(lines)


def _handler(renderer: Renderer) -> type[BaseHTTPRequestHandler]:
    class MetricsHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] not in ("/", "/metrics"):
                self._answer(404, b"not found: /metrics is the only path\n", "text/plain; charset=utf-8")
                return
            try:
                body = renderer.render()
            except Exception as e:  # a broken collector: say so, keep serving
                log.exception("rendering /metrics failed")
                self._answer(500, f"rendering /metrics failed: {e!r}\n".encode(), "text/plain; charset=utf-8")
                return
            gzipped = "gzip" in self.headers.get("Accept-Encoding", "")
            # Level 1: a tenth of the bytes (as Prometheus asks for gzip) for ~0.3 ms at 50 shapes x 8 ranks.
            self._answer(200, gzip.compress(body, compresslevel=1) if gzipped else body, CONTENT_TYPE,
                         "gzip" if gzipped else None)

        def _answer(self, code: int, body: bytes, ctype: str, encoding: str | None = None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            if encoding:
                self.send_header("Content-Encoding", encoding)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a scrape every few seconds is not news

    return MetricsHandler


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A scraper that hung up before its answer was written (its scrape timeout on a loaded host, or its
        own shutdown) is not an error of ours: no traceback in the service's log for it."""
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            log.debug("a scraper at %s hung up before its answer", client_address)
            return
        super().handle_error(request, client_address)


class _Server6(_Server):
    address_family = socket.AF_INET6


def serve_metrics(port: int, addr: str, registry: Any) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """``registry`` on http://addr:port/metrics from a daemon thread (port 0: any free port; an IPv6 ``addr``
    such as ``::`` works too), rendered by a ``Renderer``; returns (server, thread) like prometheus_client's
    start_http_server."""
    server = (_Server6 if ":" in addr else _Server)((addr, port), _handler(Renderer(registry)))
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="stepwatch-metrics")
    thread.start()
    return server, thread
