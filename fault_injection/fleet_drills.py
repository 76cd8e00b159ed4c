"""Fleet drills: faults of the monitoring system and of a replica, on the practice fleet (fault_injection/fleet.py).

They run on the drill runner of the one-instance stack (fault_injection/runner.Runner): the fleet answers what
the runner reads (``prom`` is central evaluator a, ``webhook``, ``healthy()`` is the balancer's ``/readyz``,
``traffic()`` goes through the balancer), so the pass rules are the same: quiet before, detected within the
goal, the webhook delivered, triage right, nothing else critical, resolved after the restore.  Each drill's
alerts, cause and limits come from its block in runbooks/drills.md.

- ``replica-lost``: one replica's service (and worker) and sidecar SIGKILLed: TargetDown for that replica,
  haproxy routes around it, every request is answered (one in flight on it: a 502 or a closed connection);
- ``node-lost``: one node's agent and its replicas SIGKILLed: no ``up`` 0 is written for them, StepwatchNodeSilent
  names the node, triage says ``node_down`` from the balancer's health checks;
- ``agent-lost``: only that node's agent killed: the same alert, its replicas still serve, ``agent_down``;
- ``alertmanager-peer-lost``: one Alertmanager of the gossip pair killed, then a replica's sidecar: the
  notification still arrives, exactly once;
- ``bad-instance``: CPU-bound processes beside one replica's worker: StepwatchInstanceSlow names it alone;
- ``replica-gpu-throttle``: one replica's stand-in GPU throttled and its steps delayed: the same alert for that
  replica alone, triage says ``gpu_throttling`` (its sidecar found by the replica's own address);
- ``replica-config-drift``: one replica rolled out on a config with a higher cache threshold: StepwatchQualityDrop
  names it alone (the fleet's probers on), triage says ``bad_instance`` from the PSNR spread;
- ``rolling-update``: one replica rolled out under the steady load: while it warms, StepwatchPoolCapacityShort
  fires for the pool and triage says ``cold_start``;
- ``pool-short``: clients added past the pool's capacity: the capacity alert before the queue-wait alert;
- ``central-store-outage``: both central evaluators down for 60 s while a sidecar dies: the agents replay their
  WAL, no scrape sample of the window is missing on either evaluator, and TargetDown fires afterwards.
"""

from __future__ import annotations

import math
import os
import subprocess
import threading
import time
from typing import Any

from stepwatch import httpclient
from stepwatch.exporter.sidecar.practice_gpus import write_state
from stepwatch.fault_injection import queries
from stepwatch.fault_injection.drill import Drill, DrillResult
from stepwatch.fault_injection.fleet import REPLICA_SERVICE
from stepwatch.fault_injection.neighbours import start_neighbours, stop_neighbours
from stepwatch.fault_injection.rivals import gpu_throttle
from stepwatch.fault_injection.traffic import Traffic
from stepwatch.fault_injection.webhook import starts_at
from stepwatch.promapi import Alertmanager, Prometheus
from stepwatch.thresholds import parse_duration


def _sidecar_ready(stack: Any, replica: str) -> Any:
    return lambda: httpclient.ok(stack.replica(replica).sidecar_url + "/metrics")


def service_ready(stack: Any, replica: str) -> Any:
    return lambda: httpclient.ok(stack.replica(replica).service_url + "/readyz")


