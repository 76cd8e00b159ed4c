"""Asynchronous video jobs: ``POST /v1/videos`` answers at once with an id; the job runs in the queue.

A video takes many times an image's time, so no client holds a connection for it: the job is a ticket in
the one queue (pool ``video``, its own SLO and wait limit), served by the same worker between image
requests, and the client polls ``GET /v1/videos/{id}`` (status, step k of n) and downloads the MP4 from
``/content`` once it succeeded.  ``DELETE`` answers at once: a queued job leaves the queue, a denoising one
stops within a step (the worker reads the cancelled job's number after every step), a decoding one is a 409.
A cancelled or failed job frees its slot; a finished one is kept ``video.keep_seconds`` for its download.

Counters add up: ``created = succeeded + failed + cancelled + in flight`` (queued + running), each in
``stepwatch_video_jobs_*`` by pool.  Job ids are random (an id is the only key to a job), never labels.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any, cast

from stepwatch.metrics import ServiceMetrics
from stepwatch.service.api import ApiError, GenerationRequest
from stepwatch.service.config import ServiceConfig
from stepwatch.service.messages import ProgressMsg, Reply, ResultMsg
from stepwatch.service.queue import Ticket

# OpenAI's video statuses (its client polls until completed or failed), and cancelled, which OpenAI's jobs
# do not have (its client's poll returns on a status it does not know).
QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "in_progress", "completed", "failed", "cancelled"
OUTCOMES = (SUCCEEDED, FAILED, CANCELLED)
IN_FLIGHT = (QUEUED, RUNNING)
# The metrics keep their own words (outcome succeeded|failed|cancelled, state queued|running): the rules,
# dashboards and runbooks read them, and they do not follow one API's spelling.
METRIC_WORD = {QUEUED: "queued", RUNNING: "running", SUCCEEDED: "succeeded", FAILED: "failed",
               CANCELLED: "cancelled"}
PRACTICE_MODEL = "stepwatch-practice-wan"  # the tiny offline Wan pipeline's name in the API


def model_name(model_dir: str | None) -> str:
    """The video model as the API names it: the model directory's last part (never the server's path)."""
    return PRACTICE_MODEL if model_dir is None else model_dir.rstrip("/").rsplit("/", 1)[-1]


@dataclass
class Job:
    """One video job; every field but ``content`` is in its JSON view."""

    id: str
    seq: int
    req: GenerationRequest
    pool: str
    created: float  # monotonic
    created_unix: float
    ticket: Ticket | None = None
    status: str = QUEUED
    step: int = 0
    started: float | None = None
    finished: float | None = None
    finished_unix: float | None = None
    content: bytes | None = None
    content_type: str = "video/mp4"
    error: dict[str, Any] | None = None
    details: dict[str, Any] = field(default_factory=dict)  # shape, stages, cache, ... of the worker's reply
    cancel_requested: bool = False

    @property
    def done(self) -> bool:
        return self.status in OUTCOMES

    def view(self, now: float, model: str, fps: int) -> dict[str, Any]:
        """The job as ``GET /v1/videos/{id}`` answers it (OpenAI's video object, plus step k of n)."""
        steps = self.req.steps
        queued = (self.started or (self.finished if self.finished else now)) - self.created
        out: dict[str, Any] = {
            "id": self.id, "object": "video", "status": self.status, "model": model, "prompt": self.req.prompt,
            "progress": 100 if self.status == SUCCEEDED else int(100 * self.step / max(1, steps)),
            "step": self.step, "steps": steps, "created_at": int(self.created_unix),
            "completed_at": int(self.finished_unix) if self.finished_unix else None,
            "seconds": f"{self.req.frames / fps:.3g}",
            "size": self.req.size, "frames": self.req.frames, "seed": self.req.seed,
            "guidance_scale": self.req.guidance_scale, "error": self.error,
            "stepwatch": {"shape": self.req.shape, "pool": self.pool, "queue_seconds": round(max(0.0, queued), 4),
                          **self.details},
        }
        if self.cancel_requested and not self.done:
            out["cancel_requested"] = True
        return out


def _job_error(code: str, message: str) -> dict[str, Any]:
    return {"code": code, "message": message}


class VideoJobs:
    """The jobs of one service: create, progress, finish, cancel, forget; thread-safe."""

    def __init__(self, cfg: ServiceConfig, metrics: ServiceMetrics, cancel_running: Callable[[int], None],
                 clock: Callable[[], float] = time.monotonic, wallclock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.pool = cfg.video_pool().name
        self.m = metrics
        self._cancel_running = cancel_running
        self._clock, self._wallclock = clock, wallclock
        self._jobs: dict[str, Job] = {}
        self._by_call: dict[str, Job] = {}
        self._seq = 0
        self._lock = threading.Lock()
        self.on_result: Callable[[Job, ResultMsg], None] | None = None  # the service observes the run's seconds
        self.zero()

    def zero(self) -> None:
        p = self.pool
        self.m.video_jobs_created_total.labels(pool=p)
        for o in OUTCOMES:
            self.m.video_jobs_finished_total.labels(pool=p, outcome=METRIC_WORD[o])
        self.m.video_frames_total.labels(pool=p)
        # At 0 from the start, so the first job is an increase rate() sees (a histogram born at 1 is not).
        self.m.video_job_duration_seconds.labels(pool=p)
        self.update_gauges()

    # ----- lifecycle ----------------------------------------------------------------------------
    def reserve(self) -> None:
        """Room for one more job: finished ones past their keep time go, then the oldest finished; with every
        remembered job still in flight, 429 (the queue's own wait limit usually refuses first)."""
        with self._lock:
            self._forget_locked()
            if len(self._jobs) < self.cfg.video.max_jobs:
                return
        raise ApiError(429, f"{self.cfg.video.max_jobs} video jobs are in flight; retry later", None, "overloaded",
                       "rate_limit_error", {"Retry-After": "10"})

    def _forget_locked(self) -> None:
        now, keep = self._clock(), self.cfg.video.keep_seconds
        for jid in [j.id for j in self._jobs.values() if j.done and j.finished and now - j.finished > keep]:
            del self._jobs[jid]
        done = sorted((j for j in self._jobs.values() if j.done), key=lambda j: j.finished or 0.0)
        while len(self._jobs) >= self.cfg.video.max_jobs and done:
            del self._jobs[done.pop(0).id]

    def submit(self, req: GenerationRequest, enqueue: Callable[..., Ticket]) -> Job:
        """Queue a validated request as a job: ``enqueue(request, on_start=, call_id=)`` admits its ticket (or
        raises: 429, 503, and the job is forgotten).  Counted as created once queued."""
        with self._lock:
            self._seq += 1
            seq = self._seq
        req = GenerationRequest(**{**req.__dict__, "job": seq})  # the number its cancellation names
        job = Job(f"video_{secrets.token_hex(12)}", seq, req, self.pool, self._clock(), self._wallclock())
        with self._lock:
            self._jobs[job.id] = job
            self._by_call[self.call_id(job)] = job
        try:
            ticket = enqueue(req, on_start=lambda: self._started(job), call_id=self.call_id(job))
        except BaseException:
            with self._lock:
                self._jobs.pop(job.id, None)
                self._by_call.pop(self.call_id(job), None)
            raise
        job.ticket = ticket
        self.m.video_jobs_created_total.labels(pool=self.pool).inc()
        ticket.future.add_done_callback(lambda fut: self._finish(job, fut))
        self.update_gauges()
        return job

    @staticmethod
    def call_id(job: Job) -> str:
        """The id of the worker call that runs ``job``: its progress messages carry it."""
        return f"{job.id}.run"

    def _started(self, job: Job) -> None:
        with self._lock:
            if job.status == QUEUED:
                job.status, job.started = RUNNING, self._clock()
        self.update_gauges()

    def progress(self, msg: ProgressMsg) -> None:
        with self._lock:
            job = self._by_call.get(str(msg.get("id")))
            if job is not None and not job.done:
                job.status = RUNNING
                job.started = job.started or self._clock()
                job.step = int(msg["step"])

    def _finish(self, job: Job, fut: Future[Any]) -> None:
        """The ticket's outcome decides the job's: the reply, the error the dispatcher set, or a cancel."""
        try:
            reply = fut.result(timeout=0)
        except CancelledError:
            self._end(job, CANCELLED, None)
            return
        except ApiError as e:
            self._end(job, FAILED, _job_error(e.code, e.message))
            return
        except Exception as e:  # never leave a job in flight forever
            self._end(job, FAILED, _job_error("internal_error", f"{type(e).__name__}: {e}"))
            return
        self._end_with_reply(job, reply)

    def _end_with_reply(self, job: Job, reply: Reply) -> None:
        if reply["op"] == "error":
            if reply["kind"] == "cancelled":
                self._end(job, CANCELLED, None)
            else:
                code = "out_of_memory" if reply["kind"] == "oom" else "internal_error"
                self._end(job, FAILED, _job_error(code, reply["message"]), {"stage": reply.get("stage")})
            return
        if reply["op"] != "result" or not reply.get("images"):
            self._end(job, FAILED, _job_error("internal_error", f"unexpected reply {reply['op']!r}"))
            return
        if self.on_result is not None:
            self.on_result(job, cast(ResultMsg, reply))
        job.content = reply["images"][0]
        job.content_type = reply.get("content_type", job.content_type)
        frames = int(reply.get("frames", job.req.frames))
        self.m.video_frames_total.labels(pool=self.pool).inc(frames)
        details = {"seconds": round(reply["seconds"], 4), "seconds_per_frame": round(reply["seconds"] / frames, 5),
                   "stages": reply.get("stages", {}), "cache": reply.get("cache"),
                   "nonfinite_frames": reply.get("nonfinite", 0), "bytes": len(job.content)}
        self._end(job, SUCCEEDED, None, details)
        self.m.video_job_duration_seconds.labels(pool=self.pool).observe((job.finished or 0.0) - job.created)

    def _end(self, job: Job, status: str, error: dict[str, Any] | None,
             details: dict[str, Any] | None = None) -> None:
        with self._lock:
            if job.done:
                return
            job.status, job.error = status, error
            job.finished, job.finished_unix = self._clock(), self._wallclock()
            job.details.update(details or {})
            job.step = job.req.steps if status == SUCCEEDED else job.step
            job.ticket = None  # its future (and the reply's bytes) go with it
            self._by_call.pop(self.call_id(job), None)
        self.m.video_jobs_finished_total.labels(pool=self.pool, outcome=METRIC_WORD[status]).inc()
        self.update_gauges()

    def cancel(self, job_id: str, remove: Callable[[Ticket], bool]) -> Job:
        """Cancel a job in flight without waiting (a finished one is answered as it is).  Queued: it leaves the
        queue now; denoising: the worker stops it after its current step (the job says ``cancel_requested``
        until then); past its last step (the VAE decode and the MP4): a 409 ``not_cancellable`` at once, since
        the worker reads the cancel only between steps and the job ends in the time a decode takes."""
        job = self.get(job_id)
        with self._lock:
            ticket = job.ticket
            if job.done or ticket is None:
                return job
            if job.status == RUNNING and job.step >= job.req.steps:
                raise ApiError(409, f"video job {job_id} has finished its {job.req.steps} steps and is decoding its "
                                    "frames: it can no longer be cancelled and ends on its own shortly",
                               "id", "not_cancellable")
            job.cancel_requested = True
        if ticket.future.cancel():  # still queued: the done callback ends the job as cancelled
            remove(ticket)
        else:
            self._cancel_running(job.seq)
        return job

    def delete(self, job_id: str) -> None:
        """Forget a finished job and its video (a job in flight is cancelled, not deleted)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None and job.done:
                del self._jobs[job_id]

    def page(self, limit: int, after: str | None, order: str) -> tuple[list[Job], bool]:
        """Up to ``limit`` jobs in creation order (``asc``) or newest first (``desc``), after the job ``after``;
        and whether more follow."""
        with self._lock:
            jobs = sorted(self._jobs.values(), key=lambda j: j.seq, reverse=order == "desc")
            if after is not None:
                cut = self._jobs.get(after)
                if cut is None:
                    raise ApiError(404, f"no video job {after!r} to list after", "after", "not_found")
                jobs = [j for j in jobs if (j.seq < cut.seq if order == "desc" else j.seq > cut.seq)]
        return jobs[:limit], len(jobs) > limit

    def get(self, job_id: str) -> Job:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise ApiError(404, f"no video job {job_id!r} (unknown, or finished more than "
                                f"{self.cfg.video.keep_seconds:g} s ago)", "id", "not_found")
        return job

    # ----- gauges -------------------------------------------------------------------------------
    def update_gauges(self) -> None:
        now = self._clock()
        with self._lock:
            live = [j for j in self._jobs.values() if not j.done]
        for state in IN_FLIGHT:
            self.m.video_jobs_depth.labels(pool=self.pool, state=METRIC_WORD[state]).set(
                sum(1 for j in live if j.status == state))
        oldest = min((j.created for j in live), default=None)
        self.m.video_oldest_job_age_seconds.labels(pool=self.pool).set(0.0 if oldest is None else now - oldest)

    def counts(self) -> dict[str, int]:
        """Jobs remembered, by status (for /v1/stepwatch/info)."""
        with self._lock:
            out: dict[str, int] = {}
            for j in self._jobs.values():
                out[j.status] = out.get(j.status, 0) + 1
            return out
