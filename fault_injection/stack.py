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

import http.server
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from stepwatch.promapi import Alertmanager, Prometheus

log = logging.getLogger("stepwatch.stack")

ADMIN_TOKEN = "stepwatch-drill-token"
PROBE_SIZE = "256x256"
# The practice service as the drills run it: the seeds' pools, the probe shape and the baseline
# traffic shapes warmed up, drill-sized SLOs.
DRILL_SERVICE: dict[str, Any] = {
    "warmup": ["256x256", "512x512", "2048x2048"],
    "default_steps": 8,
    "cache": {"kind": "first_block_cache", "threshold": 0.7},
    "pools": {"small": {"sizes": ["256x256", "512x512"], "slo_seconds": 8, "max_wait_seconds": 16},
              "large": {"sizes": ["1024x1024", "2048x2048"], "slo_seconds": 60, "max_wait_seconds": 120}},
    "other_pool": {"slo_seconds": 60, "max_wait_seconds": 120},
    "admin_token": ADMIN_TOKEN,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
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


class WebhookReceiver:
    """Alertmanager's webhook receiver: records every notification with its arrival time."""

    def __init__(self, port: int = 0, on_notification: Callable[[Notification], None] | None = None) -> None:
        self.received: list[Notification] = []
        self._lock = threading.Lock()
        self.on_notification = on_notification
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(n) or b"{}")
                except json.JSONDecodeError:
                    self.send_response(400)
                    self.end_headers()
                    return
                note = Notification(time.time(), body.get("status", ""), list(body.get("alerts", [])), body)
                with receiver._lock:
                    receiver.received.append(note)
                if receiver.on_notification is not None:
                    try:
                        receiver.on_notification(note)
                    except Exception:
                        log.exception("webhook callback failed")
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/alerts"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="stepwatch-webhook")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def first_firing(self, alertname: str, since: float) -> Notification | None:
        with self._lock:
            for n in self.received:
                if n.received >= since and alertname in n.names("firing"):
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

    def _raise(signum: int, frame: Any) -> None:
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

    def _kill_group(self) -> None:
        # The group id is the child's pid (start_new_session); grandchildren that outlived it are still in it.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the whole group is gone already


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _http(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
          timeout: float = 600) -> tuple[int, Any, dict[str, str]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            payload, status, hdrs = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        payload, status, hdrs = e.read(), e.code, dict(e.headers)
    try:
        return status, json.loads(payload), hdrs
    except (json.JSONDecodeError, UnicodeDecodeError):
        return status, payload.decode(errors="replace"), hdrs


class Traffic:
    """Steady client load: ``concurrency`` clients cycling through request bodies."""

    def __init__(self, service_url: str, bodies: list[dict[str, Any]], concurrency: int = 2,
                 pause: float = 0.0) -> None:
        self.url = service_url + "/v1/images/generations"
        self.bodies = bodies
        self.concurrency = concurrency
        self.pause = pause
        self.codes: dict[int, int] = {}
        self.latencies: list[tuple[float, float, int]] = []  # (end time, seconds, status)
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

    def _client(self, i: int) -> None:
        k = i
        while not self._stop.is_set():
            body = {**self.bodies[k % len(self.bodies)], "seed": k}
            t = time.time()
            try:
                status, _, headers = _http("POST", self.url, body, timeout=300)
            except OSError as e:
                status, headers = 0, {}
                with self._lock:
                    self.errors.append(f"{type(e).__name__}: {e}")
            with self._lock:
                self.codes[status] = self.codes.get(status, 0) + 1
                self.latencies.append((time.time(), time.time() - t, status))
            if status == 429:
                retry = float(headers.get("Retry-After", "1"))
                self._stop.wait(min(retry, 2.0))
            elif self.pause:
                self._stop.wait(self.pause)
            k += self.concurrency

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.codes.values())