class FleetDrill(Drill):
    """A drill of the practice fleet; ``stack`` is a FleetStack (typed loosely: the runner's stack protocol)."""

    fleet = True
    reads_baselines = False
    reads_quality = False  # True: the fleet's quality probers go on before it runs (FleetStack.enable_probes)
    target_label = "pod"  # the alert label that names the drill's target (a node drill's: node; "": none)

    @property
    def target(self) -> str:
        return str(self.spec.inject.get("replica", "replica-1"))

    def expected_alert_matches(self, alert: dict[str, Any]) -> bool:
        """The expected alert for the drill's target, not another's (no ``target_label``: the fleet's one alert)."""
        labels = alert.get("labels", {})
        return bool(labels.get("alertname") == self.expected
                    and (not self.target_label or labels.get(self.target_label) == self.target))

    def target_labels(self) -> dict[str, str]:
        return {self.target_label: self.target} if self.target_label else {}

    def settle(self, stack: Any, r: DrillResult) -> None:
        """Every instance's data complete over the rate window again: the fleet comparisons count an instance only
        then (``diagnosis.complete_ratio``), so after a drill that restarted a replica or an agent, the next
        drill's replica would be left out of them for up to a window and its fault detected late."""
        complete = float(self.th.diagnosis["complete_ratio"])
        window = self.th.profiles[stack.profile].rate_window
        deadline = time.time() + 2 * parse_duration(window)
        while time.time() < deadline:
            least = stack.prom.query(queries.least_complete(window))
            if least and least[0].value >= complete:
                return
            time.sleep(2.0)
        r.notes.append(f"an instance's data still incomplete over {window} when the fault went in")


class ReplicaLost(FleetDrill):
    name = "replica-lost"
    doc_id = "replica_lost"
    # A request in flight on the killed replica fails at once: haproxy's 502, or (measured) its client connection
    # closed without a response; 0 is the traffic's code for that.  after() bounds them by the clients in flight.
    baseline_accepts = frozenset({200, 502, 0})
    description = ("One replica's service, worker and sidecar SIGKILLed, as a lost node does: TargetDown names the "
                   "replica, the balancer routes around it, every request gets an answer.")

    def inject(self, stack: Any, r: DrillResult) -> None:
        for part in (self.target, f"{self.target}-sidecar"):
            stack.crash(part)
        r.notes.append(f"killed {self.target} (service, worker, sidecar)")

    def while_firing(self, stack: Any, r: DrillResult) -> None:
        """With the replica still gone, new requests through the balancer all answer 200."""
        _routed_around(stack, r)

    def restore(self, stack: Any, r: DrillResult) -> None:
        stack.restart(self.target, service_ready(stack, self.target))
        stack.restart(f"{self.target}-sidecar", _sidecar_ready(stack, self.target))

    def after(self, stack: Any, r: DrillResult) -> None:
        _only_in_flight_failed(stack, r)


def _only_in_flight_failed(stack: Any, r: DrillResult) -> None:
    """Only requests in flight on the lost replicas failed: at most one per client, every other one answered."""
    t = stack.active_traffic
    failed = sum(n for c, n in t.codes.items() if c != 200) if t is not None else 0
    r.details["failed_in_flight"] = failed
    r.checks["only_in_flight_failed"] = t is not None and failed <= t.concurrency and t.codes.get(200, 0) > 0


def _named_by(stack: Any, alertname: str, label: str) -> list[str]:
    """The values of ``label`` on the firing (or pending) ``alertname`` alerts: who the alert names."""
    return sorted({a["labels"].get(label, "") for a in stack.prom.firing()
                   if a["labels"].get("alertname") == alertname})


class AlertmanagerPeerLost(FleetDrill):
    name = "alertmanager-peer-lost"
    doc_id = "alertmanager_peer_lost"
    description = ("One Alertmanager of the gossip pair killed, then a replica's sidecar: TargetDown still reaches "
                   "the receiver, exactly once.")

    @property
    def peer(self) -> int:
        return int(self.spec.inject.get("alertmanager", 1))

    def inject(self, stack: Any, r: DrillResult) -> None:
        stack.crash(f"alertmanager-{self.peer}")
        stack.crash(f"{self.target}-sidecar")
        r.notes.append(f"killed alertmanager-{self.peer}, then {self.target}'s sidecar")

    def while_firing(self, stack: Any, r: DrillResult) -> None:
        """One notification of the alert: wait two group intervals for a duplicate that must not come."""
        time.sleep(2 * stack.group_interval_s + 2)
        notes = [n for n in stack.webhook.snapshot() if n.received >= r.injected_at
                 and any(a["labels"].get("alertname") == self.expected and a["labels"].get("pod") == self.target
                         and a.get("status") == "firing" for a in n.alerts)]
        r.details["notifications"] = len(notes)
        r.checks["notified_exactly_once"] = len(notes) == 1

    def restore(self, stack: Any, r: DrillResult) -> None:
        stack.restart(f"{self.target}-sidecar", _sidecar_ready(stack, self.target))
        url = stack.alertmanagers[self.peer - 1]
        stack.restart(f"alertmanager-{self.peer}", Alertmanager(url).ready)


