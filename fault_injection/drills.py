"""The fault drills: inject a runbook fault into the practice service and prove the alerting sees it.

A drill passes only if the expected alert fires within the goal (60 s; the
seeds' bar is 600 s), no unexpected critical alert fires, the service stays
healthy before, during and after, the alert resolves after the fault is
removed, and the drill's own checks hold (the clear OOM error, p99 up with p50
flat, 429s with Retry-After, ...).  Alert names and thresholds come from the
thresholds source, the goal, deadlines and check ratios from runbooks/drills.md
(``criteria``), the queries from ``queries``: never from literals here.

Each drill: health check (abort if unhealthy) -> baseline traffic until
steady (nothing firing) -> inject -> watch Prometheus and the webhook ->
restore -> wait for the alert to resolve -> judge.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stepwatch import httpclient
from stepwatch.fault_injection import queries
from stepwatch.fault_injection.criteria import Criteria
from stepwatch.fault_injection.criteria import load as load_criteria
from stepwatch.fault_injection.recording import Recording
from stepwatch.fault_injection.stack import LocalStack, Traffic
from stepwatch.procs import die_with_parent_fn
from stepwatch.promapi import PromError
from stepwatch.runbooks.parse import Drill as DrillSpec
from stepwatch.runbooks.parse import load_drills
from stepwatch.thresholds import Thresholds, parse_duration
from stepwatch.thresholds import load as load_thresholds
from stepwatch.triage.engine import Alert
from stepwatch.triage.in_hand import write_in_hand

log = logging.getLogger("stepwatch.drills")

# A CPU-bound process pinned to one CPU: the straggler the seeds describe ("another process on that GPU").
BUSY_LOOP = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"
RECOVER_DEADLINE_S = 300.0  # a restarted two-rank worker warms up again before it is ready


@dataclass
class DrillResult:
    name: str
    expected_alert: str
    expected_cause: str | None = None
    passed: bool = False
    time_to_detect_s: float | None = None
    time_to_webhook_s: float | None = None
    alerts_fired: list[str] = field(default_factory=list)
    expected_labels: dict[str, str] = field(default_factory=dict)
    service_survived: bool = True
    resolved: bool = False
    time_to_resolve_s: float | None = None
    checks: dict[str, bool] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    triage_cause: str | None = None
    triage: dict[str, Any] | None = None
    injected_at: float = 0.0  # when the fault was in place (the injection call returned)
    injection_s: float = 0.0  # how long putting it in took (a knob that re-warms: many seconds)
    restored_at: float = 0.0
    ended_at: float = 0.0
    snapshots: list[str] = field(default_factory=list)

    def summary_json(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "expected_alert": self.expected_alert,
                "time_to_detect_s": _r(self.time_to_detect_s), "alerts_fired": sorted(self.alerts_fired),
                "service_survived": self.service_survived, "triage_cause": self.triage_cause}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _evidence_trail(verdict: dict[str, Any] | None) -> str:
    """The checks behind a wrong verdict, on one line: what a CI log must say for the miss to be understood."""
    if not verdict:
        return " (no triage verdict)"
    steps = verdict.get("path") or verdict.get("evidence") or []
    trail = [f"{e.get('check')}={e.get('value')}:{e.get('outcome')}" for e in steps]
    status = verdict.get("status", "")
    return f" (triage {status}: {', '.join(trail) or 'no checks ran'})"


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


class ClientLoop:
    """One client on a thread repeating a call until stopped (a user who resubmits, a viewer who reconnects):
    each call's outcome counted; one that raised counts as ``error``, noted, and waits a second."""

    def __init__(self, once: Callable[[], str], name: str, timeout_s: float) -> None:
        self.once, self.timeout_s = once, timeout_s
        self.outcomes: dict[str, int] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    def start(self) -> ClientLoop:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                outcome = self.once()
            except Exception as e:  # recorded; the drill judges by it
                self.errors.append(f"{type(e).__name__}: {e}")
                outcome = "error"
                self._stop.wait(1.0)
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s)


