"""``stepwatch serve``: the practice inference service, an OpenAI-style image API.

One HTTP process (validation, per-pool queues, admission, metrics) in front of
one worker process that runs the instrumented diffusers pipeline under a
memory budget.  An OOM fails that request with a 507 naming the stage, the
shape and the fix; a worker that dies fails its in-flight request with a 503,
is restarted, and the restart is counted.  Loopback by default.

Endpoints: POST /v1/images/generations, GET /v1/stepwatch/info, /healthz,
/readyz, /metrics, and (only with an admin token) POST /admin/knobs.
"""

from __future__ import annotations

import argparse
import base64
import hmac
import http.server
import json
import logging
import multiprocessing as mp
import signal
import socket
import threading
import time
import urllib.request
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from stepwatch.metrics import MetricSet
from stepwatch.service import api
from stepwatch.service.config import ConfigError, ServiceConfig, load
from stepwatch.service.fingerprint import fingerprint_id
from stepwatch.service.queue import LedgerParams, Predictor, QueueFull, Scheduler, Ticket

log = logging.getLogger("stepwatch.service")

KNOB_TYPES: dict[str, Any] = {"cache": str, "cache_threshold": (int, float), "vae_tiling": bool, "compile": bool,
                              "rank_delay_seconds": dict, "baselines": dict}


class WorkerDied(Exception):
    pass