class CentralStoreOutage(FleetDrill):
    name = "central-store-outage"
    doc_id = "central_store_outage"
    in_place_when_injected = True  # detection counts from the evaluators' return: nothing can fire before
    description = ("Both central evaluators down for 60 s while a replica's sidecar dies: the agents keep the "
                   "samples and replay them, none of the window is missing, TargetDown fires once they are back.")

    @property
    def outage_s(self) -> float:
        return float(self.spec.inject.get("outage_seconds", 60))

    def inject(self, stack: Any, r: DrillResult) -> None:
        names = [f"central-{e}" for e in ("a", "b")]
        for n in names:
            stack.crash(n)
        r.details["outage_start"] = time.time()
        time.sleep(min(10.0, self.outage_s / 3))
        stack.crash(f"{self.target}-sidecar")
        time.sleep(max(0.0, r.details["outage_start"] + self.outage_s - time.time()))
        r.details["outage_end"] = time.time()
        for n, url in zip(names, stack.evaluators, strict=True):
            stack.restart(n, Prometheus(url).ready)
        r.notes.append(f"evaluators down {r.details['outage_end'] - r.details['outage_start']:.0f}s; "
                       f"{self.target}'s sidecar killed during it")

    def while_firing(self, stack: Any, r: DrillResult) -> None:
        """Every target's ``up`` samples of the outage window on both evaluators: one per scrape interval."""
        start, end = r.details["outage_start"], r.details["outage_end"]
        window = int(end - start)
        want = window / stack.scrape_interval_s
        worst: dict[str, float] = {}
        for url in stack.evaluators:
            rows = Prometheus(url).query(queries.up_samples(f"{window}s"), at=end)
            for s in rows:  # the killed sidecar's too: its failed scrapes wrote up = 0
                worst[f"{url.rsplit(':', 1)[1]} {s.label('job')} {s.label('instance')}"] = s.value
        short = {k: v for k, v in worst.items() if math.isfinite(v) and v < want - 1}
        r.details["outage_samples_expected"] = round(want, 1)
        r.details["outage_samples_min"] = min(worst.values()) if worst else None
        r.checks["no_samples_lost"] = bool(worst) and not short
        if short:
            r.failures.append(f"samples missing in the outage window (expected ~{want:.0f} per target): {short}")

    def restore(self, stack: Any, r: DrillResult) -> None:
        stack.restart(f"{self.target}-sidecar", _sidecar_ready(stack, self.target))


def _routed_around(stack: Any, r: DrillResult, requests: int = 4) -> None:
    """With replicas gone, new requests through the balancer all answer 200 (it took them out of rotation)."""
    t = Traffic(stack.balancer_url, [{"prompt": "a red bicycle", "size": "256x256"}], 1).start()
    try:
        deadline = time.time() + 30
        while t.total < requests and time.time() < deadline:
            time.sleep(0.2)
    finally:
        t.stop()
    codes = dict(t.codes)
    r.details["routed_around_codes"] = {str(k): v for k, v in codes.items()}
    r.checks["routed_around"] = bool(codes) and set(codes) == {200} and not t.errors