class LocalStack:
    def __init__(self, workdir: Path, *, profile: str = "drill", service_overrides: dict[str, Any] | None = None,
                 compile_backend: str | None = None, ranks: int = 1, sidecar: bool = True,
                 probe_interval: float = 8.0, attach: StackUrls | None = None,
                 on_notification: Callable[[Notification], None] | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        self.workdir = Path(workdir)
        self.profile = profile
        self.service_overrides = service_overrides or {}
        self.compile_backend = compile_backend
        self.ranks = ranks
        self.with_sidecar = sidecar
        self.probe_interval = probe_interval
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
        from stepwatch.alerts import stack as cfgs

        deadline = time.time() + timeout
        self.webhook = WebhookReceiver(on_notification=self.on_notification)
        self.webhook.start()
        # The service.
        svc_port = free_port()
        self.service_url = f"http://127.0.0.1:{svc_port}"
        svc_cfg = {**DRILL_SERVICE, **self.service_overrides}
        if self.compile_backend:
            svc_cfg["compile"] = {**svc_cfg.get("compile", {}), "backend": self.compile_backend}
        if self.ranks > 1:
            svc_cfg["ranks"] = self.ranks
        (self.workdir / "service.yaml").write_text(yaml.safe_dump(svc_cfg))
        self.progress(f"starting the practice service on :{svc_port} (warm-up compiles {svc_cfg['warmup']})")
        # Idle OpenMP threads sleep instead of spinning: on a small shared box (CI: 2 cores with the
        # sidecar, Prometheus and the test itself) spinning workers make step times swing wildly.
        svc = Child("service", [sys.executable, "-m", "stepwatch.cli", "serve", "--config",
                                str(self.workdir / "service.yaml"), "--port", str(svc_port),
                                "--instance-id", f"practice:{svc_port}"], self.workdir / "service.log",
                    env={"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")})
        self.children.append(svc)
        # Alertmanager starts while the service warms up; Prometheus only once every target it scrapes is
        # up (else TargetDown fires for the sidecar that starts after the baseline capture).
        am_port, prom_port = free_port(), free_port()
        self.alertmanager_url = f"http://127.0.0.1:{am_port}"
        self.prometheus_url = f"http://127.0.0.1:{prom_port}"
        (self.workdir / "alertmanager.yml").write_text(cfgs.alertmanager_config(self.webhook.url, self.profile))
        self.children.append(Child("alertmanager", cfgs.alertmanager_argv(
            self.workdir / "alertmanager.yml", self.workdir / "am-data", f"127.0.0.1:{am_port}"),
            self.workdir / "alertmanager.log"))
        self.am = Alertmanager(self.alertmanager_url)
        self._wait(lambda: self.am is not None and self.am.ready(), "alertmanager", deadline)
        self._wait(lambda: self._ready(), "service", deadline, child=svc)
        self.progress(f"service ready in {time.time() - self.started:.0f}s")
        sidecar_port = free_port() if self.with_sidecar else None
        self.sidecar_url = f"http://127.0.0.1:{sidecar_port}" if sidecar_port else None
        if self.with_sidecar:
            from stepwatch.exporter.sidecar.capture import capture_baseline
            from stepwatch.exporter.sidecar.config import default_probe_set

            probes = default_probe_set(size=PROBE_SIZE, steps=int(svc_cfg.get("default_steps", 8)))
            # The baseline is the lossless reference: the lossy knob under test (the cache) is off while
            # it is captured; probes then measure what the serving cache costs.
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
            probe_file = self.workdir / "probe-set.yaml"
            probe_file.write_text(yaml.safe_dump(probes.to_dict()))
            sidecar = Child("sidecar", [
                sys.executable, "-m", "stepwatch.cli", "sidecar", "--target", self.service_url,
                "--port", str(sidecar_port), "--baseline-dir", str(self.workdir / "baselines"),
                "--probe-set", str(probe_file), "--interval", f"{self.probe_interval:g}"],
                self.workdir / "sidecar.log")
            self.children.append(sidecar)
            self._wait(lambda: _up(f"{self.sidecar_url}/metrics"), "sidecar", deadline, child=sidecar)
        rules = cfgs.rule_file(self.profile)
        if not rules.is_file():  # a checkout without generated rules: generate them for this run
            from stepwatch.alerts.rulegen import rules_file
            from stepwatch.alerts.thresholds import load as load_thresholds

            rules = self.workdir / f"stepwatch-{self.profile}.rules.yml"
            rules.write_text(rules_file(load_thresholds(), self.profile))
        (self.workdir / "prometheus.yml").write_text(cfgs.prometheus_config(
            f"{self.service_url}/metrics", f"{self.sidecar_url}/metrics" if self.sidecar_url else None,
            rule_files=[rules], alertmanager_url=self.alertmanager_url, profile=self.profile))
        self.children.append(Child("prometheus", cfgs.prometheus_argv(
            self.workdir / "prometheus.yml", self.workdir / "prom-data", f"127.0.0.1:{prom_port}"),
            self.workdir / "prometheus.log"))
        self.prom = Prometheus(self.prometheus_url)
        self._wait(lambda: self.prom.ready(), "prometheus", deadline)
        jobs = {cfgs.SERVICE_JOB} | ({cfgs.SIDECAR_JOB} if self.with_sidecar else set())
        self.prom.wait_targets_up(jobs, timeout=max(30.0, deadline - time.time()))
        self.progress(f"stack up in {time.time() - self.started:.0f}s: service {self.service_url}, "
                      f"prometheus {self.prometheus_url}, alertmanager {self.alertmanager_url}")

    def _ready(self) -> bool:
        try:
            return _http("GET", self.service_url + "/readyz", timeout=2)[0] == 200
        except OSError:
            return False

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
    def generate(self, **body: Any) -> tuple[int, Any, dict[str, str]]:
        body.setdefault("prompt", "a lighthouse at dusk")
        return _http("POST", self.service_url + "/v1/images/generations", body)

    def knobs(self, **knobs: Any) -> dict[str, Any]:
        status, body, _ = _http("POST", self.service_url + "/admin/knobs", knobs,
                                {"Authorization": f"Bearer {self.admin_token}"})
        if status != 200:
            raise RuntimeError(f"admin knobs {knobs}: HTTP {status}: {body}")
        return dict(body)

    def healthy(self) -> bool:
        try:
            return _http("GET", self.service_url + "/healthz", timeout=5)[0] == 200 and self._ready()
        except OSError:
            return False

    def info(self) -> dict[str, Any]:
        return dict(_http("GET", self.service_url + "/v1/stepwatch/info", timeout=30)[1])

    @contextmanager
    def traffic(self, bodies: list[dict[str, Any]] | None = None, concurrency: int = 2,
                pause: float = 0.0) -> Iterator[Traffic]:
        t = Traffic(self.service_url, bodies or [{"prompt": "a lighthouse at dusk", "size": "512x512"},
                                                 {"prompt": "a red bicycle", "size": "256x256"}],
                    concurrency, pause).start()
        try:
            yield t
        finally:
            t.stop()

    def logs(self) -> dict[str, str]:
        return {c.name: c.tail() for c in self.children}