class WorkerHandle:
    """The worker process: start, talk to, watch, restart."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.proc: Any = None
        self.conn: Any = None
        self.ready_info: dict[str, Any] | None = None
        self._send_lock = threading.Lock()
        self._pending: dict[str, Future[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self.generation = 0
        self.ready = threading.Event()

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        cfg = self.service.cfg
        if cfg.ranks > 1:
            from stepwatch.service.ranks import ranks_main

            proc = ctx.Process(target=ranks_main, args=(cfg.to_raw(), child, cfg.ranks), daemon=False,
                               name="stepwatch-worker")
        else:
            from stepwatch.service.worker import worker_main

            proc = ctx.Process(target=worker_main, args=(cfg.to_raw(), child), daemon=True,
                               name="stepwatch-worker")
        proc.start()
        child.close()
        self.proc, self.conn = proc, parent
        self.generation += 1
        self.ready.clear()
        self.ready_info = None
        threading.Thread(target=self._reader, args=(parent, proc, self.generation), daemon=True,
                         name="stepwatch-worker-reader").start()

    def _reader(self, conn: Any, proc: Any, generation: int) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._deliver(msg)
            except Exception:
                # A reader that stopped silently would wedge the service: treat it as a worker death.
                log.exception("bad message from the worker; restarting it")
                proc.kill()
                break
        proc.join(timeout=5)
        code = proc.exitcode
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(WorkerDied(_exit_text(code)))
        if generation == self.generation:
            self.ready.clear()
            self.service.on_worker_died(code)

    def _deliver(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "ready":
            self.ready_info = msg
            self.ready.set()
            self.service.on_worker_ready(msg)
        elif op == "fatal":
            log.error("worker failed to start:\n%s", msg.get("message"))
            self.service.fatal = msg.get("message")
        else:
            with self._lock:
                fut = self._pending.pop(str(msg.get("id")), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def call(self, msg: dict[str, Any]) -> Future[dict[str, Any]]:
        fut: Future[dict[str, Any]] = Future()
        msg = {**msg, "id": msg.get("id") or uuid.uuid4().hex}
        with self._lock:
            self._pending[msg["id"]] = fut
        try:
            with self._send_lock:
                self.conn.send(msg)
        except (OSError, BrokenPipeError, AttributeError) as e:
            with self._lock:
                self._pending.pop(msg["id"], None)
            fut.set_exception(WorkerDied(f"cannot reach the worker ({e})"))
        return fut

    def stop(self) -> None:
        self.generation += 1  # a death from here on is expected
        try:
            with self._send_lock:
                self.conn.send({"op": "shutdown"})
        except Exception:
            pass
        if self.proc is not None:
            self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=5)


def _is_uint(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _finite_nonneg(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf")


def _exit_text(code: int | None) -> str:
    if code is None:
        return "worker exited"
    if code < 0:
        try:
            return f"worker killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"worker killed by signal {-code}"
    return f"worker exited with code {code}"


class Service:
    def __init__(self, cfg: ServiceConfig, registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.registry = registry or CollectorRegistry()
        self.m = MetricSet(self.registry, "service")
        self.instance_id = cfg.instance_id or f"{socket.gethostname()}:{cfg.port}"
        self.predictor = Predictor()
        self.scheduler = Scheduler(cfg.all_pools(), self.predictor, cfg.queue.policy, cfg.queue.aging,
                                   cfg.queue.max_queued)
        self.worker = WorkerHandle(self)
        self.fingerprint: dict[str, Any] = {}
        self.knobs: dict[str, Any] = {}
        self.fatal: str | None = None
        self._quick_deaths = 0  # worker deaths since it was last ready
        self.started = time.time()
        self._stop = threading.Event()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, daemon=True, name="stepwatch-dispatch")
        for p in cfg.all_pools():
            # Children at 0 from the start: the first error of a pool is then a visible increase.
            for code in ("200", "429", "500", "503", "507"):
                self.m.service_requests_total.labels(pool=p.name, code=code)
            self.m.service_images_nonfinite_total.labels(pool=p.name)
            self.m.queue_rejected_total.labels(pool=p.name)
            self.m.queue_slo_seconds.labels(pool=p.name).set(p.slo_seconds)
            self.m.queue_depth.labels(pool=p.name).set(0)
            self.m.queue_estimated_wait_seconds.labels(pool=p.name).set(0)
        self.m.worker_restarts_total.inc(0)
        self.m.worker_up.set(0)
        self.m.service_ready.set(0)

    # ----- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self.worker.start()
        self._dispatcher.start()
        threading.Thread(target=self._ticker, daemon=True, name="stepwatch-gauges").start()

    def stop(self) -> None:
        self._stop.set()
        self._fail_queued(api.ApiError(503, "the service is shutting down", None, "shutting_down", "server_error"))
        self.worker.stop()

    def _fail_queued(self, err: api.ApiError) -> None:
        for t in self.scheduler.drain():
            if not t.future.done():
                t.future.set_exception(err)
        self._update_gauges()

    @property
    def ready(self) -> bool:
        return self.worker.ready.is_set()

    def on_worker_ready(self, msg: dict[str, Any]) -> None:
        self.fingerprint = msg["fingerprint"]
        self.knobs = msg.get("knobs", {})
        if msg.get("ledger"):
            lp = msg["ledger"]
            self.predictor.ledger = LedgerParams(lp["p_tok"], lp["layers"], lp["hidden"], tuple(lp["patch"]),
                                                 lp["cross_attention"], lp["vae_scale"], lp["text_tokens"])
        for w in msg.get("warmup", []):
            if w.get("run") == 1:
                from stepwatch.service.api import GenerationRequest
                from stepwatch.service.config import parse_size

                width, height = parse_size(w["size"])
                req = GenerationRequest("", 1, width, height, self.cfg.warmup_steps, 1.0, 0)
                for _ in range(3):
                    self.predictor.observe(req, w["seconds"], w.get("stages", {}))
        self._publish_config()
        self._quick_deaths = 0
        self.m.worker_up.set(1)
        self.m.service_ready.set(1)
        log.info("worker ready (pid %s, setup %.1fs, fingerprint %s, budget %s)", msg.get("pid"),
                 msg.get("setup_seconds", 0), fingerprint_id(self.fingerprint),
                 f"{msg['budget_bytes'] / 2**20:.0f} MiB address space" if msg.get("budget_bytes") else "none")

    def on_worker_died(self, code: int | None) -> None:
        self.m.worker_up.set(0)
        self.m.service_ready.set(0)
        if self._stop.is_set():
            return
        if self.fatal is not None:
            log.error("worker cannot start; not restarting (see the error above)")
            self._fail_queued(api.ApiError(503, "the worker cannot start; see the service log", None,
                                           "worker_failed", "server_error"))
            return
        self.m.worker_restarts_total.inc()
        # A worker that keeps dying before it is ready (killed during warm-up, say) is restarted with backoff.
        delay = min(60.0, 2.0 ** self._quick_deaths - 1)
        self._quick_deaths += 1
        log.error("%s; restarting it%s", _exit_text(code), f" in {delay:.0f}s" if delay else "")
        if self._stop.wait(delay):
            return
        self.worker.start()

    def config_id(self) -> str:
        """The fingerprint plus every knob: changes with any runtime change (the fingerprint proper leaves out
        the lossy knobs, since quality baselines must stay comparable across them)."""
        return fingerprint_id({"fingerprint": self.fingerprint, "knobs": self.knobs})

    def _publish_config(self) -> None:
        info = {"instance_id": self.instance_id, "fingerprint_id": fingerprint_id(self.fingerprint),
                "config_id": self.config_id()}
        for k, v in sorted(self.knobs.items()):
            info[k] = json.dumps(v) if isinstance(v, dict) else str(v)
        # Info metrics keep old label sets; clear so only the current config shows.
        self.m.service_config.clear()
        self.m.service_config.info(info)

    # ----- dispatch -------------------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        while not self._stop.is_set():
            if not self.worker.ready.wait(timeout=0.5):
                continue
            t = self.scheduler.take(timeout=0.5)
            if t is None:
                continue
            if not t.future.set_running_or_notify_cancel():  # its client gave up while it queued
                self.scheduler.done(t)
                self._update_gauges()
                continue
            self._update_gauges()
            self.m.queue_wait_seconds.labels(pool=t.pool).observe(time.monotonic() - t.enqueued)
            try:
                reply = self.worker.call({"op": "generate", "request": t.request.__dict__}).result(
                    timeout=self.cfg.request_timeout_seconds)
                if not t.future.done():
                    t.future.set_result(reply)
            except WorkerDied as e:
                if not t.future.done():
                    t.future.set_exception(api.ApiError(
                        503, f"the worker died while generating this request ({e}); it is restarting, retry "
                        "shortly", None, "worker_died", "server_error", {"Retry-After": "30"}))
            except FutureTimeout:
                log.error("request timed out after %ss; killing the worker", self.cfg.request_timeout_seconds)
                if not t.future.done():
                    t.future.set_exception(api.ApiError(
                        504, f"generation took longer than {self.cfg.request_timeout_seconds:.0f}s; the worker is "
                        "restarting", None, "timeout", "server_error"))
                if self.worker.proc is not None:
                    self.worker.proc.kill()
            finally:
                self.scheduler.done(t)
                self._update_gauges()

    def _ticker(self) -> None:
        while not self._stop.wait(1.0):
            self._update_gauges()

    def _update_gauges(self) -> None:
        for pool, s in self.scheduler.snapshot().items():
            self.m.queue_depth.labels(pool=pool).set(s["depth"])
            self.m.queue_estimated_wait_seconds.labels(pool=pool).set(s["estimated_wait"])

    # ----- requests -------------------------------------------------------------------------
    def generate(self, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        req = api.validate(body, self.cfg)
        pool_cfg = self.cfg.pool_for(req.size)
        pool = pool_cfg.name
        if self.fatal is not None:
            raise api.ApiError(503, "the worker cannot start; see the service log", None, "worker_failed",
                               "server_error")
        if not self.ready:
            raise api.ApiError(503, "warming up (compiling the serving resolutions); retry shortly", None,
                               "not_ready", "server_error", {"Retry-After": "10"})
        t0 = time.monotonic()
        try:
            ticket = self.scheduler.submit(req, pool)
        except QueueFull as e:
            self.m.queue_rejected_total.labels(pool=pool).inc()
            raise api.ApiError(429, f"pool '{pool}' is overloaded: estimated wait {e.estimated_wait:.0f}s is past "
                               f"its limit of {e.limit:.0f}s; retry after {e.retry_after}s", None, "overloaded",
                               "rate_limit_error", {"Retry-After": str(e.retry_after)}) from None
        self._update_gauges()
        try:
            reply = ticket.future.result(
                timeout=pool_cfg.max_wait_seconds + self.cfg.request_timeout_seconds + 60)
        except FutureTimeout:
            ticket.future.cancel()  # still queued: it will not run for nobody
            raise api.ApiError(504, "generation did not finish in time", None, "timeout", "server_error") from None
        return self._answer(req, pool, ticket, reply, t0)

    def _answer(self, req: api.GenerationRequest, pool: str, ticket: Ticket, reply: dict[str, Any],
                t0: float) -> tuple[int, dict[str, Any], dict[str, str]]:
        if reply.get("op") == "error":
            if reply.get("kind") == "oom":
                raise api.ApiError(507, reply["message"], None, "out_of_memory", "server_error")
            raise api.ApiError(500, f"generation failed: {reply.get('message', '')}", None, "internal_error",
                               "server_error")
        self.predictor.observe(req, reply["seconds"], reply.get("stages", {}))
        if reply.get("nonfinite"):
            self.m.service_images_nonfinite_total.labels(pool=pool).inc(reply["nonfinite"])
        queue_s = (ticket.started or t0) - ticket.enqueued
        body = {
            "created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(png).decode()} for png in reply["images"]],
            "stepwatch": {
                "shape": reply.get("shape", req.shape), "pool": pool, "queue_seconds": round(queue_s, 4),
                "seconds": round(reply["seconds"], 4), "total_seconds": round(time.monotonic() - t0, 4),
                "stages": reply.get("stages", {}),
                "steps": reply.get("steps"), "cache": reply.get("cache"), "instance_id": self.instance_id,
                "fingerprint_id": fingerprint_id(self.fingerprint), "seed": req.seed,
                "nonfinite_images": reply.get("nonfinite", 0),
            },
        }
        return 200, body, {}

    def info(self) -> dict[str, Any]:
        worker: dict[str, Any] = {}
        if self.ready:
            try:
                worker = self.worker.call({"op": "info"}).result(timeout=30)
            except Exception:
                worker = {}
        return {
            "instance_id": self.instance_id, "fingerprint": self.fingerprint,
            "fingerprint_id": fingerprint_id(self.fingerprint) if self.fingerprint else None,
            "knobs": self.knobs, "config_id": self.config_id(), "ready": self.ready,
            "pools": {p.name: {"sizes": p.sizes, "slo_seconds": p.slo_seconds, "max_wait_seconds": p.max_wait_seconds}
                      for p in self.cfg.all_pools()},
            "default_size": self.cfg.default_size, "default_steps": self.cfg.default_steps,
            "warmup": self.cfg.warmup,
            "worker": {k: worker.get(k) for k in ("pid", "rss_bytes", "vm_bytes", "budget_bytes")},
            "uptime_seconds": round(time.time() - self.started, 1),
        }

    def set_knobs(self, knobs: Any) -> dict[str, Any]:
        if not isinstance(knobs, dict) or not knobs:
            raise api.ApiError(400, "expected a JSON object of knobs", None, "invalid_knobs")
        for k, v in knobs.items():
            if k not in KNOB_TYPES:
                raise api.ApiError(400, f"unknown knob {k!r}; known: {', '.join(KNOB_TYPES)}", k, "invalid_knobs")
            typ = KNOB_TYPES[k]
            if (isinstance(v, bool) and typ is not bool) or not isinstance(v, typ):
                raise api.ApiError(400, f"knob {k!r} has the wrong type ({type(v).__name__})", k, "invalid_knobs")
        if "cache_threshold" in knobs and not _finite_nonneg(knobs["cache_threshold"]):
            raise api.ApiError(400, f"cache_threshold must be a finite number >= 0, got {knobs['cache_threshold']}",
                               "cache_threshold", "invalid_knobs")
        if "cache" in knobs:
            from stepwatch.service.cache import KINDS

            if knobs["cache"] not in KINDS:
                raise api.ApiError(400, f"cache {knobs['cache']!r} is not one of {', '.join(KINDS)}", "cache",
                                   "invalid_knobs")
        if "baselines" in knobs:
            from stepwatch.exporter.shapes import ShapeKey

            shapes = knobs["baselines"].get("shapes", knobs["baselines"])
            if not isinstance(shapes, dict):
                raise api.ApiError(400, "baselines: expected {shape: {step_seconds, cache_hit_ratio}}", "baselines",
                                   "invalid_knobs")
            for shape, vals in shapes.items():
                try:
                    ShapeKey.parse(str(shape))
                except ValueError as e:
                    raise api.ApiError(400, f"baselines: {e}", "baselines", "invalid_knobs") from None
                if not isinstance(vals, dict) or not all(
                        k in ("step_seconds", "cache_hit_ratio") and _finite_nonneg(v)
                        for k, v in vals.items()):
                    raise api.ApiError(400, f"baselines: {shape}: expected {{step_seconds, cache_hit_ratio}} >= 0",
                                       "baselines", "invalid_knobs")
        if "rank_delay_seconds" in knobs:
            for r, d in knobs["rank_delay_seconds"].items():
                if not _is_uint(str(r)) or int(r) >= self.cfg.ranks or not _finite_nonneg(d):
                    raise api.ApiError(400, f"rank_delay_seconds: rank {r!r} / delay {d!r} invalid (ranks: "
                                       f"{self.cfg.ranks})", "rank_delay_seconds", "invalid_knobs")
        if not self.ready:
            raise api.ApiError(503, "warming up; retry shortly", None, "not_ready", "server_error")
        before = dict(self.knobs)
        try:
            reply = self.worker.call({"op": "knobs", "knobs": knobs}).result(timeout=self.cfg.request_timeout_seconds)
        except WorkerDied as e:
            raise api.ApiError(503, f"the worker died while applying the knobs ({e}); it is restarting", None,
                               "worker_died", "server_error", {"Retry-After": "30"}) from None
        except FutureTimeout:
            raise api.ApiError(504, "the worker did not apply the knobs in time (busy with a long request?)", None,
                               "timeout", "server_error") from None
        if reply.get("op") == "error":
            raise api.ApiError(500, f"applying knobs failed: {reply.get('message')}", None, "internal_error",
                               "server_error")
        self.knobs = reply["knobs"]
        self.fingerprint = reply["fingerprint"]
        self._publish_config()
        log.warning("admin knobs changed: %s -> %s (fingerprint %s, config %s)", before, self.knobs,
                    fingerprint_id(self.fingerprint), self.config_id())
        return {"knobs": self.knobs, "fingerprint": self.fingerprint,
                "fingerprint_id": fingerprint_id(self.fingerprint), "config_id": self.config_id()}

    def metrics_text(self) -> bytes:
        self._update_gauges()
        text = generate_latest(self.registry)
        info = self.worker.ready_info
        if info and info.get("metrics_port"):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=2) as r:
                    text += r.read()
            except OSError as e:
                log.debug("worker metrics unavailable: %s", e)
        return text


class Handler(http.server.BaseHTTPRequestHandler):
    server_version = "stepwatch"
    protocol_version = "HTTP/1.1"
    timeout = 60  # a client that stalls mid-request frees its thread
    service: Service

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, body: Any, headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: api.ApiError) -> None:
        # The body may be unread (a 411, 413, 401, 404): close rather than parse it as the next request.
        self.close_connection = True
        try:
            self._send(e.status, e.body(), e.headers)
        except (BrokenPipeError, ConnectionResetError):
            log.debug("client went away before the error answer")

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        svc = self.service
        if path == "/healthz":
            self._send(200, {"status": "ok", "worker_up": svc.worker.proc is not None and svc.worker.proc.is_alive()})
        elif path == "/readyz":
            self._send(200 if svc.ready else 503, {"ready": svc.ready})
        elif path == "/metrics":
            self._send(200, svc.metrics_text(), content_type="text/plain; version=0.0.4; charset=utf-8")
        elif path == "/v1/stepwatch/info":
            self._send(200, svc.info())
        elif path in ("/v1/images/generations", "/admin/knobs"):
            self._error(api.ApiError(405, f"use POST for {path}", None, "method_not_allowed"))
        else:
            self._error(api.ApiError(404, f"no such path {path}", None, "not_found"))

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None or not _is_uint(length):
            raise api.ApiError(411, "Content-Length is required", None, "length_required")
        n = int(length)
        if n > api.MAX_BODY_BYTES:
            raise api.ApiError(413, f"request body is {n} bytes; the limit is {api.MAX_BODY_BYTES}", None,
                               "body_too_large")
        return self.rfile.read(n)

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        svc = self.service
        if path == "/v1/images/generations":
            self._generate(svc)
        elif path == "/admin/knobs":
            self._admin(svc)
        else:
            self._error(api.ApiError(404, f"no such path {path}", None, "not_found"))

    def _generate(self, svc: Service) -> None:
        t0 = time.monotonic()
        pool = "other"
        status = 500
        try:
            body = api.parse_json(self._read_body())
            size = body.get("size") if isinstance(body.get("size"), str) else svc.cfg.default_size
            pool = svc.cfg.pool_for(str(size).lower()).name
            status, answer, headers = svc.generate(body)
            self._send(status, answer, headers)
        except api.ApiError as e:
            status = e.status
            self._error(e)
        except (BrokenPipeError, ConnectionResetError):
            status = 499  # the client went away before the answer (nginx's convention)
            log.debug("client went away before the answer")
        except Exception as e:  # never take the instance down for one request
            log.exception("unexpected error serving a request")
            status = 500
            self._error(api.ApiError(500, f"internal error: {type(e).__name__}", None, "internal_error",
                                     "server_error"))
        finally:
            svc.m.service_requests_total.labels(pool=pool, code=str(status)).inc()
            svc.m.service_request_duration_seconds.labels(pool=pool).observe(time.monotonic() - t0)

    def _admin(self, svc: Service) -> None:
        try:
            token = svc.cfg.admin_token
            if not token:
                raise api.ApiError(404, "admin endpoint is off (no admin_token configured)", None, "not_found")
            if self.client_address[0] not in ("127.0.0.1", "::1"):
                raise api.ApiError(403, "admin endpoint is loopback only", None, "forbidden")
            auth = self.headers.get("Authorization", "")
            if not hmac.compare_digest(auth.encode(), f"Bearer {token}".encode()):
                raise api.ApiError(401, "missing or wrong admin token", None, "unauthorized")
            knobs = api.parse_json(self._read_body())
            self._send(200, svc.set_knobs(knobs))
        except api.ApiError as e:
            self._error(e)
        except Exception as e:
            log.exception("admin request failed")
            self._error(api.ApiError(500, f"internal error: {type(e).__name__}", None, "internal_error",
                                     "server_error"))


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionResetError, BrokenPipeError, TimeoutError)):
            log.debug("client %s went away: %r", client_address, exc)
            return
        log.exception("error handling a request from %s", client_address)


def make_server(svc: Service, host: str, port: int) -> Server:
    handler = type("BoundHandler", (Handler,), {"service": svc})
    return Server((host, port), handler)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="service YAML (default: the embedded practice config)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s; loopback)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--ranks", type=int, choices=(1, 2), help="parallel degree (2: Ulysses over gloo)")
    p.add_argument("--compile-backend", choices=("inductor", "aot_eager", "eager"),
                   help="override compile.backend")
    p.add_argument("--no-compile", action="store_true", help="serve eager")
    p.add_argument("--admin-token", help="enable POST /admin/knobs with this bearer token (loopback only)")
    p.add_argument("--instance-id", help="instance id in metrics and answers (default: hostname:port)")


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    overrides: dict[str, Any] = {"host": args.host, "port": args.port, "ranks": args.ranks,
                                 "admin_token": args.admin_token, "instance_id": args.instance_id}
    cfg = load(args.config, overrides)
    if args.compile_backend:
        cfg.compile.backend = args.compile_backend
    if args.no_compile:
        cfg.compile.enabled = False
    return cfg


def run(args: argparse.Namespace) -> int:
    from prometheus_client import disable_created_metrics

    disable_created_metrics()
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        print(f"stepwatch serve: bad config: {e}", flush=True)
        return 2
    svc = Service(cfg)
    try:
        server = make_server(svc, cfg.host, cfg.port)
    except OSError as e:
        print(f"stepwatch serve: cannot listen on {cfg.host}:{cfg.port}: {e.strerror}", flush=True)
        return 2
    svc.start()
    stop = threading.Event()

    def _signal(signum: int, _frame: Any) -> None:
        stop.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _signal)
    signal.signal(signal.SIGINT, _signal)
    log.info("stepwatch serve on http://%s:%d (instance %s); warming up %s", cfg.host, server.server_port,
             svc.instance_id, ", ".join(cfg.warmup) or "nothing")
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        svc.stop()
        server.server_close()
    return 0