class NodeDrill(FleetDrill):
    """A drill of one node (``inject.node``): its expected alert carries that ``node`` label."""

    target_label = "node"

    @property
    def target(self) -> str:
        return str(self.spec.inject.get("node", "node-1"))

    @property
    def node(self) -> str:
        return self.target

    def replicas(self, stack: Any) -> list[str]:
        return [m.name for m in stack.members if m.node == self.node]

    def restart_agent(self, stack: Any) -> None:
        url = stack.agents[int(self.node.rsplit("-", 1)[1])]
        stack.restart(f"agent-{self.node}", lambda: httpclient.ok(url + "/-/ready"))


class NodeLost(NodeDrill):
    name = "node-lost"
    doc_id = "node_lost"
    baseline_accepts = ReplicaLost.baseline_accepts  # requests in flight on the node's replicas fail at once
    description = ("One node's agent and every replica on it SIGKILLed at once: their series stop (no up 0), "
                   "StepwatchNodeSilent names the node, triage says node_down from the balancer's health checks.")

    def inject(self, stack: Any, r: DrillResult) -> None:
        gone = self.replicas(stack)
        stack.crash(f"agent-{self.node}")
        for name in gone:
            stack.crash(name)
            stack.crash(f"{name}-sidecar")
        r.details["replicas_lost"] = gone
        r.notes.append(f"killed {self.node}: its agent and {', '.join(gone)} (service, worker, sidecar)")

    def while_firing(self, stack: Any, r: DrillResult) -> None:
        """The balancer routes around the node; TargetDown stayed silent for its replicas (nothing wrote up 0)."""
        _routed_around(stack, r)
        down = [a["labels"].get("pod") for a in stack.prom.firing()
                if a["labels"].get("alertname") == self.th.alert("target_down").name]
        r.details["target_down_pods"] = sorted(p or "" for p in down)

    def restore(self, stack: Any, r: DrillResult) -> None:
        for name in r.details.get("replicas_lost", []):
            stack.restart(name, service_ready(stack, name))
            stack.restart(f"{name}-sidecar", _sidecar_ready(stack, name))
        self.restart_agent(stack)

    def after(self, stack: Any, r: DrillResult) -> None:
        _only_in_flight_failed(stack, r)


class AgentLost(NodeDrill):
    name = "agent-lost"
    doc_id = "agent_lost"
    description = ("Only one node's Prometheus agent SIGKILLed: StepwatchNodeSilent names the node as for a lost "
                   "node, its replicas still serve, triage says agent_down.")

    def inject(self, stack: Any, r: DrillResult) -> None:
        stack.crash(f"agent-{self.node}")
        r.notes.append(f"killed {self.node}'s agent; its replicas ({', '.join(self.replicas(stack))}) run on")

    def while_firing(self, stack: Any, r: DrillResult) -> None:
        """The node's replicas answer their own ``/readyz``: only the monitoring went."""
        ready = {name: httpclient.ok(stack.replica(name).service_url + "/readyz") for name in self.replicas(stack)}
        r.details["replicas_ready"] = ready
        r.checks["replicas_still_serve"] = bool(ready) and all(ready.values())

    def restore(self, stack: Any, r: DrillResult) -> None:
        self.restart_agent(stack)


