"""Day-two operations as drills: what a production service goes through on an ordinary day.

A routine restart comes first: one replica of the fleet restarted on its unchanged configuration (maintenance,
an eviction), which must page nobody; before the prober knew a restart from an outage
(exporter/sidecar/prober.py, its not-ready grace) the replica's refused probes fired the probe-failing alert.
A configuration rolled out by restart is next: no knob call, so the knob gauges (against the start-up
values) read unchanged, and before the service kept its start-up configuration across restarts
(service/config_history.py) triage blamed the prompt mix and advised a new baseline, which would have
baked the bad setting in.  One replica with damaged weights is the seeds' self-test: the fleet's probes, one
sidecar per replica, must name it.
"""

from __future__ import annotations

import copy
import os
import signal
import time
from typing import Any

from stepwatch import httpclient
from stepwatch.fault_injection import queries
from stepwatch.fault_injection.drill import Drill, DrillResult
from stepwatch.fault_injection.fleet_drills import AgentLost, FleetDrill, ReplicaConfigDrift, service_ready
from stepwatch.fault_injection.stack import DRILL_SERVICE, LocalStack


def merged(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``change`` laid over it, nested mappings merged key by key (a YAML edit of a few keys)."""
    out = copy.deepcopy(base)
    for k, v in change.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


class RoutineRestart(FleetDrill):
    """One replica restarted on its own configuration, as maintenance or an eviction does: drained, SIGTERM, the
    same release warming up, back in the balancer.  A quiet drill: its block has no alert and no cause."""

    name = "routine-restart"
    doc_id = "routine_restart"
    reads_quality = True  # the replica's prober sees it go and come back
    in_place_when_injected = True  # watched from when it serves again; the webhook covers the restart itself
    silent = ("probe_failing", "baseline_stale", "quality_drop", "error_ratio")
    description = ("One replica restarted on its unchanged configuration under steady traffic through the "
                   "balancer: drained, restarted, warmed up, back in. Nothing may page: no quality alert (its "
                   "prober sees a restart, not a failure or a new deployment), no error ratio, no critical.")

    def inject(self, stack: Any, r: DrillResult) -> None:
        before = stack.child_pid(self.target)
        stack.rollout(self.target, service_ready(stack, self.target))
        r.details["restarted"] = stack.child_pid(self.target) != before
        r.notes.append(f"{self.target} restarted on its own configuration and serving again")

    def restore(self, stack: Any, r: DrillResult) -> None:
        """Nothing to undo: the same release serves again."""

    def after(self, stack: Any, r: DrillResult) -> None:
        r.checks["replica_restarted"] = bool(r.details.get("restarted"))
        r.checks["replica_serving"] = service_ready(stack, self.target)()


def pause(pid: int, r: DrillResult) -> None:
    """SIGSTOP a process, as a descheduled, swapped-out or debugged one is: it holds its sockets and answers
    nothing.  ``resume`` continues it."""
    os.kill(pid, signal.SIGSTOP)
    r.details.update(_paused_pid=pid, _paused_at=time.time())


def resume(r: DrillResult, seconds: float) -> None:
    """SIGCONT the paused process once ``seconds`` are over (at once if the drill has already failed)."""
    paused_at, pid = r.details.pop("_paused_at", None), r.details.pop("_paused_pid", None)
    if pid is None:
        return
    if paused_at is not None and not r.failures:
        time.sleep(max(0.0, paused_at + seconds - time.time()))
    os.kill(pid, signal.SIGCONT)
    r.details["paused_s"] = round(time.time() - (paused_at or time.time()), 1)


class AgentPaused(AgentLost):
    """One node's Prometheus agent stopped (SIGSTOP) and continued after ``inject.pause_seconds``: a node agent
    descheduled, swapped out or debugged.  Its replicas serve on (AgentLost's check while firing); their series
    have a gap."""

    name = "agent-paused"
    doc_id = "agent_paused"
    silent = ("instance_slow",)  # the gap's few samples once named a healthy replica slow
    description = ("One node's Prometheus agent paused (SIGSTOP) for 90 s under traffic, then continued: "
                   "StepwatchNodeSilent names the node, triage says agent_down; the gap in its replicas' series "
                   "counts in no fleet comparison, so StepwatchInstanceSlow stays silent, after the pause too.")

    def inject(self, stack: Any, r: DrillResult) -> None:
        pause(stack.child_pid(f"agent-{self.node}"), r)
        r.notes.append(f"paused {self.node}'s agent (SIGSTOP); its replicas ({', '.join(self.replicas(stack))}) "
                       "serve on")

    def restore(self, stack: Any, r: DrillResult) -> None:
        resume(r, float(self.spec.inject.get("pause_seconds", 90)))

    def after(self, stack: Any, r: DrillResult) -> None:
        """A rate window and a bit after the agent continued, while the gap is in the window: no InstanceSlow."""
        name, seen = self.th.alert("instance_slow").name, set()
        deadline = time.time() + SETTLE_S
        while time.time() < deadline:
            seen |= {str(a.get("state")) for a in stack.prom.alerts() if a["labels"].get("alertname") == name}
            time.sleep(2.0)
        r.checks["no_instance_slow_after_the_pause"] = not seen
        if seen:
            r.failures.append(f"{name} was {'/'.join(sorted(seen))} after the agent continued")


# After an agent continues: the drill profile's rate window (1m) and two scrapes, while the gap is in the window.
SETTLE_S = 70.0


class ConfigRollout(Drill):
    """The drill block's ``inject.config`` laid over the service's YAML, and the service restarted on it."""

    name = "config-rollout"
    doc_id = "config_rollout"
    # In place once the restarted service serves on the new configuration (its warm-up is the rollout's).
    in_place_when_injected = True
    # The restart is over when inject returns, so the watch that follows sees a healthy service throughout.
    baseline_accepts = frozenset({0, 200, 503})  # the clients: refused while it is down, 503 while it warms up
    companions = ("quality_drop", "probe_failing", "error_ratio")
    # Its rollback is a rollout too: within the change look-back, a later drill's CacheHitRateShift on the same
    # stack would read as config_changed.  campaign.by_stack runs it after the others of its stack.
    runs_last = True
    description = ("A configuration rolled out by restart: the YAML's cache threshold raised and the service "
                   "restarted on it, no knob call. The knob gauges read unchanged; triage must name the "
                   "rollout (config_changed, with the key), not the prompt mix, and advise no new baseline.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        change = dict(self.spec.inject.get("config") or {})
        if not change:
            raise RuntimeError("config-rollout: the drill block has no inject.config")
        r.details["_overrides"] = copy.deepcopy(stack.service_overrides)
        current = {**DRILL_SERVICE, **stack.service_overrides}
        stack.service_overrides = {**stack.service_overrides, **{k: merged(current.get(k, {}), v)
                                                                 if isinstance(v, dict) else v
                                                                 for k, v in change.items()}}
        r.notes.append(f"service YAML changed by {change}; restarting the service on it")
        stack.restart_service()

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        stack.service_overrides = r.details.pop("_overrides", {})
        stack.restart_service()

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        keys = sorted(s.label("key") for s in stack.prom.query(queries.rollout_keys()))
        r.details["rollout_keys"] = keys
        wanted = sorted(_leaf_knobs(self.spec.inject.get("config") or {}))
        r.checks["rollout_names_the_keys"] = keys == wanted


# The YAML's nesting of the knobs a rollout may change, by knob name (the service's config_id keys).
_YAML_KNOBS = {("cache", "threshold"): "cache_threshold", ("cache", "kind"): "cache", ("vae_tiling",): "vae_tiling",
               ("compile", "enabled"): "compile"}


def _leaf_knobs(change: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[str]:
    """The knob names a YAML change touches (``{cache: {threshold: 1.2}}`` -> ``["cache_threshold"]``)."""
    out = []
    for k, v in change.items():
        path = (*prefix, k)
        if isinstance(v, dict):
            out += _leaf_knobs(v, path)
        elif path in _YAML_KNOBS:
            out.append(_YAML_KNOBS[path])
    return out


class ReplicaBadWeights(ReplicaConfigDrift):
    """One replica rolled out with damaged transformer weights (the service's ``weights_damage`` fault, after the
    weights digest: same checkpoint, same fingerprint), as one instance's lost FP8 scales are: only its probes
    see it.  ReplicaConfigDrift's check while firing: the quality alert names that replica alone."""

    name = "replica-bad-weights"
    doc_id = "replica_bad_weights"
    description = ("One replica rolled out with damaged weights (noise on one transformer block after loading, "
                   "fingerprint unchanged), the seeds' self-test: its probe PSNR falls below the gate, the "
                   "others' do not; StepwatchQualityDrop names it alone, triage says bad_instance.")

    def inject(self, stack: Any, r: DrillResult) -> None:
        damage = {"layer": str(self.spec.inject["layer"]), "noise": float(self.spec.inject["noise"])}
        stack.rollout(self.target, service_ready(stack, self.target), {"weights_damage": damage})
        r.notes.append(f"{self.target} rolled out with {damage['layer']}'s weights damaged "
                       f"(noise {damage['noise']:g}x their std)")


class BalancerFrozen(FleetDrill):
    """The load balancer stopped (SIGSTOP) and continued after ``inject.pause_seconds``: a hung haproxy (a stuck
    reload, a descheduled or debugged process).  It holds its sockets, so nothing refuses a connection: clients
    wait, and its exporter's scrape times out with the users' requests."""

    name = "balancer-frozen"
    doc_id = "balancer_frozen"
    target_label = ""  # one balancer: its alert names the probed URL, no replica
    health_turns_red = True  # the users' endpoint is what hangs: red through the balancer is the fault itself
    companions = ("target_down",)  # the balancer's own exporter times out with it (triaged balancer_down too)
    # Requests sent during the pause wait in the balancer's backlog and are answered when it continues (200);
    # 0: a client that gave up first.
    baseline_accepts = frozenset({200, 0})
    description = ("The fleet's haproxy paused (SIGSTOP) for 60 s under traffic, then continued: clients wait. "
                   "StepwatchEndpointDown fires from the black-box probe through the balancer, and triage says "
                   "balancer_down (its node agent answers, the replicas are ready), not host_down.")

    def inject(self, stack: Any, r: DrillResult) -> None:
        pause(stack.child_pid("haproxy"), r)
        r.notes.append("paused haproxy (SIGSTOP); the replicas, agents and evaluators run on")

    def while_firing(self, stack: Any, r: DrillResult) -> None:
        """The replicas behind it still answer their own readiness: only the balancer hangs."""
        ready = {m.name: httpclient.ok(m.service_url + "/readyz") for m in stack.members}
        r.details["replicas_ready"] = ready
        r.checks["replicas_still_ready"] = bool(ready) and all(ready.values())

    def restore(self, stack: Any, r: DrillResult) -> None:
        resume(r, float(self.spec.inject.get("pause_seconds", 60)))


DAY_TWO_DRILLS: tuple[type[Drill], ...] = (RoutineRestart, AgentPaused, ConfigRollout, ReplicaBadWeights,
                                           BalancerFrozen)