class Drill:
    """One drill; subclasses say how to break the service and what must hold.

    What must fire, the cause triage must name, the time limit and the knob values
    come from the drill's block in runbooks/drills.md (the text people follow by hand).
    """

    name = ""
    doc_id = ""  # the id of the drill block in runbooks/drills.md
    # True where the injection call returns once the fault is in place (a knob that re-warms first): detection
    # counts from then.  False where the injection is the fault itself (its own requests): from its start.
    in_place_when_injected = False
    companions: tuple[str, ...] = ()  # thresholds keys of alerts that may fire with it
    silent: tuple[str, ...] = ()  # thresholds keys that must NOT fire
    needs_ranks = 1
    # Whether its alerts or its triage read the calibrated per-shape baselines: a stack whose drills all say no
    # skips the calibration (70 s of steady traffic; each drill still waits for its own steady traffic).
    reads_baselines = True
    stream_probe = False  # its alert reads the sidecar's drift probe: the stack runs it (LocalStack.stream_probe)
    fleet = False  # it runs on the practice fleet (fault_injection/fleet.py), not on a one-instance stack
    health_turns_red = False  # the fault itself makes /readyz (or /healthz) fail: checked, not a failure
    # Answers the baseline traffic may get while the fault is in (runbooks/drills.md: every request that is not
    # the fault's own answers 200); a drill whose fault is the whole service widens it and says why.
    baseline_accepts: frozenset[int] = frozenset({200})
    description = ""

    def __init__(self, th: Thresholds, spec: DrillSpec | None = None, criteria: Criteria | None = None,
                 variant: int = 0) -> None:
        self.th = th
        self.spec = (spec or next(d for d in load_drills() if d.id == self.doc_id)).variant(variant)
        self.criteria = criteria or load_criteria()
        known = {a.name for a in th.alerts.values()}
        for name in self.spec.alerts:
            if name not in known:
                raise ValueError(f"runbooks/drills.md {self.doc_id}: {name} is not an alert in the thresholds")

    @property
    def expected(self) -> str:
        return str(self.spec.alerts[0])

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(self.spec.alerts)

    @property
    def cause(self) -> str:
        return str(self.spec.cause)

    @property
    def within_s(self) -> float:
        return float(parse_duration(self.spec.within, f"runbooks/drills.md {self.doc_id}: within"))

    def inject_knobs(self) -> dict[str, Any]:
        return dict(self.spec.inject.get("knobs") or {})

    def restore_knobs(self, previous: dict[str, Any]) -> dict[str, Any]:
        knobs = self.spec.restore.get("knobs")
        if knobs == "previous":
            return {k: previous[k] for k in self.inject_knobs() if previous.get(k) is not None}
        return dict(knobs or {})

    def baseline_traffic(self) -> list[dict[str, Any]] | None:
        return None  # the stack's default mix

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        raise NotImplementedError

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        raise NotImplementedError

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        """Checks to run once the alert fired, with the fault still in place."""

    def after(self, stack: LocalStack, r: DrillResult) -> None:
        """Checks after the fault is removed."""

    def expected_alert_matches(self, alert: dict[str, Any]) -> bool:
        return bool(alert["labels"].get("alertname") == self.expected)


