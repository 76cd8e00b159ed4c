"""Rival faults: a second (and third) true cause for the alerts the seed drills fire.

An alert whose runbook can name several causes proves nothing about triage while every
recorded fault behind it has the same cause: a fixed alert -> cause table would score as
well.  Each drill here fires an alert the other drills also fire, through another real
mechanism, so only the runbook's checks can tell the cases apart (runbooks/drills.md,
"Rival causes"):

- step time up: the cache turned off (`cache-off`), a straggler rank (`straggler-step-time`:
  the step-time alert, not the rank-skew one, is the alert in hand), torch.compile turned off
  (`compile-off`);
- cache hit rate off its baseline: the threshold raised (`cache-threshold-raise`), the
  cache kind switched with the threshold unchanged (`cache-kind`), the clients' prompts changed
  with nothing on the service touched (`prompt-mix-shift`);
- serving recompiles: warmed shapes compiling again after the compiled-graph cache was
  dropped (`compile-cache-dropped`);
- memory: a request too large even with VAE tiling on (`shape-too-large`);
- errors: the worker process killed (`worker-killed`), the pipeline raising non-OOM errors after a
  deploy forced an attention kernel the device lacks (`pipeline-errors`);
- a stalled worker with one rank: the whole worker frozen (`worker-freeze`);
- the queue wait high: that frozen worker with users still arriving (`worker-freeze-backlog`);
- the quality baseline stale: the deployment changed under the prober (`fingerprint-change`);
- a rank late: its GPU throttled, as NVML reports it (`gpu-throttle`, on the stand-in GPUs);
- step time up on one rank: CPU-bound processes beside the worker (`cpu-contention`);
- a target down: the sidecar process killed (`sidecar-killed`), the whole host gone (`host-down`).

Knob faults come out through the knob's previous value; process faults through the
service's own recovery (a restart) or SIGCONT.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from stepwatch import httpclient
from stepwatch.exporter.sidecar.practice_gpus import write_state
from stepwatch.fault_injection import queries
from stepwatch.fault_injection.drill import RECOVER_DEADLINE_S, Drill, DrillResult, _http_json, _mean_step, _rate_window
from stepwatch.fault_injection.neighbours import crowd_worker, stop_neighbours
from stepwatch.fault_injection.stack import LocalStack
from stepwatch.fault_injection.traffic import Arrivals
from stepwatch.fault_injection.worker_drills import Straggler, WorkerStall


class KnobFault(Drill):
    """A fault that is one knob change (the drill block's ``inject.knobs``), restored to the previous value."""

    in_place_when_injected = True  # the knob call answers once the service serves with it (after a re-warm)
    slows_steps = False  # True: while firing, the drill checks that the mean step got slower than before

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        r.details["serving_knobs"] = stack.info()["knobs"]
        r.details["step_seconds_before"] = _mean_step(stack, self.th)
        stack.knobs(**self.inject_knobs())
        r.notes.append(f"knobs {self.inject_knobs()}")

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        knobs = self.restore_knobs(r.details.get("serving_knobs", {}))
        if knobs:
            stack.knobs(**knobs)

    def step_ratio(self, stack: LocalStack, r: DrillResult) -> float | None:
        """Mean step time now over before the fault (the drill's own view of the slowdown)."""
        before, now = r.details.get("step_seconds_before"), _mean_step(stack, self.th)
        r.details["step_seconds_during"] = now
        return now / before if before and now else None

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        if self.slows_steps:
            ratio = self.step_ratio(stack, r)
            r.details["step_time_ratio"] = ratio
            r.checks["steps_slower"] = ratio is not None and ratio > 1.0


class CacheOff(KnobFault):
    name = "cache-off"
    doc_id = "cache_off"
    companions = ("cache_hit_rate_shift",)
    silent = ("quality_drop",)  # no cache, no reuse: images only get closer to the baseline
    description = ("The cross-step cache turned off on an instance whose baselines were measured with it: "
                   "every step computes in full, so per-step time rises; quality does not suffer.")
    slows_steps = True

    def baseline_traffic(self) -> list[dict[str, Any]] | None:
        """The drill block's clients: 512^2 at 50 steps, prompts the cache serves well.  At the stack's usual 8
        steps a hit saves little beside a step's fixed cost, and turning the cache off moved a step 1.0-1.45x,
        past the alert's 1.2x or not; on this workload 1.56x (in one process, runbooks/drills.md)."""
        tr = self.spec.traffic
        return [{"prompt": str(p), "size": str(tr["size"]), "steps": int(tr["steps"])} for p in tr["prompts"]]


class StragglerStepTime(Straggler):
    reads_baselines = True  # the step-time alert is against the calibrated baseline
    name = "straggler-step-time"
    doc_id = "straggler_step_time"
    companions = ("rank_skew",)
    description = ("Rank 1 of two slowed on every step (the admin delay): the alert in hand is the per-step time of "
                   "a shape, which a cache or compile change could raise as well; its runbook must find the "
                   "straggler first.")

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        ratios = stack.prom.query(queries.rank_busy_ratio(_rate_window(self.th, stack)))
        r.details["rank_busy_ratio"] = {s.label("rank"): round(s.value, 3) for s in ratios}
        slowest = max(ratios, key=lambda s: s.value).label("rank") if ratios else None
        r.checks["slowest_rank_is_the_delayed_one"] = slowest in self.inject_knobs().get("rank_delay_seconds", {})


class CompileOff(KnobFault):
    name = "compile-off"
    doc_id = "compile_off"
    companions = ("baseline_stale", "queue_wait", "probe_failing")
    silent = ("quality_drop",)  # eager runs the same math: the images stay; the prober stops comparing
    description = ("torch.compile turned off on an instance that compiled its blocks at start (inductor): every "
                   "step runs eager, about 1.3-1.6x slower per step on the practice model, while whole requests "
                   "hardly change (the VAE decode dominates them). The deployment fingerprint changes too, and "
                   "rebuilding the baseline would hide the slowdown: triage must name compile first.")
    slows_steps = True


class FingerprintChange(KnobFault):
    name = "fingerprint-change"
    doc_id = "fingerprint_change"
    companions = ("step_time_regression", "queue_wait", "probe_failing")
    silent = ("quality_drop",)  # a stale baseline reports no PSNR: it cannot read as a quality drop
    # The same switch as compile-off, with the quality baseline's alert in hand: compile is part of the
    # deployment fingerprint, so the prober stops comparing whatever the step time does.
    description = ("The deployment changes under the quality prober (compile mode switched, as a rollout with "
                   "another torch.compile setting would): the baseline's fingerprint no longer matches, so the "
                   "prober stops comparing and says the baseline is stale; the images themselves are fine.")


class CacheThresholdRaise(KnobFault):
    name = "cache-threshold-raise"
    doc_id = "cache_threshold_raise"
    companions: tuple[str, ...] = ("quality_drop",)
    description = ("The cross-step cache threshold raised moderately: the cache reuses more often than its "
                   "baseline on every shape. The hit-rate alert must see it before the quality gate does.")

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        w = _rate_window(self.th, stack)
        r.details["hit_ratio_by_shape"] = {s.label("shape"): round(s.value, 3)
                                           for s in stack.prom.query(queries.hit_ratio_by_shape(w))}


class CacheKind(CacheThresholdRaise):
    name = "cache-kind"
    doc_id = "cache_kind"
    companions = ("quality_drop", "step_time_regression", "recompile")
    description = ("The cache kind switched (FirstBlockCache -> MagCache, or TaylorSeer) with the threshold as it was: "
                   "the new cache reads the same number on another scale and reuses at another rate. A "
                   "configuration change to undo, not a threshold to lower.")


class PromptMixShift(Drill):
    """The clients' prompts change; nothing on the service does.

    FirstBlockCache decides from how much the first block's output moves between steps, and that
    depends on the prompt: on the practice model one prompt hits 1 of 8 steps and another 5, the
    same for every seed (runbooks/drills.md, "Prompt mix shift").  The block's ``inject.prompts``
    replace the baseline clients' prompts at both sizes; restore puts the baseline's back.
    """

    name = "prompt-mix-shift"
    doc_id = "prompt_mix_shift"
    companions = ("step_time_regression",)  # fewer hits: every step computes in full
    description = ("The clients' prompts change (another product, another campaign) with the cache, its threshold "
                   "and the model as they were: the cache's hit rate follows the prompts off its baseline band. "
                   "Nothing is broken; a threshold change would be the wrong fix.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        traffic = stack.active_traffic
        if traffic is None:
            raise RuntimeError("prompt-mix-shift needs the drill's baseline traffic running")
        r.details["serving_knobs"] = stack.info()["knobs"]
        r.details["_bodies"] = traffic.bodies
        prompts = [str(p) for p in self.spec.inject["prompts"]]
        traffic.bodies = [{**body, "prompt": p} for p in prompts for body in traffic.bodies]
        r.notes.append(f"clients' prompts now {prompts}")

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        traffic = stack.active_traffic
        if traffic is not None and "_bodies" in r.details:
            traffic.bodies = r.details["_bodies"]

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        w = _rate_window(self.th, stack)
        r.details["hit_ratio_by_shape"] = {s.label("shape"): round(s.value, 3)
                                           for s in stack.prom.query(queries.hit_ratio_by_shape(w))}
        r.checks["knobs_untouched"] = stack.info()["knobs"] == r.details.get("serving_knobs")


class CompileCacheDropped(KnobFault):
    name = "compile-cache-dropped"
    doc_id = "compile_cache_dropped"
    companions = ("queue_wait", "step_time_regression", "probe_failing")
    description = ("The compiled graphs are dropped (what an evicted Dynamo cache or a failed guard does), "
                   "compile still on: every warmed shape compiles again on live requests.")

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        """Nothing to put back: the graphs compiled again are the warmed ones."""


class ShapeTooLarge(Drill):
    name = "shape-too-large"
    doc_id = "shape_too_large"
    companions = ("probe_failing", "error_ratio")
    baseline_accepts = frozenset({200, 429})  # as for vae-tiling-oom: the fault's own request holds the worker
    description = ("VAE tiling on, and a request that does not fit the worker even so (four 2048^2 images in one "
                   "call): the memory alert fires, that request fails with a clear error, the instance keeps "
                   "serving. Turning tiling on cannot help: the shape itself is too large for the device.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        tr = self.spec.traffic
        info = stack.info()
        r.details["worker_pid_before"] = info["worker"]["pid"]
        r.details["vae_tiling"] = info["knobs"].get("vae_tiling")
        status, body, _ = stack.generate(size=tr["size"], n=int(tr.get("n", 1)), steps=int(tr.get("steps", 1)))
        r.details["oom_status"] = status
        r.details["oom_message"] = body.get("error", {}).get("message", "") if isinstance(body, dict) else str(body)
        r.checks["oom_request_fails_with_507"] = status == 507
        st2, _, _ = stack.generate(size="256x256")
        r.checks["next_request_succeeds"] = st2 == 200

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        """Nothing to put back: the request was the fault."""

    def after(self, stack: LocalStack, r: DrillResult) -> None:
        r.checks["same_worker_no_restart"] = stack.info()["worker"]["pid"] == r.details.get("worker_pid_before")


def start_arrivals(drill: Drill, stack: LocalStack, r: DrillResult) -> None:
    """Users arriving at the drill block's ``traffic.arrivals`` rate (open loop) from now until the restore."""
    arrivals = drill.spec.traffic["arrivals"]
    body = {"prompt": "a paper lantern", "size": str(arrivals["size"])}
    r.details["_arrivals"] = Arrivals(stack.service_url, body, float(arrivals["per_second"])).start()
    r.notes.append(f"{arrivals['per_second']} requests/s of {arrivals['size']} arriving (open loop)")


def stop_arrivals(r: DrillResult) -> None:
    arrivals = r.details.get("_arrivals")
    if arrivals is not None:
        arrivals.stop()


def judge_arrivals(drill: Drill, r: DrillResult) -> None:
    """Each arrival answered, with a code the drill's fault allows (``baseline_accepts``); none lost."""
    arrivals = r.details.pop("_arrivals", None)
    if arrivals is None:
        return
    r.checks["arrivals_all_answered"] = arrivals.wait_answered(RECOVER_DEADLINE_S)
    r.details["arrival_codes"] = {str(k): v for k, v in sorted(arrivals.codes.items())}
    answered = set(arrivals.codes)
    r.checks["arrivals_answered_as_expected"] = bool(answered) and answered <= drill.baseline_accepts


class WorkerKilled(Drill):
    name = "worker-killed"
    doc_id = "worker_killed"
    companions: tuple[str, ...] = ("probe_failing", "queue_wait", "target_down")
    health_turns_red = True  # not ready while the new worker warms up: checked, not a failure
    baseline_accepts = frozenset({200, 503})  # in flight when it died, or sent while the new one warms up
    description = ("The worker process is killed (an OOM killer, a segfault in a kernel): requests in flight "
                   "fail, the service restarts the worker, and the error ratio passes its threshold.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        """Users keep arriving (the drill block's ``traffic.arrivals``), then the worker dies.

        Without the arrivals the drill's two closed-loop clients decide it by chance: when the probe's request
        is the one in flight, both clients wait in the queue through the restart (26 s) and get 200, nobody
        sends during it, and no error is counted (`drill all`, 2026-12-06); when a client's is, that client gets
        a 503 and retries into "not ready" until the new worker is up (97% errors in worker-killed-12).  Users who keep
        arriving get the 503s a restart costs, whatever was in flight."""
        start_arrivals(self, stack, r)
        kills = int(self.spec.inject["kill_worker"].get("times", 1))
        pids = []
        for k in range(kills):
            pid = int(stack.info()["worker"]["pid"])
            os.kill(pid, signal.SIGKILL)
            pids.append(pid)
            if k + 1 < kills:
                self._wait_new_worker(stack, pid)
        r.details["killed_pids"] = pids
        r.notes.append(f"worker killed with SIGKILL {kills}x (pids {pids})")

    @staticmethod
    def _wait_new_worker(stack: LocalStack, old_pid: int) -> None:
        """Until the restarted worker has a pid (it is warming up, not ready): the next kill is a crash loop.

        Waiting until it was ready took 65 s once the video pool warmed up too, and the watch for the alert
        starts after the injection: detected "after 70.5 s", by which time the restarts had left the
        runbook's window and triage said cold_start.
        """
        deadline = time.time() + RECOVER_DEADLINE_S
        while time.time() < deadline:
            try:
                if int(stack.info()["worker"].get("pid") or old_pid) != old_pid:
                    return
            except Exception:  # the service answers nothing for a moment while it restarts the worker
                pass
            time.sleep(0.2)

    @staticmethod
    def _wait_ready(stack: LocalStack, old_pid: int) -> None:
        deadline = time.time() + RECOVER_DEADLINE_S
        while time.time() < deadline:
            if stack.healthy() and int(stack.info()["worker"].get("pid") or old_pid) != old_pid:
                return
            time.sleep(1)

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        """No more arrivals; the service restarts its worker itself (the check after: it serves again)."""
        stop_arrivals(r)

    def after(self, stack: LocalStack, r: DrillResult) -> None:
        self._wait_ready(stack, r.details.get("killed_pids", [0])[-1])
        status, _, _ = stack.generate(size="256x256")
        r.checks["serves_after_restart"] = status == 200
        judge_arrivals(self, r)


class PipelineErrors(KnobFault):
    name = "pipeline-errors"
    doc_id = "pipeline_errors"
    companions = ("probe_failing", "recompile")
    baseline_accepts = frozenset({200, 500})  # every generation fails while the fault is in: that is the fault
    description = ("A deploy forces an attention kernel the device cannot run (cuDNN SDPA on the CPU stack): every "
                   "generation fails with a 500 that is not an OOM, while the worker, the memory and the queue "
                   "look fine. Triage must name the pipeline's exceptions, not a crash, an OOM or a cold start.")

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        status, body, _ = stack.generate(size="256x256")
        r.details["error_message"] = body.get("error", {}).get("message", "") if isinstance(body, dict) else ""
        r.checks["fails_with_500_naming_the_error"] = status == 500 and bool(r.details["error_message"])

    def after(self, stack: LocalStack, r: DrillResult) -> None:
        r.checks["serves_after_restore"] = stack.generate(size="256x256")[0] == 200


class CpuContention(Drill):
    """CPU-bound processes beside a one-rank worker: the straggler-neighbour fault with no rank to compare."""

    name = "cpu-contention"
    doc_id = "cpu_contention"
    in_place_when_injected = True  # the neighbours run from the moment they are started
    companions = ("queue_wait", "probe_failing")
    description = ("CPU-bound processes share every CPU of a one-rank worker (a noisy neighbour on the host, no "
                   "knob touched): the host side of each step runs late and per-step time rises; with no other "
                   "rank to compare, triage must find the wait for a CPU, not blame compile, cache or deploy.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        r.details["step_seconds_before"] = _mean_step(stack, self.th)
        r.details["cpu_wait_before"] = stack.prom.value(queries.pipeline_cpu_wait(_rate_window(self.th, stack)))
        per_cpu = int(self.spec.inject["cpu_neighbours"].get("per_cpu", 1))
        cpus = crowd_worker(stack, r, per_cpu)
        r.notes.append(f"{per_cpu} CPU-bound process(es) pinned to each of the worker's CPUs {cpus}")

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        w = _rate_window(self.th, stack)
        before, now = r.details.get("step_seconds_before"), _mean_step(stack, self.th)
        wait = stack.prom.value(queries.pipeline_cpu_wait(w))
        starved = stack.prom.value(queries.pipeline_cpu_starved(w))
        r.details.update(step_seconds_during=now, cpu_wait_during=wait, cpu_wait_per_run_second=starved)
        r.checks["steps_slower"] = bool(before and now and now > before)
        # As the step-time runbook asks it (its check 9): waits per second run, not the waits alone (0.376 s/s,
        # under a 0.4 line on the waits, in `drill all` of 2026-12-06, while triage rightly said cpu_contention).
        r.checks["waits_for_a_cpu"] = starved is not None and starved > float(self.th.diagnosis["cpu_starved"])

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        stop_neighbours(r)


class SidecarKilled(Drill):
    """The sidecar process killed, the service beside it up: TargetDown for one process of a live host."""

    name = "sidecar-killed"
    doc_id = "sidecar_killed"
    in_place_when_injected = True
    description = ("The sidecar process dies (SIGKILL; an OOM kill, a crash) while the service beside it serves: "
                   "Prometheus cannot scrape it and quality goes unmeasured. The host is alive, so triage must "
                   "name the process, not the host.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        stack.crash("sidecar")
        r.notes.append("sidecar killed with SIGKILL")

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        stack.restart_sidecar()

    def after(self, stack: LocalStack, r: DrillResult) -> None:
        r.checks["sidecar_back"] = httpclient.ok(f"{stack.sidecar_url}/metrics")


class HostDown(Drill):
    """Every stepwatch process of the host killed at once: TargetDown for all of them, the host gone."""

    name = "host-down"
    doc_id = "host_down"
    in_place_when_injected = True
    health_turns_red = True
    # The host back: requests sent before its service is ready get 503s, which the error ratio counts.
    companions = ("error_ratio",)
    # Refused connections (0) while nothing listens, 503 while the restarted service warms up.
    baseline_accepts = frozenset({0, 200, 503})
    description = ("The whole host goes (its service, worker and sidecar killed at once, as a node failure or an "
                   "evicted pod does): every target of the host is down. Triage must name the host, not one "
                   "process; the drill brings both back (the service warms up again).")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        for name in ("service", "sidecar"):
            stack.crash(name)
        r.notes.append("service (with its worker) and sidecar killed with SIGKILL")

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        stack.restart_service()
        stack.restart_sidecar()

    def after(self, stack: LocalStack, r: DrillResult) -> None:
        r.checks["serves_after_restart"] = stack.generate(size="256x256")[0] == 200


def gpu_throttle(drill: Drill) -> tuple[str, float]:
    """The drill block's ``inject.gpu_throttle``: the throttle reason NVML reports and the lowered SM clock (MHz);
    the one-instance and the fleet's throttle drills read it alike."""
    gpu = drill.spec.inject["gpu_throttle"]
    return str(gpu.get("reason", "sw_thermal_slowdown")), float(gpu.get("sm_clock_mhz", 1110))


class GpuThrottle(Straggler):
    """Rank 1's GPU reports a thermal slowdown: the same late rank as the straggler drill, another cause."""

    name = "gpu-throttle"
    doc_id = "gpu_throttle"
    companions = ("step_time_regression",)
    description = ("Rank 1's GPU throttles (NVML reports a thermal slowdown and a lower SM clock; the practice "
                   "stack's stand-in GPUs say so, and the admin delay slows rank 1 as the lower clock would): "
                   "the rank-skew alert names rank 1, and triage must blame the clock, not another process.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        index, (reason, clock) = int(self.spec.inject["gpu_throttle"]["gpu"]), gpu_throttle(self)
        write_state(stack.practice_gpus, stack.ranks, {index: [reason]}, {index: clock})
        r.notes.append(f"stand-in GPU {index}: {reason} at {clock:g} MHz")
        super().inject(stack, r)

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        write_state(stack.practice_gpus, stack.ranks)  # the GPUs stay; the throttle ends
        super().restore(stack, r)


class WorkerFreeze(WorkerStall):
    """The stall drill on one rank: the whole worker frozen; recovery (SIGCONT or the restart) is the same."""

    name = "worker-freeze"
    doc_id = "worker_freeze"
    needs_ranks = 1
    description = ("The whole worker process frozen (SIGSTOP; a process stuck in a driver call does the same) on "
                   "a one-rank service: nothing answers, the stall alert fires and /readyz turns 503; there is no "
                   "collective to blame, so triage must name a hung worker.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        pid = int(stack.info()["worker"]["pid"])
        r.details["worker_pid_before"] = pid
        os.kill(pid, signal.SIGSTOP)
        r.details["_frozen_pid"] = pid
        r.notes.append(f"worker (pid {pid}) frozen with SIGSTOP")

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        _readyz_turns_503(stack, r, within_s=0.0)  # its own alert is the stall: /readyz is 503 already


def _readyz_turns_503(stack: LocalStack, r: DrillResult, within_s: float) -> None:
    """/readyz answers 503 within ``within_s`` (0: now), as it must while the worker is frozen."""
    deadline = time.time() + within_s
    while True:
        code, _ = _http_json(stack.service_url + "/readyz")
        if code == 503 or time.time() >= deadline:
            break
        time.sleep(0.5)
    r.details["readyz_503_after_s"] = round(time.time() - r.injected_at, 1) if code == 503 else None
    r.checks["readyz_503_while_stalled"] = code == 503


# How long the backlog drill waits for /readyz to turn 503 after its alert: past the drill profile's stall floor
# (20 s from the freeze) with room for a loaded host; the restart at twice the limit keeps it 503 as well.
READYZ_RED_WITHIN_S = 30.0


class WorkerFreezeBacklog(WorkerFreeze):
    """The frozen one-rank worker again, with users still arriving: the queue alert is the one in hand.

    A hung worker pages through the queue first wherever requests keep coming: the estimate counts the
    work queued behind it, the stall alert waits for its floor (20 s in drills, 5 minutes in production).
    The queue runbook must find the hang, not a pool short of instances.
    """

    name = "worker-freeze-backlog"
    doc_id = "worker_freeze_backlog"
    companions = ("worker_stalled", "probe_failing", "error_ratio", "step_time_regression")
    description = ("The one-rank worker frozen (SIGSTOP) while users keep arriving (open loop, a steady rate the "
                   "instance serves easily): the queue behind the hung generation grows past half the SLO, "
                   "usually before the stall alert's floor; triage of the queue alert must name the hung worker.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        start_arrivals(self, stack, r)
        super().inject(stack, r)

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        """The queue grew; then the freeze lasts until /readyz says 503, as it must for a frozen worker.  The
        queue alert may fire before the stall limit (16.2 s after the freeze, 2026-12-06): a restore at that
        point would come first and fail health_red_during with nothing wrong."""
        r.details["queue_depth"] = {s.label("pool"): s.value for s in stack.prom.query(queries.queue_depth_by_pool())}
        r.checks["queue_grew"] = max(r.details["queue_depth"].values(), default=0) > 0
        _readyz_turns_503(stack, r, within_s=READYZ_RED_WITHIN_S)

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        stop_arrivals(r)
        super().restore(stack, r)

    def after(self, stack: LocalStack, r: DrillResult) -> None:
        """The frozen worker's checks, then the arrivals' answers: each one 200, or what a hung worker makes of
        it (429 past the queue's limit, 503/504 around its restart); none lost."""
        super().after(stack, r)
        judge_arrivals(self, r)


# GpuThrottle last: its throttle stays in the runbooks' lookback (diagnosis.throttle_lookback) for the
# stack's later rank drills, which would then be read as throttling.
RIVALS: tuple[type[Drill], ...] = (
    CacheOff, StragglerStepTime, CompileOff, FingerprintChange, CacheThresholdRaise, CacheKind, PromptMixShift,
    CompileCacheDropped, ShapeTooLarge, WorkerKilled, PipelineErrors, WorkerFreeze, WorkerFreezeBacklog, CpuContention,
    SidecarKilled, HostDown, GpuThrottle)
