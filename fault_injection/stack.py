"""The local stack on loopback: practice service, sidecar, Prometheus, Alertmanager, webhook receiver.

No systemd: every part is a child process with its own config and data
directory under one work directory, on free loopback ports, and everything is
stopped when the stack closes.  ``attach=`` skips starting and uses the URLs
of a stack that is already running.

    with LocalStack(Path("run")) as stack:
        stack.prom.query("up")
        with stack.traffic(concurrency=2):
            ...
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import yaml
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from stepwatch import httpclient
from stepwatch.alerts import stack as cfgs
from stepwatch.alerts.rulegen import rules_file
from stepwatch.asgi import ThreadedServer
from stepwatch.exporter.sidecar.capture import capture_baseline
from stepwatch.exporter.sidecar.config import ProbeSet, default_probe_set, default_stream_probe_set
from stepwatch.promapi import Alertmanager, Prometheus
from stepwatch.thresholds import load as load_thresholds

log = logging.getLogger("stepwatch.stack")

ADMIN_TOKEN = "stepwatch-drill-token"
PROBE_SIZE = "256x256"
# The practice service as the drills run it: the seeds' pools, the probe shape and the baseline
# traffic shapes warmed up, drill-sized SLOs.
DRILL_SERVICE: dict[str, Any] = {
    "warmup": ["256x256", "512x512", "2048x2048"],
    "default_steps": 8,
    "served_steps": [50],  # cache-off's clients (512² at 50 steps: a label and baselines of their own)
    "cache": {"kind": "first_block_cache", "threshold": 0.7},
    "pools": {"small": {"sizes": ["256x256", "512x512"], "slo_seconds": 8, "max_wait_seconds": 16},
              "large": {"sizes": ["1024x1024", "2048x2048"], "slo_seconds": 60, "max_wait_seconds": 120}},
    "other_pool": {"slo_seconds": 60, "max_wait_seconds": 120},
    "admin_token": ADMIN_TOKEN,
    "thresholds_profile": "drill",  # the stall limit of the rules this stack's Prometheus runs
    "stream": {"enabled": True},  # streaming sessions (ignored with two ranks): the stream drills' service
}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class StackUrls:
    service: str
    prometheus: str
    alertmanager: str | None = None
    sidecar: str | None = None
    webhook: str | None = None
    admin_token: str | None = None


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


@contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """While inside, SIGTERM raises SystemExit (143), so ``finally`` blocks stop children and restore faults.

    CI stops a job with SIGTERM; Python's default for it ends the process at once,
    leaving the service, Prometheus and a fault in place.  Only the main thread can
    install a handler: elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Child:
    """A child process with its output in a log file.

    It leads a process group of its own (``start_new_session``), so ``stop()``
    also ends what it started (the service's worker and rank processes).
    """

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        except BaseException:
            self._log.close()
            raise

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 3000) -> str:
        self._log.flush()
        try:
            return self.log_path.read_text()[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to the child (it stops its own children), then SIGKILL to whatever is left of its group."""
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    pass
            self._kill_group()
            if self.proc.poll() is None:
                self.proc.wait(timeout=10)
        finally:
            self._log.close()

    def crash(self) -> None:
        """SIGKILL to the child's whole group, as a node or an OOM killer ends it: nothing runs its finally."""
        self._kill_group()
        self.proc.wait(timeout=10)
        self._log.close()

    def _kill_group(self) -> None:
        # The group id is the child's pid (start_new_session); grandchildren that outlived it are still in it.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the whole group is gone already


def _http(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None, timeout: float = 600,
          via: httpx.Client | None = None) -> tuple[int, Any, Mapping[str, str]]:
    """(status, JSON body or text, headers) of one request; ``via`` reuses a client's connection.

    Error statuses are answers, not exceptions; a transport failure raises ``httpx.HTTPError``.
    """
    kwargs: dict[str, Any] = {"json": body, "headers": headers or {}, "timeout": timeout}
    r = via.request(method, url, **kwargs) if via is not None else httpclient.request(method, url, **kwargs)
    try:
        return r.status_code, r.json(), r.headers
    except ValueError:
        return r.status_code, r.text, r.headers


def set_knobs(service_url: str, admin_token: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """``POST /admin/knobs`` on one service; the knobs it now has, or RuntimeError naming the refusal."""
    status, body, _ = _http("POST", service_url + "/admin/knobs", knobs, {"Authorization": f"Bearer {admin_token}"})
    if status != 200:
        raise RuntimeError(f"admin knobs {knobs} on {service_url}: HTTP {status}: {body}")
    return dict(body)


class Traffic:
    """Steady client load: ``concurrency`` clients cycling through request bodies."""

    def __init__(self, service_url: str, bodies: list[dict[str, Any]], concurrency: int = 2,
                 pause: float = 0.0) -> None:
        self.url = service_url + "/v1/images/generations"
        self.bodies = bodies
        self.concurrency = concurrency
        self.pause = pause
        self.codes: dict[int, int] = {}
        self.latencies: list[tuple[float, float, int, str]] = []  # (end time, seconds, status, size)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self) -> Traffic:
        for i in range(self.concurrency):
            t = threading.Thread(target=self._client, args=(i,), daemon=True, name=f"stepwatch-traffic-{i}")
            t.start()
            self._threads.append(t)
        return self

    def add_client(self) -> None:
        """One more client, now (a ramp of load: the pool-short drill)."""
        t = threading.Thread(target=self._client, args=(len(self._threads),), daemon=True,
                             name=f"stepwatch-traffic-{len(self._threads)}")
        t.start()
        self._threads.append(t)

    def _client(self, i: int) -> None:
        """One client on one kept-alive connection, as an SDK client sends; 429s wait Retry-After (at most 2 s)."""
        k = i
        with httpclient.client(timeout=300) as via:
            while not self._stop.is_set():
                bodies = self.bodies  # once: a drill may swap the list meanwhile (prompt-mix-shift)
                status, headers = self._send({**bodies[k % len(bodies)], "seed": k}, via)
                if status == 429:
                    self._stop.wait(min(float(headers.get("Retry-After", "1")), 2.0))
                elif self.pause:
                    self._stop.wait(self.pause)
                k += max(1, self.concurrency)

    def _send(self, body: dict[str, Any], via: httpx.Client) -> tuple[int, Mapping[str, str]]:
        t = time.time()
        status: int
        headers: Mapping[str, str]
        try:
            status, _, headers = _http("POST", self.url, body, timeout=300, via=via)
        except httpx.HTTPError as e:
            status, headers = 0, {}
            with self._lock:
                self.errors.append(f"{type(e).__name__}: {e}")
        with self._lock:
            self.codes[status] = self.codes.get(status, 0) + 1
            self.latencies.append((time.time(), time.time() - t, status, str(body.get("size", ""))))
        return status, headers

    def median_by_size(self, start: float, end: float) -> dict[str, tuple[float, int]]:
        """(median seconds, count) of the 200s that ended in [start, end), per requested size: the baseline's
        typical request, exact (a histogram's p50 over a two-size mix sits between the sizes' modes and jumps
        from one to the other when the mix shifts slightly)."""
        with self._lock:
            rows = [(size, sec) for end_t, sec, status, size in self.latencies
                    if status == 200 and start <= end_t < end]
        out: dict[str, tuple[float, int]] = {}
        for size in sorted({size for size, _ in rows}):
            secs = [sec for sz, sec in rows if sz == size]
            out[size] = (statistics.median(secs), len(secs))
        return out

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.codes.values())


class Arrivals(Traffic):
    """Open-loop load: ``rate`` requests a second whatever the service answers, each on a thread of its own.

    Closed-loop clients (``Traffic``) wait for their answer, so a service that stops answering holds at
    most one request per client: the queue behind a hung worker never grows.  Users keep arriving, so
    behind a real one it does.  A request that waits ties up only its own thread (at most ``cap`` at once;
    past that an arrival is dropped and counted as status -1).  ``stop()`` ends the arrivals; the ones
    waiting keep their threads until the service answers them (``wait_answered``).
    """

    def __init__(self, service_url: str, body: dict[str, Any], rate: float, cap: int = 256) -> None:
        super().__init__(service_url, [body], concurrency=0)
        self.rate, self.cap = rate, cap
        self.waiting = 0  # arrivals not answered yet

    def start(self) -> Arrivals:
        t = threading.Thread(target=self._tick, daemon=True, name="stepwatch-arrivals")
        t.start()
        self._threads.append(t)
        return self

    def _tick(self) -> None:
        k, next_at = 0, time.monotonic()
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            next_at += 1.0 / self.rate
            k += 1
            with self._lock:
                full = self.waiting >= self.cap
                if full:
                    self.codes[-1] = self.codes.get(-1, 0) + 1
                else:
                    self.waiting += 1
            if not full:
                threading.Thread(target=self._one, args=({**self.bodies[0], "seed": k},), daemon=True,
                                 name="stepwatch-arrival").start()

    def _one(self, body: dict[str, Any]) -> None:
        try:
            with httpclient.client(timeout=300) as via:
                self._send(body, via)
        finally:
            with self._lock:
                self.waiting -= 1

    def wait_answered(self, timeout: float) -> bool:
        """True once every arrival has its answer (within ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while self.waiting and time.monotonic() < deadline:
            time.sleep(0.5)
        return not self.waiting


@contextmanager
def running_traffic(holder: Any, url: str, bodies: list[dict[str, Any]], concurrency: int,
                    pause: float) -> Iterator[Traffic]:
    """Clients on ``url`` for the ``with`` block, published as ``holder.active_traffic`` meanwhile (what a drill's
    checks read); the one stack.traffic() of LocalStack and FleetStack."""
    t = Traffic(url, bodies, concurrency, pause).start()
    holder.active_traffic = t
    try:
        yield t
    finally:
        t.stop()
        holder.active_traffic = None


# The practice stack's steady clients: one prompt per size (both hit 3 of 8 steps with the default cache).
DEFAULT_MIX: tuple[dict[str, Any], ...] = ({"prompt": "a lighthouse at dusk", "size": "512x512"},
                                           {"prompt": "a red bicycle", "size": "256x256"})


class LocalStack:
    def __init__(self, workdir: Path, *, profile: str = "drill", service_overrides: dict[str, Any] | None = None,
                 compile_backend: str | None = None, ranks: int = 1, sidecar: bool = True,
                 probe_interval: float = 8.0, attach: StackUrls | None = None, stream_probe: bool = False,
                 on_notification: Callable[[Notification], None] | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        self.workdir = Path(workdir)
        self.profile = profile
        self.service_overrides = service_overrides or {}
        self.compile_backend = compile_backend
        self.ranks = ranks
        # The sidecar's stand-in GPUs (exporter/sidecar/practice_gpus.py): none until a drill writes them.
        self.practice_gpus = self.workdir / "practice-gpus.json"
        self.with_sidecar = sidecar
        self.probe_interval = probe_interval
        # The sidecar's drift probe (one streaming session on each probe run): only for stacks whose drills read it,
        # since its sessions' chunks also count in the service's stream series (the stall alert's).
        self.stream_probe = stream_probe
        self.attach = attach
        self.on_notification = on_notification
        self.progress = progress or (lambda msg: log.info(msg))
        self.children: list[Child] = []
        self.webhook: WebhookReceiver | None = None
        self.service_url = self.prometheus_url = ""
        self.alertmanager_url: str | None = None
        self.sidecar_url: str | None = None
        self.admin_token = ADMIN_TOKEN
        self.prom: Prometheus
        self.am: Alertmanager | None = None
        self.started = 0.0
        self.prometheus_started = 0.0  # the first scrape: event queries need one rate window of history after it
        self.active_traffic: Traffic | None = None  # the steady client load running now (stack.traffic())

    # ----- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self, timeout: float = 600.0) -> None:
        self.started = time.time()
        if self.attach is not None:
            a = self.attach
            self.service_url, self.prometheus_url = a.service.rstrip("/"), a.prometheus.rstrip("/")
            self.alertmanager_url, self.sidecar_url = a.alertmanager, a.sidecar
            self.admin_token = a.admin_token or ADMIN_TOKEN
            self.prom = Prometheus(self.prometheus_url)
            self.prometheus_started = self.started
            self.am = Alertmanager(a.alertmanager) if a.alertmanager else None
            self.webhook = None
            self.progress(f"attached to {self.service_url} and {self.prometheus_url}")
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_all(timeout)
        except BaseException:
            self.stop()
            raise

    def _start_all(self, timeout: float) -> None:
        """Webhook, service and Alertmanager (which start while the service warms up), sidecar, Prometheus.

        Prometheus starts last, once every target it scrapes is up: else TargetDown fires for
        the sidecar, which starts only after the quality baseline is captured.
        """
        deadline = time.time() + timeout
        self.webhook = WebhookReceiver(on_notification=self.on_notification)
        self.webhook.start()
        svc, svc_cfg = self._start_service()
        self._start_alertmanager(self.webhook.url, deadline)
        self._wait(lambda: self._ready(), "service", deadline, child=svc)
        self.progress(f"service ready in {time.time() - self.started:.0f}s")
        if self.with_sidecar:
            self._start_sidecar(int(svc_cfg.get("default_steps", 8)), deadline)
        self._start_prometheus(deadline)
        self.progress(f"stack up in {time.time() - self.started:.0f}s: service {self.service_url}, "
                      f"prometheus {self.prometheus_url}, alertmanager {self.alertmanager_url}")

    def _service_config(self) -> dict[str, Any]:
        cfg = {**DRILL_SERVICE, **self.service_overrides}
        if self.compile_backend:
            cfg["compile"] = {**cfg.get("compile", {}), "backend": self.compile_backend}
        if self.ranks > 1:
            cfg["ranks"] = self.ranks
        return cfg

    def restart_service(self, timeout: float = 600.0) -> None:
        """Stop the practice service and start it again on the same port, as a rollout restarts a pod.

        Its counters start again from zero and its runtime knobs (baselines included) are gone, as on
        any restart: the caller publishes baselines again.
        """
        self._stop_child("service")
        svc, _ = self._start_service(port=int(self.service_url.rsplit(":", 1)[1]))
        self._wait(lambda: self._ready(), "service (restarted)", time.time() + timeout, child=svc)

    def crash(self, name: str) -> None:
        """Kill a child (``service`` with its worker, ``sidecar``) with SIGKILL; ``restart_*`` brings it back.

        The dead child leaves ``children`` at once: waiting for another one to start checks that every
        child is alive, and a crashed one is meant to be dead."""
        child = self._child(name)
        child.crash()
        self.children.remove(child)

    def restart_sidecar(self, timeout: float = 120.0) -> None:
        """The sidecar again on its port, with the baselines it had (no capture: the store is on disk)."""
        self._stop_child("sidecar")
        port = int(str(self.sidecar_url).rsplit(":", 1)[1])
        self._run_sidecar(port, time.time() + timeout)

    def _stop_child(self, name: str) -> None:
        """Stop a child if it still runs (a crashed one is gone already)."""
        for c in [c for c in self.children if c.name == name]:
            c.stop()
            self.children.remove(c)

    def _child(self, name: str) -> Child:
        for c in self.children:
            if c.name == name:
                return c
        raise KeyError(f"the stack has no {name} (attached, or started without it)")

    def _start_service(self, port: int | None = None) -> tuple[Child, dict[str, Any]]:
        port = port or free_port()
        self.service_url = f"http://127.0.0.1:{port}"
        cfg = self._service_config()
        (self.workdir / "service.yaml").write_text(yaml.safe_dump(cfg))
        self.progress(f"starting the practice service on :{port} (warm-up compiles {cfg['warmup']})")
        # Idle OpenMP threads sleep instead of spinning: on a small shared box (CI: 2 cores with the
        # sidecar, Prometheus and the test itself) spinning workers make step times swing wildly.
        svc = Child("service", [sys.executable, "-m", "stepwatch.cli", "serve", "--config",
                                str(self.workdir / "service.yaml"), "--port", str(port),
                                "--instance-id", f"practice:{port}"], self.workdir / "service.log",
                    env={"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")})
        self.children.append(svc)
        return svc, cfg

    def _start_alertmanager(self, webhook_url: str, deadline: float) -> None:
        port = free_port()
        self.alertmanager_url = f"http://127.0.0.1:{port}"
        (self.workdir / "alertmanager.yml").write_text(cfgs.alertmanager_config(webhook_url, self.profile))
        self.children.append(Child("alertmanager", cfgs.alertmanager_argv(
            self.workdir / "alertmanager.yml", self.workdir / "am-data", f"127.0.0.1:{port}"),
            self.workdir / "alertmanager.log"))
        am = self.am = Alertmanager(self.alertmanager_url)
        self._wait(am.ready, "alertmanager", deadline)

    def _start_sidecar(self, steps: int, deadline: float) -> None:
        probes = default_probe_set(size=PROBE_SIZE, steps=steps)
        self._capture_baseline(probes)
        (self.workdir / "probe-set.yaml").write_text(yaml.safe_dump(probes.to_dict()))
        if self.stream_probe:
            stream = default_stream_probe_set()
            self.progress(f"capturing the stream baseline session ({stream.items[0].chunks} chunks at "
                          f"{stream.items[0].size})")
            capture_baseline(self.service_url, stream, self.workdir / "baselines")
            (self.workdir / "stream-probe-set.yaml").write_text(yaml.safe_dump(stream.to_dict()))
        self._run_sidecar(free_port(), deadline)

    def _run_sidecar(self, port: int, deadline: float) -> None:
        self.sidecar_url = f"http://127.0.0.1:{port}"
        probe_file = self.workdir / "probe-set.yaml"
        sidecar = Child("sidecar", [
            sys.executable, "-m", "stepwatch.cli", "sidecar", "--target", self.service_url,
            "--port", str(port), "--baseline-dir", str(self.workdir / "baselines"),
            "--probe-set", str(probe_file), "--interval", f"{self.probe_interval:g}",
            "--practice-gpus", str(self.practice_gpus),
            *(["--stream-probe-set", str(self.workdir / "stream-probe-set.yaml")] if self.stream_probe else [])],
            self.workdir / "sidecar.log")
        self.children.append(sidecar)
        self._wait(lambda: httpclient.ok(f"{self.sidecar_url}/metrics"), "sidecar", deadline, child=sidecar)

    def _capture_baseline(self, probes: ProbeSet) -> None:
        """The lossless reference: the lossy knob under test (the cache) is off while it is captured.

        Probes then measure what the serving cache costs.
        """
        serving = self.info()["knobs"]
        self.progress("capturing the quality baseline (20 probes, cache off)")
        self.knobs(cache="none")
        try:
            capture_baseline(self.service_url, probes, self.workdir / "baselines")
        finally:
            restore = {"cache": serving.get("cache", "none")}
            if serving.get("cache_threshold") is not None:
                restore["cache_threshold"] = serving["cache_threshold"]
            self.knobs(**restore)

    def _start_prometheus(self, deadline: float) -> None:
        port = free_port()
        self.prometheus_url = f"http://127.0.0.1:{port}"
        rules = cfgs.rule_file(self.profile)
        if not rules.is_file():  # a checkout without generated rules: generate them for this run
            rules = self.workdir / f"stepwatch-{self.profile}.rules.yml"
            rules.write_text(rules_file(load_thresholds(), self.profile))
        (self.workdir / "prometheus.yml").write_text(cfgs.prometheus_config(
            f"{self.service_url}/metrics", f"{self.sidecar_url}/metrics" if self.sidecar_url else None,
            rule_files=[rules], alertmanager_url=self.alertmanager_url, profile=self.profile))
        self.children.append(Child("prometheus", cfgs.prometheus_argv(
            self.workdir / "prometheus.yml", self.workdir / "prom-data", f"127.0.0.1:{port}"),
            self.workdir / "prometheus.log"))
        self.prom = Prometheus(self.prometheus_url)
        self._wait(lambda: self.prom.ready(), "prometheus", deadline)
        jobs = {cfgs.SERVICE_JOB} | ({cfgs.SIDECAR_JOB} if self.with_sidecar else set())
        self.prom.wait_targets_up(jobs, timeout=max(30.0, deadline - time.time()))
        self.prometheus_started = time.time()

    def _ready(self) -> bool:
        return httpclient.ok(self.service_url + "/readyz")

    def _wait(self, ok: Callable[[], bool], what: str, deadline: float, child: Child | None = None) -> None:
        while time.time() < deadline:
            if ok():
                return
            for c in self.children:
                if not c.alive():
                    raise RuntimeError(f"{c.name} exited with {c.proc.returncode}:\n{c.tail()}")
            time.sleep(0.3)
        raise TimeoutError(f"{what} not ready in time" + (f":\n{child.tail()}" if child else ""))

    def stop(self) -> None:
        for c in reversed(self.children):
            try:
                c.stop()
            except Exception:
                log.exception("stopping %s", c.name)
        self.children = []
        if self.webhook is not None:
            self.webhook.stop()
            self.webhook = None

    # ----- driving it -----------------------------------------------------------------------
    def generate(self, **body: Any) -> tuple[int, Any, Mapping[str, str]]:
        body.setdefault("prompt", "a lighthouse at dusk")
        return _http("POST", self.service_url + "/v1/images/generations", body)

    def describe(self) -> str:
        """The stack in a recorded scenario's words."""
        compile_label = "off" if self.ranks > 1 else (self.compile_backend or "the service config's")
        return f"a LocalStack ({self.ranks} rank(s), compile {compile_label}, {self.profile} profile)"

    def knobs(self, **knobs: Any) -> dict[str, Any]:
        return set_knobs(self.service_url, self.admin_token, knobs)

    def healthy(self) -> bool:
        return httpclient.ok(self.service_url + "/healthz", timeout=5) and self._ready()

    def info(self) -> dict[str, Any]:
        return dict(_http("GET", self.service_url + "/v1/stepwatch/info", timeout=30)[1])

    @contextmanager
    def traffic(self, bodies: list[dict[str, Any]] | None = None, concurrency: int = 2,
                pause: float = 0.0) -> Iterator[Traffic]:
        with running_traffic(self, self.service_url, bodies or list(DEFAULT_MIX), concurrency, pause) as t:
            yield t

    def logs(self) -> dict[str, str]:
        return {c.name: c.tail() for c in self.children}