def _group_pids(leader: int) -> list[int]:
    """Every process of a child's process group (the service and its worker)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getpgid(int(d)) == leader:
                    out.append(int(d))
            except OSError:
                continue
    return out


def _pin(pids: list[int], cpus: list[int]) -> None:
    """Every thread of ``pids`` onto ``cpus`` (``taskset -a``: the worker's torch threads too)."""
    for pid in pids:
        subprocess.run(["taskset", "-a", "-p", "-c", ",".join(map(str, cpus)), str(pid)], check=False,
                       capture_output=True)


class SlowReplica(FleetDrill):
    """One replica's steps slowed: StepwatchInstanceSlow must name its instance (host:port) and no other."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.instance = ""  # host:port of the slowed replica's service, set at injection

    def expected_alert_matches(self, alert: dict[str, Any]) -> bool:
        labels = alert.get("labels", {})
        return bool(labels.get("alertname") == self.expected and labels.get("instance") == self.instance)

    def slowed(self, stack: Any) -> Any:
        """The drill's target replica, whose service address (host:port) the alert must name."""
        replica = stack.replica(self.target)
        self.instance = replica.service_url.removeprefix("http://")
        return replica

    def while_firing(self, stack: Any, r: DrillResult) -> None:
        """Only the slowed replica is named: the others stay quiet."""
        named = _named_by(stack, self.expected, "instance")
        r.details["slow_instances"] = named
        r.checks["only_the_slow_instance"] = named == [self.instance]


class BadInstance(SlowReplica):
    name = "bad-instance"
    doc_id = "bad_instance"
    description = ("CPU-bound processes beside one replica's worker (its processes and the neighbours on one CPU; "
                   "no knob): its steps slow, the others' do not; StepwatchInstanceSlow names it, triage "
                   "says bad_instance.")

    def inject(self, stack: Any, r: DrillResult) -> None:
        cpu = max(os.sched_getaffinity(0))
        per_cpu = int(self.spec.inject.get("per_cpu", 2))
        self.slowed(stack)
        pids = _group_pids(stack.child_pid(self.target))
        _pin(pids, [cpu])
        r.details["_neighbours"] = start_neighbours([cpu], per_cpu)
        r.details.update(crowded_instance=self.instance, crowded_cpu=cpu, crowded_pids=pids)
        r.notes.append(f"{self.target} ({self.instance}) pinned to CPU {cpu} beside {per_cpu} CPU-bound processes")

    def restore(self, stack: Any, r: DrillResult) -> None:
        stop_neighbours(r)
        _pin(r.details.get("crowded_pids", []), sorted(os.sched_getaffinity(0)))


class ReplicaGpuThrottle(SlowReplica):
    """The one-instance gpu-throttle drill on one replica of the fleet: the same alert as bad-instance, another
    cause.  The replica's sidecar reports its stand-in GPU throttled (a state file, as NVML would), and the
    admin step delay slows that replica as the lower clock would (the practice fleet has no GPU to slow)."""

    name = "replica-gpu-throttle"
    doc_id = "replica_gpu_throttle"
    description = ("One replica's GPU throttles (its sidecar's stand-in GPU reports a slowdown reason and a lower "
                   "SM clock; a step delay on that replica stands in for the clock): StepwatchInstanceSlow names "
                   "it alone, and triage must blame the clock (gpu_throttling), not the instance.")

    def inject(self, stack: Any, r: DrillResult) -> None:
        replica, (reason, clock) = self.slowed(stack), gpu_throttle(self)
        delay = float(self.spec.inject["step_delay_seconds"])
        write_state(replica.gpus, 1, {0: [reason]}, {0: clock})
        stack.replica_knobs(self.target, rank_delay_seconds={"0": delay})
        r.details.update(throttled_instance=self.instance, throttle_reason=reason, sm_clock_mhz=clock)
        r.notes.append(f"{self.target} ({self.instance}): its GPU {reason} at {clock:g} MHz, each step "
                       f"{delay * 1000:g} ms longer")

    def restore(self, stack: Any, r: DrillResult) -> None:
        stack.replica_knobs(self.target, rank_delay_seconds={})
        write_state(stack.replica(self.target).gpus, 1)  # the GPU stays; the throttle ends


class ReplicaConfigDrift(FleetDrill):
    name = "replica-config-drift"
    doc_id = "replica_config_drift"
    reads_quality = True
    # In place once the replica serves on its new file: the rollout (drain, restart, warm-up) takes 32-45 s on a
    # 2-core host, and nothing of the drift can show before it ends (runbooks/drills.md's criterion).
    in_place_when_injected = True
    description = ("One replica rolled out on a config file of its own with a higher cache threshold (no knob, "
                   "fingerprint unchanged): its probe PSNR falls below the gate, the others' do not; "
                   "StepwatchQualityDrop names it alone, triage says bad_instance.")

    def inject(self, stack: Any, r: DrillResult) -> None:
        threshold = float(self.spec.inject["cache_threshold"])
        cache = {**REPLICA_SERVICE["cache"], "threshold": threshold}
        stack.rollout(self.target, service_ready(stack, self.target), {"cache": cache})
        r.notes.append(f"{self.target} rolled out on a config with cache threshold {threshold:g}")

    def while_firing(self, stack: Any, r: DrillResult) -> None:
        """Only the drifted replica's quality dropped: each replica's p10 PSNR, and who the alert names."""
        r.details["psnr_p10_by_pod"] = {s.labels.get("pod", ""): round(s.value, 2)
                                        for s in stack.prom.query(queries.psnr_p10_by_pod())}
        named = _named_by(stack, self.expected, "pod")
        r.details["quality_drop_pods"] = named
        r.checks["only_the_drifted_replica"] = named == [self.target]

    def restore(self, stack: Any, r: DrillResult) -> None:
        stack.rollout(self.target, service_ready(stack, self.target))


class RollingUpdate(FleetDrill):
    name = "rolling-update"
    doc_id = "rolling_update"
    restarts_a_target = True  # its replica restarts: TargetDown may fire in drills (15 s), not in production (2m)
    description = ("One replica rolled out under the steady load on a release that warms more shapes: drained, "
                   "restarted, warming; the other two carry its share meanwhile. StepwatchPoolCapacityShort "
                   "fires for the pool, triage says cold_start.")

    def expected_alert_matches(self, alert: dict[str, Any]) -> bool:
        return bool(alert.get("labels", {}).get("alertname") == self.expected)

    def inject(self, stack: Any, r: DrillResult) -> None:
        """The rollout runs beside the watch (the alert fires while the replica warms); its error, if any, is kept
        for while_firing."""
        warmup = [str(s) for s in self.spec.inject["warmup"]]

        def roll() -> None:
            try:
                stack.rollout(self.target, service_ready(stack, self.target), {"warmup": warmup})
            except Exception as e:
                r.details["rollout_error"] = f"{type(e).__name__}: {e}"

        r.details["_rollout_started"] = time.time()
        threading.Thread(target=roll, daemon=True, name="rolling-update").start()
        r.notes.append(f"{self.target} rolling out on a release that warms {', '.join(warmup)}")

    def while_firing(self, stack: Any, r: DrillResult) -> None:
        """The alert fired while the replica was not ready; how long its rollout took in all."""
        deadline = time.time() + 300
        while time.time() < deadline and "rollout_error" not in r.details \
                and not service_ready(stack, self.target)():
            time.sleep(0.5)
        r.details["rollout_seconds"] = round(time.time() - r.details.pop("_rollout_started"), 1)
        r.checks["rolled_out"] = "rollout_error" not in r.details and service_ready(stack, self.target)()

    def restore(self, stack: Any, r: DrillResult) -> None:
        """Nothing to undo: the rollout finished and the new release serves."""


class PoolShort(FleetDrill):
    name = "pool-short"
    doc_id = "pool_short"
    description = ("Clients added one by one through the balancer past the pool's capacity: the capacity alert "
                   "fires before the queue-wait alert, triage says under_provisioned.")
    baseline_accepts = frozenset({200, 429})  # past the hard limit the service sheds load: 429 + Retry-After

    def expected_alert_matches(self, alert: dict[str, Any]) -> bool:
        return bool(alert.get("labels", {}).get("alertname") == self.expected)

    def inject(self, stack: Any, r: DrillResult) -> None:
        ramp = self.spec.traffic.get("ramp", {})
        body = {"prompt": "a crowded harbour", "size": str(ramp.get("size", "512x512"))}
        clients, every = int(ramp.get("clients", 30)), float(ramp.get("every_seconds", 2))
        t = Traffic(stack.balancer_url, [body], 0)
        r.details["_ramp"] = t
        r.details["ramp"] = {"clients": clients, "every_seconds": every, **body}
        threading.Thread(target=self._grow, args=(t, clients, every), daemon=True).start()

    @staticmethod
    def _grow(t: Traffic, clients: int, every: float) -> None:
        for _ in range(clients):
            if t.stopped:
                return
            t.add_client()
            time.sleep(every)

    def while_firing(self, stack: Any, r: DrillResult) -> None:
        """The ramp goes on until the queue-wait alert fires too (or the goal passes): it must fire second.  Its
        firing time is Prometheus' (active since + its for:), not when this loop saw it."""
        spec = self.th.alert("queue_wait")
        hold = spec.for_seconds(stack.profile)
        # The ramp's whole length: on a faster host the queue crosses its line only after more clients than the
        # capacity formula needs (30 clients are enough on one 2-core host and not on a faster one).
        ramp = r.details.get("ramp", {})
        ramp_s = float(ramp.get("clients", 0)) * float(ramp.get("every_seconds", 0))
        deadline = r.injected_at + max(self.criteria.goal_s, ramp_s) + 30
        while time.time() < deadline:
            since = [starts_at(a.get("activeAt")) for a in stack.prom.firing()
                     if a["labels"].get("alertname") == spec.name]
            if since and since[0] is not None:
                r.details["queue_wait_after_s"] = round(min(s for s in since if s is not None) + hold
                                                        - r.injected_at, 1)
                break
            time.sleep(1)
        queue_after = r.details.get("queue_wait_after_s")
        r.checks["capacity_before_queue_wait"] = queue_after is not None and r.time_to_detect_s is not None \
            and queue_after > r.time_to_detect_s
        self._one_incident_for_the_pool(stack, r)

    def _one_incident_for_the_pool(self, stack: Any, r: DrillResult) -> None:
        """Triaged again once the queues alert too: the capacity alert and every replica's queue alert that
        names the pool short are one incident (the pool's), not one per replica."""
        from stepwatch.triage.engine import Engine, firing_at

        report = Engine(stack.prom).run(firing_at(stack.prom))
        short = [i for i in report.incidents if i.cause == "under_provisioned"]
        r.details["pool_incidents"] = [sorted(a.short() for a in i.alerts) for i in short]
        queues = {a.key for i in short for a in i.alerts if a.name == self.th.alert("queue_wait").name}
        r.details["queue_alerts_in_the_pool_incident"] = len(queues)
        r.checks["one_incident_for_the_pool"] = len(short) == 1

    def restore(self, stack: Any, r: DrillResult) -> None:
        t = r.details.pop("_ramp", None)
        if t is not None:
            t.stop()
            r.details["ramp_codes"] = {str(k): v for k, v in sorted(t.codes.items())}


# replica-gpu-throttle last: its throttle stays in the runbooks' look-back (diagnosis.throttle_lookback).
FLEET_DRILLS: tuple[type[Drill], ...] = (ReplicaLost, NodeLost, AgentLost, AlertmanagerPeerLost,
                                         CentralStoreOutage, BadInstance, ReplicaConfigDrift, RollingUpdate,
                                         PoolShort, ReplicaGpuThrottle)
# Steady traffic before each fleet drill: two scrapes.  The one-instance drills' 25 s re-measure per-shape step
# baselines on it; no fleet drill reads them, and "quiet before" is the runner's own wait.
FLEET_STEADY_S = 10.0


def run_fleet_drills(stack: Any, drills: list[Drill], progress: Any = None, triage: Any = None,
                     record: Any = None, before_drill: Any = None) -> list[DrillResult]:
    """The drills one after another on a running FleetStack, with the one-instance drills' runner and rules;
    ``record`` (a fault_injection.recording.Recording) records each as a triage scenario."""
    from stepwatch.fault_injection.runner import Runner

    runner = Runner(stack, progress=progress, triage=triage)
    runner.record = record
    if before_drill is not None:
        runner.before_drill = before_drill
    results = []
    for d in drills:
        if getattr(d, "reads_quality", False):
            stack.enable_probes()
        results.append(runner.run(d, steady_s=FLEET_STEADY_S))
    return results