class CacheThreshold(Drill):
    name = "cache-threshold"
    doc_id = "cache_past_gate"
    companions = ("cache_hit_rate_shift",)
    silent = ("step_time_regression",)
    description = ("The cross-step cache threshold is pushed past the quality gate: images degrade while "
                   "every performance panel looks normal or better. Only the quality probe can see it.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        r.details["serving_knobs"] = stack.info()["knobs"]
        r.details["step_seconds_before"] = _mean_step(stack, self.th)
        stack.knobs(**self.inject_knobs())
        r.notes.append(f"knobs {self.inject_knobs()}: every step but the first and the last reuses the cache")

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        p10 = stack.prom.value(queries.psnr_p10())
        gate = stack.prom.value(queries.quality_gate())
        r.details["psnr_p10_db"] = p10
        r.details["gate_db"] = gate
        r.details["step_seconds_during"] = _mean_step(stack, self.th)
        before, during = r.details.get("step_seconds_before"), r.details["step_seconds_during"]
        r.checks["psnr_below_gate_minus_margin"] = (p10 is not None and gate is not None
                                                    and p10 < gate - self.th.quality.alert_margin_db)
        r.checks["performance_normal_or_better"] = bool(before and during
                                                        and during <= before * self.criteria.step_time_at_most)

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        stack.knobs(**self.restore_knobs(r.details.get("serving_knobs", {})))


class OffMenuResolution(Drill):
    name = "off-menu-resolution"
    doc_id = "off_menu_resolutions"
    companions = ("queue_wait", "step_time_regression", "probe_failing")
    description = ("A batch of resolutions that are not on the warm-up list: each compiles while serving, "
                   "so p99 jumps while p50 stays flat.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        r.details["latency_before"] = _quantiles(stack, self.th)
        r.details["_t0"] = time.time()
        codes: list[int] = []
        sizes = list(self.spec.traffic.get("sizes", []))
        per = int(self.spec.traffic.get("requests_per_size", 1))
        spacing = parse_duration(str(self.spec.traffic.get("spacing", "0s")))

        def batch() -> None:
            for n, size in enumerate(s for s in sizes for _ in range(per)):
                if n and spacing:
                    time.sleep(spacing)  # off-menu requests arrive among the others, not as one block
                st, _, _ = stack.generate(size=size, seed=n % per)
                codes.append(st)

        t = threading.Thread(target=batch, daemon=True)
        t.start()
        r.details["_batch"] = t
        r.details["off_menu_codes"] = codes
        r.notes.append(f"sent {', '.join(sizes)} (not on the warm-up list)")

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        t = r.details.pop("_batch", None)
        if t is not None:
            t.join(timeout=300)
        time.sleep(2 * _scrape_s(self.th))
        after = _quantiles(stack, self.th)
        before = r.details["latency_before"]
        r.details["latency_during"] = after
        r.checks["off_menu_requests_served"] = all(c == 200 for c in r.details["off_menu_codes"])
        rise = self.criteria.p99_rises_above
        r.checks["p99_rises"] = bool(before["p99"] and after["p99"] and after["p99"] > rise * before["p99"])
        r.checks["p50_flat"] = self._p50_flat(stack, r, r.details.pop("_t0", time.time()))

    def _p50_flat(self, stack: LocalStack, r: DrillResult, t0: float, now: float | None = None) -> bool:
        """The baseline clients' median latency per size, during the off-menu batch vs the rate window before
        it: every size under ``p50_stays_below`` times its own.  Per size and from the clients: the service's
        histogram p50 over the two-size mix sits between the sizes' modes (0.79 s between ~0.5 and ~1.0) and
        jumped to 1.30 s in CI when the mix shifted, with neither size's requests 1.5x slower."""
        traffic = stack.active_traffic
        if traffic is None:
            return False
        window = parse_duration(_rate_window(self.th, stack))
        before = traffic.median_by_size(t0 - window, t0)
        during = traffic.median_by_size(t0, time.time() if now is None else now)
        r.details["baseline_p50_by_size"] = {s: {"before": round(b[0], 4), "during": round(during[s][0], 4),
                                                 "requests": [b[1], during[s][1]]}
                                             for s, b in before.items() if s in during}
        rows = [(during[s][0], b[0]) for s, b in before.items() if s in during and b[1] >= 3 and during[s][1] >= 3]
        flat = self.criteria.p50_stays_below
        return bool(rows) and all(d < flat * b for d, b in rows)
        fired = [a for a in stack.prom.firing() if self.expected_alert_matches(a)]
        r.details["culprit_shapes"] = sorted({a["labels"].get("shape", "") for a in fired})

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        r.details.pop("_t0", None)  # the alert never fired: no p50 to judge
        t = r.details.pop("_batch", None)
        if t is not None:
            t.join(timeout=300)


class VaeTilingOom(Drill):
    name = "vae-tiling-oom"
    doc_id = "vae_tiling_off"
    companions = ("probe_failing", "error_ratio")  # the OOM is a 5xx; triage groups it with the OOM
    # The fault's own 2048^2 requests hold the one worker for seconds: the queue sheds the baseline clients
    # with 429 + Retry-After while they run (admission doing its job; measured: 4 of ~100 on the practice stack).
    baseline_accepts = frozenset({200, 429})
    description = ("VAE tiling off and a 2048^2 request: the VAE decode needs more memory than the worker has. "
                   "The memory alert fires, that request fails with a clear error, the instance keeps serving.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        info = stack.info()
        r.details["worker_rss_before"] = info["worker"]["rss_bytes"]
        r.details["worker_pid_before"] = info["worker"]["pid"]
        stack.knobs(**self.inject_knobs())
        tr = self.spec.traffic
        size = tr["sizes"][0]
        status, body, _ = stack.generate(size=size, steps=int(tr.get("steps", 1)))
        msg = body.get("error", {}).get("message", "") if isinstance(body, dict) else str(body)
        r.details["oom_status"] = status
        r.details["oom_message"] = msg
        r.checks["oom_request_fails_with_507"] = status == 507
        r.checks["oom_message_names_stage_shape_fix"] = ("vae_decode" in msg and size in msg
                                                         and "fix:" in msg and "tiling" in msg)
        then = tr.get("then", {})
        st2, _, _ = stack.generate(size=then.get("sizes", ["256x256"])[0])
        r.checks["next_request_succeeds"] = st2 == int(then.get("expect_status", 200))

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        stack.knobs(**self.restore_knobs({}))

    def after(self, stack: LocalStack, r: DrillResult) -> None:
        info = stack.info()
        before, now = r.details.get("worker_rss_before"), info["worker"]["rss_bytes"]
        r.details["worker_rss_after"] = now
        r.checks["same_worker_no_restart"] = info["worker"]["pid"] == r.details.get("worker_pid_before")
        within = self.criteria.rss_back_within
        r.checks["memory_back_near_baseline"] = bool(before and now and abs(now - before) <= within * before)
        tr = self.spec.traffic  # the request that failed untiled fits once tiling is back
        st, _, _ = stack.generate(size=tr["sizes"][0], steps=int(tr.get("steps", 1)))
        r.checks["2048_fits_with_tiling"] = st == 200


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


def start_neighbours(cpus: list[int], per_cpu: int) -> list[subprocess.Popen[bytes]]:
    """Busy-loop processes pinned to ``cpus``; each dies with this process, so a drill runner killed
    by SIGKILL (no restore) does not leave them burning the CPUs.

    Each runs in a session of its own, as another job or pod would: with the kernel's autogroup
    scheduling (a session is a scheduling group), loops sharing the drill runner's session would share
    one group's CPU time between them all, and a worker with its own session would barely notice them
    (measured: four loops per CPU made a one-rank worker 1.14x slower)."""
    arm = die_with_parent_fn()
    if arm is None:
        log.info("PR_SET_PDEATHSIG unavailable: CPU neighbours outlive a killed drill runner")
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(cpu)], preexec_fn=arm, start_new_session=True)
            for cpu in cpus for _ in range(per_cpu)]


