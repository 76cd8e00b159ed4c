"""Drills on the practice service's video jobs: an untiled decode of a long clip, a cache on the distilled model, the
worker killed mid-job.

All run on the ordinary one-rank drill stack (video jobs are on by default) while its image traffic goes
on: every image request must still be answered.  Their blocks are in runbooks/drills.md ("Video and few-step
serving"); the video jobs go through the public API (``POST /v1/videos``, polled), as a client's would.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from stepwatch import httpclient
from stepwatch.fault_injection import queries
from stepwatch.fault_injection.drill import Drill, DrillResult
from stepwatch.fault_injection.rivals import WorkerKilled
from stepwatch.fault_injection.stack import LocalStack
from stepwatch.fault_injection.traffic import ClientLoop, _http

DONE = ("completed", "failed", "cancelled")  # the API's statuses (the metrics say succeeded)
JOB_TIMEOUT_S = 300.0


def submit_video(stack: LocalStack, **body: Any) -> dict[str, Any]:
    """Create a video job (202) and return it; any other answer raises (the drill records it)."""
    body.setdefault("prompt", "a slow pan over a harbour")
    status, answer, _ = _http("POST", stack.service_url + "/v1/videos", body, timeout=60)
    if status != 202 or not isinstance(answer, dict):
        raise RuntimeError(f"POST /v1/videos {body}: HTTP {status}: {answer}")
    return answer


def poll_video(stack: LocalStack, job_id: str, until: Callable[[dict[str, Any]], bool], timeout: float,
               every: float) -> dict[str, Any]:
    """Poll a job every ``every`` seconds until ``until(job)`` holds or the timeout passes: its last view."""
    deadline = time.time() + timeout
    while True:
        _status, job, _ = _http("GET", f"{stack.service_url}/v1/videos/{job_id}", timeout=30)
        if not isinstance(job, dict):
            return {"status": "unknown", "error": job}
        if until(job) or time.time() > deadline:
            return dict(job)
        time.sleep(every)


def wait_video(stack: LocalStack, job_id: str, timeout: float = JOB_TIMEOUT_S) -> dict[str, Any]:
    """Poll a job until it ends (or the timeout: then its last view, still in flight)."""
    return poll_video(stack, job_id, lambda job: job.get("status") in DONE, timeout, 0.25)


def run_video(stack: LocalStack, **body: Any) -> dict[str, Any]:
    return wait_video(stack, submit_video(stack, **body)["id"])


def job_counters(stack: LocalStack) -> dict[str, float]:
    """The service's own video job counters, read from its /metrics (exact: no scrape in between)."""
    text = httpclient.request("GET", stack.service_url + "/metrics", timeout=30).text
    out = {"created": 0.0, "succeeded": 0.0, "failed": 0.0, "cancelled": 0.0, "in_flight": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "stepwatch_video_jobs_created_total":
                out["created"] += s.value
            elif s.name == "stepwatch_video_jobs_finished_total":
                out[s.labels["outcome"]] += s.value
            elif s.name == "stepwatch_video_jobs_depth":
                out["in_flight"] += s.value
    return out


def counters_add_up(c: dict[str, float]) -> bool:
    return c["created"] == c["succeeded"] + c["failed"] + c["cancelled"] + c["in_flight"]


class VideoVaeUntiled(Drill):
    name = "video-vae-untiled"
    doc_id = "video_vae_untiled"
    # The failed job is no HTTP error (its client got 202); the long clip holds the one worker while it fails,
    # so probes may time out and image clients may be shed with 429 behind it.
    companions = ("video_jobs_failing", "probe_failing", "queue_wait")
    baseline_accepts = frozenset({200, 429})
    description = ("VAE tiling and the frame-chunked decode off, and a long clip (256x256, 121 frames): the whole clip "
                   "decodes at full resolution at once and does not fit. The OOM and memory alerts fire, that job "
                   "fails with a clear error, the worker serves the next job and the images throughout.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        info = stack.info()
        r.details["serving_knobs"] = info["knobs"]
        r.details["worker_pid_before"] = info["worker"]["pid"]
        r.details["worker_rss_before"] = info["worker"]["rss_bytes"]
        r.details["jobs_before"] = job_counters(stack)
        stack.knobs(**self.inject_knobs())
        tr = self.spec.traffic
        job = run_video(stack, **dict(tr["video"]))
        err = job.get("error") or {}
        msg = str(err.get("message", ""))
        r.details["long_job"] = {k: job.get(k) for k in ("id", "status", "step", "steps", "frames", "size", "error")}
        r.checks["long_job_fails_out_of_memory"] = job.get("status") == "failed" and err.get("code") == "out_of_memory"
        r.checks["error_names_stage_frames_and_fix"] = ("vae_decode" in msg and str(tr["video"]["frames"]) in msg
                                                        and "fix:" in msg and "tiling" in msg)
        then = tr.get("then", {})
        nxt = run_video(stack, **dict(then.get("video") or {}))
        r.details["next_job"] = {k: nxt.get(k) for k in ("id", "status", "frames", "size")}
        r.checks["next_job_succeeds"] = nxt.get("status") == then.get("expect_status", "completed")

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        c = job_counters(stack)
        r.details["jobs_while_firing"] = c
        r.checks["job_counters_add_up"] = counters_add_up(c)
        before = r.details.get("jobs_before") or {}
        r.checks["one_more_failed_job"] = c["failed"] - before.get("failed", 0.0) == 1

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        knobs = self.restore_knobs(r.details.get("serving_knobs", {}))
        if knobs:
            stack.knobs(**knobs)

    def after(self, stack: LocalStack, r: DrillResult) -> None:
        self.check_same_worker_memory_back(stack, r)
        job = run_video(stack)
        r.checks["jobs_served_after_restore"] = job.get("status") == "completed"
        r.checks["job_counters_add_up_after"] = counters_add_up(job_counters(stack))


def video_job_loop(stack: LocalStack, body: dict[str, Any]) -> ClientLoop:
    """Video jobs one after another (a client that keeps submitting): outcomes are the jobs' statuses."""
    return ClientLoop(lambda: str(run_video(stack, **body).get("status")), "stepwatch-video-jobs", JOB_TIMEOUT_S)


class CacheOnDistilled(Drill):
    name = "cache-on-distilled"
    doc_id = "cache_on_distilled"
    in_place_when_injected = True  # one knob (the video cache changes no compiled graph: it answers at once)
    companions = ("probe_failing",)
    description = ("A cross-step cache turned on for the few-step (distilled) video model: its jobs reuse steps at "
                   "once. No baseline is set; the exporter knows the requests are few-step, the alert fires on the "
                   "first hits and triage names the cache on a distilled model. The jobs still succeed.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        r.details["serving_knobs"] = stack.info()["knobs"]
        r.details["few_step_hits_before"] = stack.prom.value(queries.few_step_hits()) or 0.0
        r.details["_jobs"] = video_job_loop(stack, dict(self.spec.traffic.get("video") or {})).start()
        stack.knobs(**self.inject_knobs())
        r.notes.append(f"knobs {self.inject_knobs()}: the few-step video model now reuses steps")

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        hits = stack.prom.value(queries.few_step_hits()) or 0.0
        r.details["few_step_hits"] = hits
        r.checks["few_step_hits_counted"] = hits > r.details.get("few_step_hits_before", 0.0)

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        loop: ClientLoop | None = r.details.pop("_jobs", None)
        if loop is not None:
            loop.stop()
            r.details["video_job_statuses"] = dict(loop.outcomes)
            r.checks["video_jobs_succeed_meanwhile"] = set(loop.outcomes) == {"completed"}
            if loop.errors:
                r.notes.append(f"video job client errors: {loop.errors[:3]}")
        knobs = self.restore_knobs(r.details.get("serving_knobs", {}))
        if knobs:
            stack.knobs(**knobs)

    def after(self, stack: LocalStack, r: DrillResult) -> None:
        r.checks["job_counters_add_up"] = counters_add_up(job_counters(stack))


class VideoWorkerKilled(WorkerKilled):
    """The worker killed while it runs a video job: the rival of an untiled decode behind VideoJobsFailing.  As
    worker-killed (the service restarts its worker; nothing to restore), with a video job as the victim."""

    name = "video-worker-killed"
    doc_id = "video_worker_killed"
    companions: tuple[str, ...] = ("error_ratio", *WorkerKilled.companions)
    description = ("The worker process killed (SIGKILL) while it generates a video job: that job fails with "
                   "worker_died after its client was answered 202, the service restarts the worker. The failed-jobs "
                   "alert fires and triage names the crash, not an OOM or the pipeline; the next job succeeds.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        r.details["jobs_before"] = job_counters(stack)
        # The pid before the job: /v1/stepwatch/info waits for the busy worker, so asked mid-job it answered
        # once the job was done, and the kill found an idle worker (the job succeeded, twice).
        pid = int(stack.info()["worker"]["pid"])
        job = submit_video(stack, **dict(self.spec.traffic.get("video") or {}))
        running = _mid_job(poll_video(stack, job["id"], lambda j: _mid_job(j) or j.get("status") in DONE, 60.0,
                                      0.05))
        os.kill(pid, signal.SIGKILL)
        r.details["killed_pid"] = pid
        ended = wait_video(stack, job["id"])
        err = ended.get("error") or {}
        r.details["killed_job"] = {k: ended.get(k) for k in ("id", "status", "step", "steps", "error")}
        r.checks["job_was_running_when_killed"] = running
        r.checks["job_fails_worker_died"] = ended.get("status") == "failed" and err.get("code") == "worker_died"
        r.notes.append(f"worker {pid} killed with SIGKILL while job {job['id']} ran")

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        c = job_counters(stack)
        r.details["jobs_while_firing"] = c
        r.checks["job_counters_add_up"] = counters_add_up(c)

    def after(self, stack: LocalStack, r: DrillResult) -> None:
        self._wait_ready(stack, int(r.details.get("killed_pid", 0)))
        job = run_video(stack)
        r.checks["jobs_served_after_restart"] = job.get("status") == "completed"
        r.checks["job_counters_add_up_after"] = counters_add_up(job_counters(stack))


def _mid_job(job: dict[str, Any]) -> bool:
    """Past its first step and short of its last: killed then, it dies mid-job.  (Killed as soon as it read
    "in_progress", a short job had finished its last step before the signal landed, and completed.)"""
    return job.get("status") == "in_progress" and 1 <= int(job.get("step") or 0) < int(job.get("steps") or 0) - 1


VIDEO_DRILLS: tuple[type[Drill], ...] = (VideoVaeUntiled, CacheOnDistilled, VideoWorkerKilled)
