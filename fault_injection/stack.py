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

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from stepwatch import httpclient
from stepwatch.alerts import stack as cfgs
from stepwatch.alerts.rulegen import rules_file
from stepwatch.exporter.sidecar.capture import capture_baseline
from stepwatch.exporter.sidecar.config import ProbeSet, default_probe_set, default_stream_probe_set
from stepwatch.fault_injection.traffic import Traffic, _http, running_traffic, set_knobs
from stepwatch.fault_injection.webhook import Notification, WebhookReceiver
from stepwatch.procs import Child, free_port
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


@dataclass
class StackUrls:
    service: str
    prometheus: str
    alertmanager: str | None = None
    sidecar: str | None = None
    webhook: str | None = None
    admin_token: str | None = None


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
        # The per-shape baselines last published (the drill runner's calibrated ones): a restart publishes them
        # again, as a rollout keeps its baseline file.
        self.baselines: dict[str, Any] = {}

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
        # The last start-up configuration, kept across restarts: a restart onto another one is a rollout.
        cfg.setdefault("state_dir", str(self.workdir / "service-state"))
        return cfg

    def restart_service(self, timeout: float = 600.0) -> None:
        """Stop the practice service and start it again on the same port, as a rollout restarts a pod.

        Its counters start again from zero and its runtime knobs are gone, as on any restart; the
        baselines last published (``baselines``) are published again once it is ready.
        """
        self._stop_child("service")
        svc, _ = self._start_service(port=int(self.service_url.rsplit(":", 1)[1]))
        self._wait(lambda: self._ready(), "service (restarted)", time.time() + timeout, child=svc)
        if self.baselines:
            self.knobs(baselines={"shapes": self.baselines})

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