def crowd_worker(stack: LocalStack, r: DrillResult, per_cpu: int) -> list[int]:
    """``per_cpu`` busy loops on each CPU of the one-rank worker (its affinity), kept in ``r`` for
    ``stop_neighbours``; returns the CPUs."""
    cpus = sorted(os.sched_getaffinity(int(stack.info()["worker"]["pid"])))
    r.details["_neighbours"] = start_neighbours(cpus, per_cpu)
    return cpus


def stop_neighbours(r: DrillResult) -> None:
    """Kill the busy loops a drill started (``start_neighbours``, kept in ``r.details["_neighbours"]``)."""
    for p in r.details.pop("_neighbours", []):
        p.kill()
        p.wait()


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


def _http_json(url: str) -> tuple[int, Any]:
    try:
        resp = httpclient.request("GET", url, timeout=10)
        return resp.status_code, resp.json()
    except Exception as e:
        return 0, {"error": f"{type(e).__name__}: {e}"}


SEED_FAULTS: tuple[type[Drill], ...] = (CacheThreshold, OffMenuResolution, VaeTilingOom, QueueOverload, Straggler,
                                        StragglerNeighbour, WorkerStall)


def _scrape_s(th: Thresholds) -> float:
    return parse_duration(th.profiles["drill"].scrape_interval)


def _rate_window(th: Thresholds, stack: LocalStack | None = None) -> str:
    """The rate window of the stack's rules profile (the drill profile's when it has none)."""
    profile = getattr(stack, "profile", "drill")
    return th.profiles[profile if profile in th.profiles else "drill"].rate_window


def _mean_step(stack: LocalStack, th: Thresholds) -> float | None:
    return stack.prom.value(queries.mean_step(_rate_window(th, stack)))


def _quantiles(stack: LocalStack, th: Thresholds) -> dict[str, float | None]:
    w = _rate_window(th, stack)
    out: dict[str, float | None] = {}
    for name, q in queries.LATENCY_QUANTILES.items():
        v = stack.prom.value(queries.request_quantile(q, w))
        out[name] = None if v is None or math.isnan(v) else v
    return out


def _service_requests(stack: LocalStack) -> float:
    return stack.prom.value(queries.service_requests()) or 0.0


def _attempt(r: DrillResult, what: str, fn: Callable[[], None]) -> None:
    """Run one phase of a drill; a failure is recorded on the report, never raised (later phases still run)."""
    try:
        fn()
    except Exception as e:
        r.failures.append(f"{what} failed: {type(e).__name__}: {e}")


@dataclass
class _Watch:
    """What a drill run saw across its phases: alert names, health, alerts left over from before."""

    seen: set[str] = field(default_factory=set)
    healthy: bool = True
    went_red: bool = False
    leftover: set[str] = field(default_factory=set)


Triage = Callable[[LocalStack, DrillResult], dict[str, Any] | None]


