"""Drills on the worker's capacity and its ranks: a burst past the queue, a slowed rank, a rank crowded by
CPU neighbours, a frozen rank."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from stepwatch.fault_injection import queries
from stepwatch.fault_injection.drill import (
    RECOVER_DEADLINE_S,
    Drill,
    DrillResult,
    _http_json,
    _rate_window,
    _service_requests,
)
from stepwatch.fault_injection.neighbours import start_neighbours, stop_neighbours
from stepwatch.fault_injection.stack import LocalStack
from stepwatch.fault_injection.traffic import Traffic
from stepwatch.promapi import PromError


class QueueOverload(Drill):
    name = "queue-overload"
    doc_id = "queue_overload"
    companions = ("probe_failing",)
    baseline_accepts = frozenset({200, 429})  # the burst fills the queue every client shares: 429 + Retry-After
    description = ("A burst beyond capacity: the estimated wait passes SLO/2 (scale out), then the hard limit: "
                   "clients get 429 with Retry-After, and no request is lost.")

    def baseline_traffic(self) -> list[dict[str, Any]] | None:
        return [{"prompt": "a lighthouse at dusk", "size": "256x256"}]

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        tr = self.spec.traffic
        clients, seconds = int(tr["concurrent"]), float(tr.get("seconds", 25))
        r.details["requests_before"] = _service_requests(stack)
        burst = Traffic(stack.service_url, [{"prompt": "a storm at sea", "size": tr["size"],
                                             "steps": int(tr.get("steps", 8))}], concurrency=clients).start()
        r.details["_burst"] = burst
        r.details["_burst_until"] = time.time() + seconds
        r.notes.append(f"{clients} clients sending {tr['size']} x {tr.get('steps', 8)} steps for {seconds:.0f}s")

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        burst: Traffic = r.details["_burst"]
        time.sleep(max(0.0, r.details["_burst_until"] - time.time()))
        wait = stack.prom.value(queries.estimated_wait())
        r.details["estimated_wait_s"] = wait
        burst.stop()
        r.details["burst_codes"] = {str(k): v for k, v in sorted(burst.codes.items())}
        r.checks["some_429_with_retry_after"] = burst.codes.get(429, 0) > 0
        accept = {int(c) for c in self.spec.traffic.get("accept_status", [200, 429])}
        r.checks["every_request_answered"] = set(burst.codes) <= accept and not burst.errors
        r.details["_burst_total"] = burst.total

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        burst = r.details.get("_burst")
        if burst is not None:
            burst.stop()

    def after(self, stack: LocalStack, r: DrillResult) -> None:
        r.details.pop("_burst", None)
        r.details.pop("_burst_until", None)


class Straggler(Drill):
    name = "straggler"
    reads_baselines = False  # rank skew and the stall read no per-shape baseline
    doc_id = "straggler_rank"
    companions = ("step_time_regression",)
    needs_ranks = 2
    description = ("Two ranks with Ulysses sequence parallelism; rank 1 is slowed on every step (a throttled "
                   "GPU). Every step waits for it; the rank-skew alert must name rank 1.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        stack.knobs(**self.inject_knobs())
        r.notes.append(f"knobs {self.inject_knobs()}: rank 1 is slowed on every step")

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        fired = [a for a in stack.prom.firing() if self.expected_alert_matches(a)]
        ranks = sorted({a["labels"].get("rank", "") for a in fired})
        delayed = sorted(str(k) for k in self.inject_knobs().get("rank_delay_seconds", {}))
        r.details["slow_ranks"] = ranks
        r.checks["names_the_delayed_rank"] = ranks == delayed

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        stack.knobs(**self.restore_knobs({}))


def rank_procs(stack: LocalStack, rank: int) -> dict[str, Any]:
    """The pid and CPUs of one rank, from /v1/stepwatch/info (the worker's ready message)."""
    procs = stack.info()["worker"].get("ranks") or []
    for p in procs:
        if int(p["rank"]) == rank:
            return dict(p)
    raise RuntimeError(f"the service reports no rank {rank} (ranks: {procs}); run it with ranks: 2")


class StragglerNeighbour(Drill):
    name = "straggler-neighbour"
    reads_baselines = False  # rank skew and the stall read no per-shape baseline
    doc_id = "straggler_neighbour"
    companions = ("step_time_regression", "queue_wait", "probe_failing")
    needs_ranks = 2
    description = ("CPU-bound processes pinned to rank 1's CPUs, no knob touched (another process on that GPU): "
                   "rank 1 arrives late or holds up each transfer while its threads wait for a CPU; the rank-skew "
                   "alert must name rank 1.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        spec = self.spec.inject["cpu_neighbours"]
        rank, per_cpu = int(spec["rank"]), int(spec.get("per_cpu", 1))
        cpus = [int(c) for c in rank_procs(stack, rank)["cpus"]]
        r.details["_neighbours"] = start_neighbours(cpus, per_cpu)
        r.details["neighbour_cpus"] = cpus
        r.notes.append(f"{per_cpu} CPU-bound process(es) pinned to each of rank {rank}'s CPUs {cpus}")

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        fired = [a for a in stack.prom.firing() if self.expected_alert_matches(a)]
        r.details["slow_ranks"] = sorted({a["labels"].get("rank", "") for a in fired})
        r.checks["names_the_crowded_rank"] = r.details["slow_ranks"] == [str(self.spec.inject["cpu_neighbours"]
                                                                             ["rank"])]

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        w = _rate_window(self.th, stack)
        try:  # what the alert saw, fired or not: the report then says by how much
            ratios = stack.prom.query(queries.rank_busy_ratio(w))
            r.details["rank_busy_ratio_at_restore"] = {s.label("rank"): round(s.value, 3) for s in ratios}
        except PromError as e:
            r.notes.append(f"rank ratio query failed: {e}")
        stop_neighbours(r)


class WorkerStall(Drill):
    name = "worker-stall"
    reads_baselines = False  # rank skew and the stall read no per-shape baseline
    doc_id = "worker_stall"
    companions = ("probe_failing", "error_ratio", "queue_wait", "step_time_regression")
    needs_ranks = 2
    health_turns_red = True
    # Requests held by the frozen worker end 504 (its restart) or 503 (not ready); the queue behind it may fill.
    baseline_accepts = frozenset({200, 429, 503, 504})
    description = ("One rank frozen with SIGSTOP mid-traffic: the other waits for it in a collective. The stall "
                   "alert fires, /readyz turns 503, triage names the collective hang and the frozen rank; after "
                   "SIGCONT (or the service's restart of the worker) the service serves again.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        rank = int(self.spec.inject["freeze"]["rank"])
        proc = rank_procs(stack, rank)
        r.details["worker_pid_before"] = stack.info()["worker"]["pid"]
        os.kill(int(proc["pid"]), signal.SIGSTOP)
        r.details["_frozen_pid"] = int(proc["pid"])
        r.notes.append(f"rank {rank} (pid {proc['pid']}) frozen with SIGSTOP")

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        code, body = _http_json(stack.service_url + "/readyz")
        r.details["readyz_while_stalled"] = {"status": code, **(body if isinstance(body, dict) else {})}
        r.checks["readyz_503_while_stalled"] = code == 503 and bool((body or {}).get("stalled_seconds"))
        stuck = sorted(stack.prom.query(queries.rank_stuck_outside_collectives()), key=lambda s: -s.value)
        r.details["rank_stuck_seconds"] = {s.label("rank"): round(s.value, 1) for s in stuck}
        r.checks["names_the_frozen_rank"] = bool(stuck) and stuck[0].label("rank") == str(
            self.spec.inject["freeze"]["rank"])

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        pid = r.details.pop("_frozen_pid", None)
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            r.notes.append("the frozen rank was gone at restore: the service had restarted the worker")

    def after(self, stack: LocalStack, r: DrillResult) -> None:
        deadline = time.time() + RECOVER_DEADLINE_S
        while time.time() < deadline and not stack.healthy():
            time.sleep(2)
        r.checks["recovered"] = stack.healthy()
        r.details["worker_restarted"] = stack.info()["worker"]["pid"] != r.details.get("worker_pid_before")
        status, _, _ = stack.generate(size="256x256")
        r.checks["serves_after_recovery"] = status == 200
