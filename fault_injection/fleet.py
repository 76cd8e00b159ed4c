"""The practice fleet on loopback: replicas behind haproxy, per-node Prometheus agents remote-writing to an HA pair
of central evaluators, two Alertmanagers clustered by gossip (``stepwatch fleet up``, ``stepwatch bench fleet``).

Every part is a child process on a free loopback port, as in the one-instance stack (fault_injection/stack.py):

    replica i: service (its own worker) + sidecar          haproxy (leastconn, /readyz checks, /metrics)
        │ scraped by the agent of node i % nodes                │ scraped by node 0's agent
        ▼                                                       ▼                ▲ probed through it
    Prometheus agent per node ── remote_write ──► central evaluator a, b (rules) ◄─ blackbox exporter
                                                          │ alerts (evaluator label dropped)
                                                          ▼
                                     Alertmanager 1 ◄─ gossip ─► Alertmanager 2 ──► webhook (once)

Replicas run compile off with the small pool warmed up (three workers share two cores here).  Each replica has
a loopback address of its own (127.0.0.10, .11, ...: a pod's IP) and its sidecar one stand-in GPU (a state
file a drill can set throttled, exporter/sidecar/practice_gpus.py).  The sidecars probe nothing until a drill
that reads output quality (replica-config-drift) turns the probers on (``enable_probes``: every sidecar
restarted with them): then each sidecar probes its own replica with a four-image set against one baseline,
captured on replica 0 with the cache off (all replicas are one deployment: one fingerprint), so the central
store holds one PSNR per replica and a bad instance shows as the spread between them.  Four images, not the
one-instance stack's twenty: three probers share the two cores with three workers.  Off until then because a
probe is a request like any other: the load test counts every request per replica.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from stepwatch import httpclient
from stepwatch.alerts import fleet as fcfg
from stepwatch.alerts import stack as cfgs
from stepwatch.exporter.sidecar.capture import capture_baseline
from stepwatch.exporter.sidecar.config import ProbeSet, default_probe_set
from stepwatch.exporter.sidecar.practice_gpus import write_state
from stepwatch.fault_injection import queries
from stepwatch.fault_injection.stack import ADMIN_TOKEN, DRILL_SERVICE, PROBE_SIZE
from stepwatch.fault_injection.traffic import Traffic, running_traffic, set_knobs
from stepwatch.fault_injection.webhook import WebhookReceiver
from stepwatch.procs import Child, free_port
from stepwatch.promapi import Alertmanager, Prometheus
from stepwatch.service.balancer import haproxy_argv, haproxy_config, in_flight, set_state
from stepwatch.thresholds import balancer_job, parse_duration
from stepwatch.thresholds import load as load_thresholds

log = logging.getLogger("stepwatch.fleet")

# Each replica: the drill service without its large pool's warm-up, compile, video or streaming (three workers
# warm up on two cores at once).
REPLICA_SERVICE: dict[str, Any] = {**DRILL_SERVICE, "warmup": ["256x256"], "served_steps": [],
                                   "compile": {"enabled": False},
                                   "stream": {"enabled": False}, "video": {"enabled": False}}
FLEET_PROBE_INTERVAL_S = 10.0


def fleet_probe_set() -> ProbeSet:
    """Two prompts x two seeds of the one-instance probe set: p10 of four images is their worst but one."""
    items = default_probe_set(size=PROBE_SIZE, steps=int(REPLICA_SERVICE["default_steps"])).items
    return ProbeSet("fleet", tuple(items[:4]))


def _ok(url: str) -> Callable[[], bool]:
    return lambda: httpclient.ok(url)


def _has_targets(prom: Prometheus, n: int) -> Callable[[], bool]:
    return lambda: len(prom.query(queries.targets_up())) >= n


def _agents_up(prom: Prometheus, n: int) -> Callable[[], bool]:
    return lambda: sum(s.value for s in prom.query(queries.agents_up())) >= n


def replica_host(index: int) -> str:
    """Replica ``index``'s own loopback address (Linux routes all of 127/8 to ``lo``): its service and sidecar
    listen there, as a pod's containers share the pod's IP, so a check that finds a replica's sidecar by its
    host (instance-slow.md's throttle check) finds that replica's and no other's."""
    return f"127.0.0.{10 + index}"


@dataclass
class Replica:
    name: str
    service_url: str
    sidecar_url: str
    node: str
    gpus: Path  # the sidecar's stand-in GPU (exporter/sidecar/practice_gpus.py): one per replica, unthrottled

    @property
    def host(self) -> str:
        return self.service_url.removeprefix("http://").rsplit(":", 1)[0]


def _sidecar_argv(r: Replica, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "stepwatch.cli", "sidecar", "--target", r.service_url, "--host", r.host, "--port",
            r.sidecar_url.rsplit(":", 1)[1], "--practice-gpus", str(r.gpus), *extra]


@dataclass
class FleetStack:
    """``start()`` brings the fleet up (or raises, with every child stopped); ``stop()`` ends it."""

    workdir: Path
    replicas: int = 3
    nodes: int = 2
    profile: str = "drill"
    probing: bool = False  # the sidecars probe their replicas' output quality (enable_probes)
    progress: Callable[[str], None] = field(default=lambda msg: log.info(msg))
    children: list[Child] = field(default_factory=list)
    members: list[Replica] = field(default_factory=list)
    balancer_url: str = ""
    balancer_metrics_url: str = ""
    blackbox_url: str = ""
    agents: list[str] = field(default_factory=list)
    evaluators: list[str] = field(default_factory=list)
    alertmanagers: list[str] = field(default_factory=list)
    webhook: WebhookReceiver | None = None
    _argv: dict[str, tuple[list[str], dict[str, str] | None]] = field(default_factory=dict)
    active_traffic: Traffic | None = None
    evaluator_rss_empty: float = 0.0  # evaluator a's resident bytes before any agent wrote (the scale table's zero)
    started: float = 0.0

    def __post_init__(self) -> None:
        if self.replicas < 2 or self.nodes < 2 or self.nodes > self.replicas:
            raise ValueError(f"a fleet needs 2+ replicas over 2+ nodes, no node empty (got {self.replicas} "
                             f"replicas, {self.nodes} nodes)")
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)

    # ----- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> FleetStack:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self, timeout: float = 600.0) -> None:
        t0 = self.started = time.time()
        deadline = t0 + timeout
        try:
            self.webhook = WebhookReceiver()
            self.webhook.start()
            self._start_alertmanagers(deadline)
            self._start_blackbox(deadline)
            self._start_evaluators(deadline)
            self._start_replicas(deadline)
            self._start_balancer(deadline)
            self._start_agents(deadline)
        except BaseException:
            self.stop()
            raise
        self.progress(f"fleet up in {time.time() - t0:.0f}s: balancer {self.balancer_url}, "
                      f"{len(self.members)} replicas, evaluators {', '.join(self.evaluators)}, "
                      f"alertmanagers {', '.join(self.alertmanagers)}")

    def stop(self) -> None:
        """Every child stopped at once (each gets its SIGTERM grace; one after another took ~50 s)."""
        def stop_one(c: Child) -> None:
            try:
                c.stop()
            except Exception:  # keep stopping the others
                log.exception("stopping %s", c.name)

        with ThreadPoolExecutor(max_workers=max(1, len(self.children))) as pool:
            list(pool.map(stop_one, reversed(self.children)))
        self.children.clear()
        if self.balancer_url:
            Path(self.admin_socket).unlink(missing_ok=True)
        if self.webhook is not None:
            self.webhook.stop()
            self.webhook = None

    # ----- the parts ------------------------------------------------------------------------
    def _child(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        self._argv[name] = (argv, env)
        c = Child(name, argv, self.workdir / f"{name}.log", env=env)
        self.children.append(c)
        return c

    # ----- faults on the parts (fault_injection/fleet_drills.py) -----------------------------
    def crash(self, name: str) -> None:
        """SIGKILL a child and its group (``replica-1``, ``replica-1-sidecar``, ``alertmanager-1``, ``central-a``)."""
        child = self._find(name)
        child.crash()
        self.children.remove(child)

    def restart(self, name: str, ready: Callable[[], bool], timeout: float = 300.0) -> None:
        """A crashed (or stopped) child again with its argv, its port and its data directory; waits for ``ready``."""
        if any(c.name == name for c in self.children):
            self.crash(name)
        self._respawn(name, ready, "restarted", timeout)

    def _respawn(self, name: str, ready: Callable[[], bool], how: str, timeout: float) -> None:
        """A gone child started again from its recorded argv (its port, data directory and config file)."""
        argv, env = self._argv[name]
        self.children.append(Child(name, argv, self.workdir / f"{name}.{how}-{time.time():.0f}.log", env=env))
        self._wait(ready, f"{name} ({how})", time.time() + timeout)

    @property
    def admin_socket(self) -> str:
        """haproxy's runtime API: a short path of its own (a unix socket's path is at most 107 bytes; a test's
        workdir can be longer)."""
        return f"{tempfile.gettempdir()}/stepwatch-haproxy-{self.balancer_url.rsplit(':', 1)[-1]}.sock"

    def rollout(self, name: str, ready: Callable[[], bool], changes: dict[str, Any] | None = None,
                timeout: float = 300.0) -> None:
        """A replica restarted on a new config file, as a rolling update does with its ConfigMap: out of the
        balancer (drained: its requests in flight finish, no new one comes), SIGTERM, the same argv, port and
        instance id on the new file, back in once ready.  ``changes``: top-level service config keys that differ
        from the fleet's (None: the fleet's own config)."""
        (self.workdir / f"{name}.yaml").write_text(yaml.safe_dump({**REPLICA_SERVICE, **(changes or {})}))
        set_state(self.admin_socket, name, "drain")
        self._wait(lambda: in_flight(self.admin_socket, name) == 0, f"{name} drained", time.time() + timeout)
        child = self._find(name)
        child.stop()
        self.children.remove(child)
        self._respawn(name, ready, "rolled-out", timeout)
        set_state(self.admin_socket, name, "ready")

    def _find(self, name: str) -> Child:
        for c in self.children:
            if c.name == name:
                return c
        raise KeyError(f"the fleet has no running {name}; children: {', '.join(c.name for c in self.children)}")

    def child_pid(self, name: str) -> int:
        """The pid (and process group) of a running child."""
        return int(self._find(name).proc.pid)

    def replica(self, name: str) -> Replica:
        return next(r for r in self.members if r.name == name)

    @property
    def scrape_interval_s(self) -> float:
        return parse_duration(load_thresholds().profiles[self.profile].scrape_interval, "scrape_interval")

    @property
    def group_interval_s(self) -> float:
        return parse_duration(load_thresholds().profiles[self.profile].group_interval, "group_interval")

    # ----- what the drill runner reads (fault_injection/runner.Runner, as on a LocalStack) -----
    @property
    def prom(self) -> Prometheus:
        """Evaluator a: the drills and triage query the central store, as a fleet's on-call does."""
        return Prometheus(self.evaluators[0])

    @property
    def prometheus_url(self) -> str:
        """What a recording reads (fault_injection/recording.py): the central store, as triage does."""
        return self.evaluators[0]

    @property
    def service_url(self) -> str:
        return self.balancer_url

    def describe(self) -> str:
        """The fleet in a recorded scenario's words."""
        return (f"the practice fleet ({self.replicas} replicas over {self.nodes} nodes, compile off, "
                f"{self.profile} profile, central evaluator a)")

    def healthy(self) -> bool:
        """The fleet serves: the balancer has a ready replica behind it."""
        return httpclient.ok(self.balancer_url + "/readyz", timeout=5)

    def knobs(self, **knobs: Any) -> dict[str, Any]:
        raise NotImplementedError("fleet drills set no knobs (per-shape baselines are a one-instance stack's)")

    @contextmanager
    def traffic(self, bodies: list[dict[str, Any]] | None = None, concurrency: int = 2,
                pause: float = 0.0) -> Iterator[Traffic]:
        """Clients through the balancer (small images: three workers share two cores)."""
        with running_traffic(self, self.balancer_url, bodies or [{"prompt": "a red bicycle", "size": "256x256"}],
                             concurrency, pause) as t:
            yield t

    def _wait(self, ok: Callable[[], bool], what: str, deadline: float) -> None:
        while time.time() < deadline:
            if ok():
                return
            for c in self.children:
                if not c.alive():
                    raise RuntimeError(f"{c.name} exited with {c.proc.returncode}:\n{c.tail()}")
            time.sleep(0.3)
        raise TimeoutError(f"{what} not ready in time")

    def _start_alertmanagers(self, deadline: float) -> None:
        assert self.webhook is not None
        (self.workdir / "alertmanager.yml").write_text(cfgs.alertmanager_config(self.webhook.url, self.profile))
        gossip = [f"127.0.0.1:{free_port()}" for _ in range(2)]
        for n, listen in enumerate(gossip):
            port = free_port()
            self.alertmanagers.append(f"http://127.0.0.1:{port}")
            self._child(f"alertmanager-{n + 1}", fcfg.alertmanager_cluster_argv(
                self.workdir / "alertmanager.yml", self.workdir / f"am-{n + 1}-data", f"127.0.0.1:{port}", listen,
                [p for p in gossip if p != listen], profile=self.profile))
        for url in self.alertmanagers:
            self._wait(Alertmanager(url).ready, f"alertmanager {url}", deadline)

    def _start_evaluators(self, deadline: float) -> None:
        """Both evaluators; they scrape the node agents, whose ports are chosen now (the agents start last)."""
        self.agents = [f"http://127.0.0.1:{free_port()}" for _ in range(self.nodes)]
        agents = {f"node-{n}": url for n, url in enumerate(self.agents)}
        for name in ("a", "b"):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cfg = self.workdir / f"central-{name}.yml"
            cfg.write_text(fcfg.central_config(name, self.alertmanagers, self.profile, agents=agents,
                                               blackbox=(self.blackbox_url, [self.endpoint_url])))
            self._child(f"central-{name}", fcfg.central_argv(cfg, self.workdir / f"central-{name}-data",
                                                             f"127.0.0.1:{port}"))
            self.evaluators.append(url)
        for url in self.evaluators:
            self._wait(Prometheus(url).ready, f"central evaluator {url}", deadline)
        from stepwatch.fault_injection.fleet_scale import read_metrics

        self.evaluator_rss_empty = read_metrics(self.evaluators[0])["process_resident_memory_bytes"]

    def _start_replicas(self, deadline: float) -> None:
        for i in range(self.replicas):
            host, name = replica_host(i), f"replica-{i}"
            port, sc_port = free_port(host), free_port(host)
            cfg = self.workdir / f"{name}.yaml"
            cfg.write_text(yaml.safe_dump(REPLICA_SERVICE))
            self._child(name, [sys.executable, "-m", "stepwatch.cli", "serve", "--config", str(cfg), "--host", host,
                               "--port", str(port), "--instance-id", f"{name}:{port}"],
                        env={"OMP_WAIT_POLICY": "PASSIVE"})
            replica = Replica(name, f"http://{host}:{port}", f"http://{host}:{sc_port}", f"node-{i % self.nodes}",
                              self.workdir / f"{name}-gpus.json")
            write_state(replica.gpus, 1)
            self.members.append(replica)
        self.progress(f"starting {self.replicas} replicas (service + sidecar each)")
        for r in self.members:
            self._wait(_ok(r.service_url + "/readyz"), r.name, deadline)
        for r in self.members:
            self._child(f"{r.name}-sidecar", _sidecar_argv(r, ["--no-prober"]))
        for r in self.members:
            self._wait(_ok(r.sidecar_url + "/metrics"), f"{r.name} sidecar", deadline)

    def enable_probes(self) -> None:
        """Quality probers on every sidecar, from now on (once): the fleet's baseline captured, then each sidecar
        restarted with its probe set (a sidecar restarts in about a second: no target stays down)."""
        if self.probing:
            return
        args = self._probe_args()
        for r in self.members:
            name = f"{r.name}-sidecar"
            self._argv[name] = (_sidecar_argv(r, args), None)
            self.restart(name, _ok(r.sidecar_url + "/metrics"))
        self.probing = True

    def _probe_args(self) -> list[str]:
        """The fleet's probe set and its baseline, captured on replica 0 with the cache off (the lossless
        reference, as on the one-instance stack), then the cache put back."""
        probes = fleet_probe_set()
        (self.workdir / "probe-set.yaml").write_text(yaml.safe_dump(probes.to_dict()))
        first = self.members[0].service_url
        self.progress(f"capturing the fleet's quality baseline ({len(probes.items)} probes on {self.members[0].name}, "
                      "cache off)")
        cache = REPLICA_SERVICE["cache"]
        self.replica_knobs(self.members[0].name, cache="none")
        try:
            capture_baseline(first, probes, self.workdir / "baselines")
        finally:
            self.replica_knobs(self.members[0].name, cache=cache["kind"], cache_threshold=cache["threshold"])
        return ["--baseline-dir", str(self.workdir / "baselines"), "--probe-set", str(self.workdir / "probe-set.yaml"),
                "--interval", f"{FLEET_PROBE_INTERVAL_S:g}"]

    def replica_knobs(self, name: str, **knobs: Any) -> dict[str, Any]:
        """One replica's admin knobs (the fleet as a whole has none: its drills change replicas, not knobs)."""
        return set_knobs(self.replica(name).service_url, ADMIN_TOKEN, knobs)

    @property
    def endpoint_url(self) -> str:
        """What the black-box probe asks through the balancer: a replica's readiness, as a client reaches it."""
        return self.balancer_url + "/readyz"

    def _start_blackbox(self, deadline: float) -> None:
        """The blackbox exporter; the balancer's ports are chosen now (it starts after the replicas), so the
        evaluators' configs can name the endpoint it probes."""
        self.balancer_url, self.balancer_metrics_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        self.blackbox_url = f"http://127.0.0.1:{free_port()}"
        cfg = self.workdir / "blackbox.yml"
        cfg.write_text(fcfg.blackbox_config())
        self._child("blackbox", fcfg.blackbox_argv(cfg, self.blackbox_url.removeprefix("http://")))
        self._wait(_ok(self.blackbox_url + "/-/healthy"), "blackbox exporter", deadline)

    def _start_balancer(self, deadline: float) -> None:
        port, mport = (int(u.rsplit(":", 1)[1]) for u in (self.balancer_url, self.balancer_metrics_url))
        cfg = self.workdir / "haproxy.cfg"
        cfg.write_text(haproxy_config(f"127.0.0.1:{port}", f"127.0.0.1:{mport}",
                                      [(r.name, r.service_url.removeprefix("http://")) for r in self.members],
                                      admin_socket=self.admin_socket))
        self._child("haproxy", haproxy_argv(cfg))
        self._wait(lambda: httpclient.ok(self.balancer_url + "/readyz"), "haproxy", deadline)

    def _start_agents(self, deadline: float) -> None:
        for n in range(self.nodes):
            node = f"node-{n}"
            mine = [r for r in self.members if r.node == node]
            jobs = {cfgs.SERVICE_JOB: [f"{r.service_url}/metrics" for r in mine],
                    cfgs.SIDECAR_JOB: [f"{r.sidecar_url}/metrics" for r in mine],
                    balancer_job(load_thresholds()): [f"{self.balancer_metrics_url}/metrics"] if n == 0 else []}
            cfg = self.workdir / f"agent-{node}.yml"
            pods = {f"{u}/metrics": r.name for r in mine for u in (r.service_url, r.sidecar_url)}
            cfg.write_text(fcfg.agent_config(node, jobs, self.evaluators, self.profile, pods=pods))
            self._child(f"agent-{node}", fcfg.agent_argv(cfg, self.workdir / f"agent-{node}-data",
                                                         self.agents[n].removeprefix("http://")))
        for url in self.agents:
            self._wait(_ok(url + "/-/ready"), f"agent {url}", deadline)
        want = 2 * len(self.members) + 1
        for url in self.evaluators:  # both evaluators hold every target's samples before the fleet counts as up
            self._wait(_has_targets(Prometheus(url), want), f"all {want} targets on evaluator {url}", deadline)
            self._wait(_agents_up(Prometheus(url), self.nodes), f"the {self.nodes} agents scraped by {url}",
                       deadline)