class Runner:
    """Runs drills on a stack and watches Prometheus, Alertmanager's webhook and the service.

    One drill runs in four phases, each a method: ``_steady`` (baseline traffic until the
    drill's alert and every critical are quiet), ``_inject_and_watch`` (fault in, watch for
    the alert and its webhook, triage, the drill's checks while firing, fault out),
    ``_resolve`` (wait for the alert to clear) and ``_judge`` (the pass/fail checks).
    """

    def __init__(self, stack: LocalStack, th: Thresholds | None = None,
                 progress: Callable[[str], None] | None = None, triage: Triage | None = None,
                 criteria: Criteria | None = None) -> None:
        self.stack = stack
        self.th = th or load_thresholds()
        self.criteria = criteria or load_criteria()
        self.progress = progress or (lambda m: None)
        self.triage = triage
        self.critical = {a.name for a in self.th.alerts.values() if a.severity == "critical"}
        self.record: Recording | None = None  # record each drill as a triage scenario (stepwatch drill --record)
        # The calibrated per-shape baselines, published again before each drill: a drill that restarted the
        # worker (killed, frozen past the restart) took them with it, and the next drill's alerts need them.
        self.baselines: dict[str, Any] = {}

    def _record(self, drill: Drill, r: DrillResult, record: Recording) -> None:
        if r.time_to_detect_s is None:
            r.notes.append("not recorded as a triage scenario: the alert never fired")
            return
        live = {"cause": r.triage_cause, "confidence": (r.triage or {}).get("confidence"),
                "firing": (r.triage or {}).get("firing", [])}
        try:
            firing = [Alert.parse(a).to_webhook() for a in r.details.get("firing_at_detection", [])]
            path = record.drill(self.stack, drill.name, drill.cause, drill.expected, r.injected_at,
                                r.injected_at + r.time_to_detect_s, r.ended_at, live, drill.description,
                                {"inject": drill.spec.inject, "traffic": drill.spec.traffic}, firing)
            r.notes.append(f"recorded as a triage scenario: {path}")
            self._record_in_hand(drill, r, path)
        except Exception as e:
            r.notes.append(f"recording the scenario failed: {type(e).__name__}: {e}")

    @staticmethod
    def _record_in_hand(drill: Drill, r: DrillResult, path: Path) -> None:
        """The drill block's other alerts in hand, each a scenario of its own on this recording."""
        written, absent = write_in_hand(path, drill.spec.also)
        r.notes += [f"recorded with {p.name.split('-as-')[-1]} in hand: {p}" for p in written]
        if absent:
            r.notes.append(f"not firing when the drill's alert fired, so no case: {', '.join(absent)}")

    def _try_firing(self, r: DrillResult | None = None) -> set[str] | None:
        """The names firing now, or None (with a note on the report) when Prometheus did not answer."""
        try:
            return {a["labels"].get("alertname", "") for a in self.stack.prom.firing()}
        except PromError as e:
            if r is not None:
                note = f"prometheus query failed: {e}"
                if note not in r.notes:
                    r.notes.append(note)
            return None

    def _firing_names(self, r: DrillResult | None = None) -> set[str]:
        """The names firing now; empty (and a note on the report) when Prometheus did not answer."""
        return self._try_firing(r) or set()

    def wait_quiet(self, watch: set[str], timeout: float | None = None, r: DrillResult | None = None) -> set[str]:
        """Wait until none of ``watch`` fires (e.g. a previous drill's alert still resolving)."""
        deadline = time.time() + (self.criteria.quiet_deadline_s if timeout is None else timeout)
        firing = self._firing_names(r) & watch
        while firing and time.time() < deadline:
            time.sleep(2)
            firing = self._firing_names(r) & watch
        return firing

    def run(self, drill: Drill, steady_s: float | None = None) -> DrillResult:
        r = DrillResult(drill.name, drill.expected, expected_cause=drill.cause)
        self.progress(f"[{drill.name}] {drill.description}")
        if not self.stack.healthy():
            r.service_survived = False
            r.failures.append("service unhealthy before the drill: aborted")
            return r
        w = _Watch()
        if self.baselines:
            _attempt(r, "publishing the baselines", lambda: self.stack.knobs(baselines={"shapes": self.baselines}))
        with self.stack.traffic(drill.baseline_traffic(), concurrency=2) as traffic:
            if not self._steady(drill, r, w, self.criteria.steady_s if steady_s is None else steady_s):
                return r
            self._inject_and_watch(drill, r, w)
            self._resolve(drill, r, w)
            _attempt(r, "check after restore", lambda: drill.after(self.stack, r))
        self._judge_baseline_traffic(drill, r, traffic)
        self._judge(drill, r, w)
        if self.record is not None:
            self._record(drill, r, self.record)
        self.progress(f"[{drill.name}] {'PASS' if r.passed else 'FAIL'}"
                      + (f" detect {r.time_to_detect_s:.1f}s" if r.time_to_detect_s is not None else "")
                      + (f"; {'; '.join(r.failures)}" if r.failures else ""))
        return r

    # ----- the phases -------------------------------------------------------------------------
    def _steady(self, drill: Drill, r: DrillResult, w: _Watch, steady_s: float) -> bool:
        """Baseline traffic until the drill's alert and every critical are quiet; False: aborted.

        The drill's own alert must be neither firing nor pending when the fault goes in: an alert
        already on its way would be "detected" without the fault having anything to do with it.
        """
        self.progress(f"[{drill.name}] baseline traffic; waiting until nothing fires")
        time.sleep(steady_s)
        self._remeasure_step_baselines(r, steady_s)
        w.leftover = self.wait_quiet({drill.expected} | self.critical, r=r)
        if w.leftover:
            r.notes.append(f"still firing before injection: {sorted(w.leftover)}")
        # Any other alert still firing from the drill before would join this drill's incident: a CPU-contention
        # step-time alert was grouped under the frozen worker's lingering probe failures and named worker_hung.
        self.wait_quiet(self._firing_names(r), timeout=self.criteria.leftover_deadline_s, r=r)
        already = self._firing_names(r)
        if already:
            r.notes.append(f"firing before injection (not counted against the drill): {sorted(already)}")
        states = self._states_of(drill.expected, r)
        r.checks["quiet_before_injection"] = not states
        if states:
            r.failures.append(f"{drill.expected} was already {'/'.join(sorted(states))} when the fault was due to "
                              "go in: aborted (it cannot be detected)")
            return False
        r.checks["healthy_before"] = self.stack.healthy()
        if not r.checks["healthy_before"]:
            r.service_survived = False
            r.failures.append("service unhealthy before injection: aborted")
        return r.checks["healthy_before"]

    def _remeasure_step_baselines(self, r: DrillResult, window_s: float) -> None:
        """The per-shape step-time baselines measured again on this drill's steady traffic, and published.

        A shared 2-core host drifts: on a quiet practice stack the step time wandered between 0.83x and
        1.27x of its calibration within ten minutes (measured during the seeds' drills), which is past the
        1.2x step-time alert with no fault at all, and a cache turned off then rose from 0.85x to only
        1.2x in 100 s.  A deployment's baseline comes from a benchmark of the same build on the same kind
        of host; the minutes before the fault are that here.  Hit-rate baselines stay as calibrated (the
        model's own behaviour, not the host's speed).
        """
        if not self.baselines or window_s < 2 * _scrape_s(self.th):
            return
        try:
            rows = self.stack.prom.query(queries.step_by_shape(f"{int(window_s)}s"))
        except PromError as e:
            r.notes.append(f"step baselines not re-measured: {e}")
            return
        moved: dict[str, list[float]] = {}
        new: list[str] = []
        for s in rows:
            shape, base = s.label("shape"), self.baselines.get(s.label("shape"))
            if shape == "other" or not (math.isfinite(s.value) and s.value > 0):
                continue
            if base is None:  # a shape only this drill's clients send (cache-off's 50 steps)
                self.baselines[shape] = {"step_seconds": round(s.value, 6)}
                new.append(shape)
            elif "step_seconds" in base:
                moved[shape] = [base["step_seconds"], round(s.value, 6)]
                base["step_seconds"] = round(s.value, 6)
        if new:
            self._measure_new_hit_ratios(r, new, f"{int(window_s)}s")
        if moved or new:
            _attempt(r, "publishing the re-measured baselines",
                     lambda: self.stack.knobs(baselines={"shapes": self.baselines}))
            r.details["step_baselines_remeasured"] = moved

    def _measure_new_hit_ratios(self, r: DrillResult, shapes: list[str], window: str) -> None:
        """A shape calibration never saw gets its hit-rate baseline from the same steady window as its step time
        (as a deployment's benchmark run measures both for every shape it serves)."""
        try:
            for s in self.stack.prom.query(queries.hit_ratio_by_shape(window)):
                if s.label("shape") in shapes and math.isfinite(s.value) and s.value > 0:
                    self.baselines[s.label("shape")]["cache_hit_ratio"] = round(s.value, 4)
        except PromError as e:
            r.notes.append(f"hit-rate baselines of {shapes} not measured: {e}")
        r.details["baselines_measured_for_new_shapes"] = {k: dict(self.baselines[k]) for k in shapes}

    def _states_of(self, name: str, r: DrillResult, timeout: float | None = None) -> set[str]:
        """The states (pending, firing) ``name`` is in, after waiting up to the quiet deadline for none."""
        deadline = time.time() + (self.criteria.quiet_deadline_s if timeout is None else timeout)
        while True:
            try:
                states = {str(a.get("state")) for a in self.stack.prom.alerts()
                          if a.get("labels", {}).get("alertname") == name}
            except PromError as e:
                states = {f"unknown (Prometheus: {e})"}
            if not states or time.time() >= deadline:
                return states
            time.sleep(2)

    def _judge_baseline_traffic(self, drill: Drill, r: DrillResult, traffic: Traffic) -> None:
        """Every baseline request answered 200 (or what the drill's fault makes of the whole service)."""
        codes = dict(traffic.codes)
        r.details["baseline_traffic_codes"] = {str(k): v for k, v in sorted(codes.items())}
        bad = {c: n for c, n in codes.items() if c not in drill.baseline_accepts}
        r.checks["baseline_traffic_answered"] = bool(codes.get(200)) and not bad
        if bad:
            r.failures.append(f"baseline traffic got {sum(bad.values())} answer(s) other than "
                              f"{'/'.join(map(str, sorted(drill.baseline_accepts)))}: {bad}"
                              + (f" ({traffic.errors[0]})" if traffic.errors else ""))

    def _inject_and_watch(self, drill: Drill, r: DrillResult, w: _Watch) -> None:
        """Fault in; watch for the alert and its webhook; triage and the drill's checks while firing; fault out.

        Once the fault may be in, it comes out whatever happens next (a Prometheus error, a
        failed check, Ctrl-C or SIGTERM): restore runs exactly once, in the finally.
        """
        st = self.stack
        started = time.time()
        self.progress(f"[{drill.name}] injecting the fault")
        try:
            _attempt(r, "injection", lambda: drill.inject(st, r))
            r.injected_at = time.time() if drill.in_place_when_injected else started
            r.injection_s = time.time() - started
            if r.injection_s >= 1.0:
                self.progress(f"[{drill.name}] fault in place after {r.injection_s:.1f}s")
            deadline = r.injected_at + self.criteria.detect_deadline_s
            while time.time() < deadline and not self._poll_alert(drill, r, w):
                self._look_at_health(w)
                time.sleep(1.0)
            if r.time_to_detect_s is not None:
                self._triage(r)
                _attempt(r, "check while firing", lambda: drill.while_firing(st, r))
            w.seen |= self._firing_names(r)
            self._look_at_health(w)
        finally:
            r.restored_at = time.time()
            self.progress(f"[{drill.name}] restoring")
            _attempt(r, "restore", lambda: drill.restore(st, r))

    def _look_at_health(self, w: _Watch) -> None:
        ok = self.stack.healthy()
        w.healthy, w.went_red = w.healthy and ok, w.went_red or not ok

    def _poll_alert(self, drill: Drill, r: DrillResult, w: _Watch) -> bool:
        """One look at Prometheus and the webhook; True once the alert fired and its webhook (if any) came."""
        st = self.stack
        try:
            alerts = st.prom.firing()
        except Exception as e:
            r.notes.append(f"prometheus query failed: {e}")
            alerts = []
        w.seen |= {a["labels"].get("alertname", "") for a in alerts}
        hit = [a for a in alerts if drill.expected_alert_matches(a)]
        if hit and r.time_to_detect_s is None:
            r.time_to_detect_s = time.time() - r.injected_at
            r.expected_labels = dict(hit[0]["labels"].items())
            r.details["firing_at_detection"] = [a for a in alerts if a.get("state") == "firing"]
            self.progress(f"[{drill.name}] {drill.expected} firing after {r.time_to_detect_s:.1f}s")
        if r.time_to_detect_s is None:
            return False
        if st.webhook is None:
            return True
        if r.time_to_webhook_s is None:
            note = st.webhook.first_firing(drill.expected, r.injected_at - r.injection_s)
            if note is not None:
                r.time_to_webhook_s = note.received - r.injected_at
        return r.time_to_webhook_s is not None

    def _triage(self, r: DrillResult) -> None:
        """Triage at the moment the alert fires, as `stepwatch triage serve` would on the webhook."""
        if self.triage is None:
            return
        try:
            verdict = self.triage(self.stack, r)
            if verdict:
                r.triage = verdict
                r.triage_cause = verdict.get("cause")
        except Exception as e:
            r.notes.append(f"triage failed: {type(e).__name__}: {e}")

    def _resolve(self, drill: Drill, r: DrillResult, w: _Watch) -> None:
        """Wait for the drill's alert to clear after the restore; no answer from Prometheus is not 'resolved'."""
        deadline = r.restored_at + self.criteria.resolve_deadline_s
        while time.time() < deadline:
            firing = self._try_firing(r)
            if firing is not None:
                w.seen |= firing
                if drill.expected not in firing:
                    r.resolved = True
                    r.time_to_resolve_s = time.time() - r.restored_at
                    return
            time.sleep(2.0)

    def _judge(self, drill: Drill, r: DrillResult, w: _Watch) -> None:
        """The pass/fail checks every drill shares, then the verdict over them and the drill's own."""
        st = self.stack
        if drill.health_turns_red:  # the orchestrator must see it: red during the fault is the check
            r.checks["health_red_during"] = w.went_red
        else:
            r.checks["healthy_during"] = w.healthy
        r.checks["healthy_after"] = st.healthy()
        r.service_survived = (w.healthy or drill.health_turns_red) and r.checks["healthy_after"]
        r.alerts_fired = sorted(w.seen)
        r.ended_at = time.time()
        r.checks["detected"] = r.time_to_detect_s is not None
        goal = min(self.criteria.goal_s, drill.within_s)
        r.checks["within_goal"] = r.time_to_detect_s is not None and r.time_to_detect_s <= goal
        missing = [a for a in drill.required if a not in w.seen]
        r.checks["all_required_alerts_fired"] = not missing
        if missing:
            r.failures.append(f"required alerts did not fire: {missing}")
        if self.triage is not None:
            r.checks["triage_names_the_cause"] = r.triage_cause == drill.cause
            if r.triage_cause != drill.cause:
                r.failures.append(f"triage named {r.triage_cause!r}, expected {drill.cause!r}"
                                  + _evidence_trail(r.triage))
        r.checks["webhook_delivered"] = st.webhook is None or r.time_to_webhook_s is not None
        self._judge_alerts(drill, r, w)
        for k, ok in r.checks.items():
            if not ok and not any(k in f for f in r.failures):
                r.failures.append(f"check failed: {k}")
        r.details = {k: v for k, v in r.details.items() if not k.startswith("_")}
        r.passed = not r.failures and all(r.checks.values())

    def _judge_alerts(self, drill: Drill, r: DrillResult, w: _Watch) -> None:
        """No critical beyond the drill's own and its companions; the silent ones stayed silent; resolved."""
        names = {k: self.th.alert(k).name for k in (*drill.companions, *drill.silent)}
        allowed = {*drill.required, *(names[k] for k in drill.companions)}
        unexpected_critical = sorted((w.seen & self.critical) - allowed - w.leftover)
        silent_fired = sorted({names[k] for k in drill.silent} & w.seen)
        r.checks["no_unexpected_critical"] = not unexpected_critical
        r.checks["resolved_after_restore"] = r.resolved
        if drill.silent:
            r.checks["silent_alerts_stayed_silent"] = not silent_fired
        if unexpected_critical:
            r.failures.append(f"unexpected critical alerts: {unexpected_critical}")
        if silent_fired:
            r.failures.append(f"alerts that must stay silent fired: {silent_fired}")


def calibrate_baselines(stack: LocalStack, progress: Callable[[str], None] | None = None,
                        th: Thresholds | None = None) -> dict[str, Any]:
    """Per-shape step-time and hit-rate baselines from steady traffic, published through the admin knob.

    In production the baseline file comes from the deployment's benchmark run;
    for the drills it is measured on the practice service itself.
    """
    progress = progress or (lambda m: None)
    w = _rate_window(th or load_thresholds(), stack)
    step = stack.prom.query(queries.step_by_shape(w))
    hits = stack.prom.query(queries.hit_ratio_by_shape(w))
    shapes: dict[str, dict[str, float]] = {}
    for s in step:
        if s.label("shape") != "other" and s.value == s.value and s.value > 0:
            shapes.setdefault(s.label("shape"), {})["step_seconds"] = round(s.value, 6)
    for s in hits:
        if s.label("shape") in shapes and s.value == s.value and s.value > 0:
            shapes[s.label("shape")]["cache_hit_ratio"] = round(s.value, 4)
    if shapes:
        stack.knobs(baselines={"shapes": shapes})
    progress(f"baselines from steady traffic: {shapes}")
    return shapes
