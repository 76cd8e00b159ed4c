"""The practice service without its HTTP layer: admission, per-pool queues, dispatch to the worker, answers.

One ``Service`` owns the queue (``queue.Scheduler``), one dispatcher thread
that feeds the worker one request at a time, and the worker process
(``worker_client.WorkerClient``).  An OOM fails that request with a 507 naming
the stage, the shape and the fix; a worker that dies fails its in-flight
request with a 503, is restarted (with backoff while it keeps dying before it
is ready), and the restart is counted.  Every method here is thread-safe; those
that may block (on the worker) the HTTP layer calls from worker threads.  A request
is ``admit``-ted (queued), its ticket's Future waited for by the caller, and
``finish``-ed into the answer; a caller that gives up ``abandon``-s it.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from stepwatch import httpclient
from stepwatch.exporter.ledger import LedgerModel
from stepwatch.exposition import Renderer
from stepwatch.metrics import ServiceMetrics
from stepwatch.service import api, knobs
from stepwatch.service.config import PoolConfig, ServiceConfig, parse_size
from stepwatch.service.config_history import ConfigHistory, publish_rollout
from stepwatch.service.fingerprint import fingerprint_id
from stepwatch.service.jobs import Job, VideoJobs, model_name
from stepwatch.service.knobs import KnobGate
from stepwatch.service.messages import ProgressMsg, ReadyMsg, Reply, ResultMsg
from stepwatch.service.queue import LedgerParams, Predictor, QueueFull, Scheduler, Ticket
from stepwatch.service.sessions import SessionManager
from stepwatch.service.stall import Busy, InFlight, StallPolicy, restart_due, stalled_seconds
from stepwatch.service.worker_client import WorkerClient, WorkerDied, exit_text
from stepwatch.thresholds import load as load_thresholds

log = logging.getLogger("stepwatch.service")

CODES = ("200", "429", "500", "503", "507")  # created at 0 per pool: a pool's first error is a visible increase
# Knobs whose override of the start-up value triage asks about ("did someone change it?"): a value, not a
# count of label sets, so a knob set and restored, or a restart, reads as unchanged.
OVERRIDABLE = ("cache", "cache_threshold", "vae_tiling", "compile", "attention_backend")
VIDEO_OVERRIDABLE = ("video_cache", "video_decode_chunk_frames")  # with video jobs on
STREAM_OVERRIDABLE = ("stream_window_chunks", "stream_steps", "stream_late_steps")  # with streaming sessions on
Answer = tuple[int, dict[str, Any], dict[str, str]]  # status, JSON body, headers


@dataclass(frozen=True)
class Admission:
    """A request that passed validation and admission: its ticket is queued (or running, or answered)."""

    req: api.GenerationRequest
    pool: PoolConfig
    ticket: Ticket
    t0: float


def _server_error(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> api.ApiError:
    return api.ApiError(status, message, None, code, "server_error", headers)


class _Stalled(Exception):
    """The generation in flight passed twice its stall limit: the worker is restarted."""

    def __init__(self, busy: Busy) -> None:
        super().__init__(f"stalled for {busy.seconds:.0f}s")
        self.busy = busy


def _worker_died(message: str) -> api.ApiError:
    return _server_error(503, message, "worker_died", {"Retry-After": "30"})


WORKER_FAILED = "the worker cannot start; see the service log"


class Service:
    def __init__(self, cfg: ServiceConfig, registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.registry = registry or CollectorRegistry()
        self.m = ServiceMetrics(self.registry)
        self.stall = StallPolicy.from_thresholds(load_thresholds(cfg.thresholds) if cfg.thresholds else None,
                                                 cfg.thresholds_profile)
        self.inflight = InFlight()
        self._renderer = Renderer(self.registry)
        self.instance_id = cfg.instance_id or f"{socket.gethostname()}:{cfg.port}"
        self.predictor = Predictor()
        self.scheduler = Scheduler(cfg.all_pools(), self.predictor, cfg.queue.policy, cfg.queue.aging,
                                   cfg.queue.max_queued)
        self.worker = WorkerClient(cfg, self.on_worker_ready, self._on_fatal, self.on_worker_died, self._on_progress)
        self.videos: VideoJobs | None = None
        self.sessions = SessionManager(cfg, self.worker) if cfg.stream_active else None
        if cfg.video_active:
            self.videos = VideoJobs(cfg, self.m, self._cancel_running)
            self.videos.on_result = self._video_result
        self.fingerprint: dict[str, Any] = {}
        self.knobs: dict[str, Any] = {}
        self.started_knobs: dict[str, Any] | None = None  # the knobs of the first ready worker: the deployment's
        self.history = ConfigHistory(Path(cfg.state_dir) if cfg.state_dir else None)
        self._history_started = False
        self.fatal: str | None = None
        self._quick_deaths = 0  # worker deaths since it was last ready
        self.started = time.time()
        self._stop = threading.Event()
        self._stop_lock = threading.Lock()
        self._gate = KnobGate()
        self._stopped = False
        self._dispatcher = threading.Thread(target=self._dispatch_loop, daemon=True, name="stepwatch-dispatch")
        self._zero_metrics()

    def _zero_metrics(self) -> None:
        for p in self.cfg.all_pools():
            for code in CODES:
                self.m.service_requests_total.labels(pool=p.name, code=code)
            self.m.service_images_nonfinite_total.labels(pool=p.name)
            self.m.queue_rejected_total.labels(pool=p.name)
            self.m.queue_slo_seconds.labels(pool=p.name).set(p.slo_seconds)
            self.m.queue_depth.labels(pool=p.name).set(0)
            self.m.queue_estimated_wait_seconds.labels(pool=p.name).set(0)
            self.m.worker_busy_seconds.labels(pool=p.name).set(0)
            self.m.worker_expected_seconds.labels(pool=p.name).set(0)
        self.m.worker_restarts_total.inc(0)
        self.m.worker_up.set(0)
        self.m.service_ready.set(0)

    # ----- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self.worker.start()
        self._dispatcher.start()
        threading.Thread(target=self._ticker, daemon=True, name="stepwatch-gauges").start()

    def stop(self) -> None:
        """Fail what is queued with a 503 and stop the worker; a second call waits for the first."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stop.set()
            shutting_down = _server_error(503, "the service is shutting down", "shutting_down")
            self._fail_queued(shutting_down)
            if self.sessions is not None:
                self.sessions.stop()
            self.worker.stop()
            self._fail_queued(shutting_down)  # admitted while the worker stopped: answered, not left waiting
            self._stopped = True

    def _fail_queued(self, err: api.ApiError) -> None:
        for t in self.scheduler.drain():
            if not t.future.done():
                t.future.set_exception(err)
        self._update_gauges()

    @property
    def ready(self) -> bool:
        return self.worker.ready.is_set()

    def _on_fatal(self, message: str) -> None:
        self.fatal = message

    def on_worker_ready(self, msg: ReadyMsg) -> None:
        self.fingerprint = msg["fingerprint"]
        self.knobs = msg.get("knobs", {})
        if self.started_knobs is None:
            self.started_knobs = {k: self.knobs.get(k) for k in self._overridable()}
        lp = msg.get("ledger")
        if lp:
            self.predictor.ledger = LedgerParams(LedgerModel.from_dict(lp["model"]), lp["vae_scale"],
                                                 lp["text_tokens"])
        self._prime_predictor(msg)
        self._note_startup_config()
        self.publish_config()
        self._quick_deaths = 0
        self.m.worker_up.set(1)
        self.m.service_ready.set(1)
        budget = msg.get("budget_bytes")
        log.info("worker ready (pid %s, setup %.1fs, fingerprint %s, budget %s)", msg.get("pid"),
                 msg.get("setup_seconds", 0), fingerprint_id(self.fingerprint),
                 f"{budget / 2**20:.0f} MiB address space" if budget else "none")

    def _prime_predictor(self, msg: ReadyMsg) -> None:
        """The warm-up's steady-state runs (run 1) as the first observations of their shapes."""
        for w in msg.get("warmup", []):
            if w.get("run") == 1:
                width, height = parse_size(w["size"])
                req = api.GenerationRequest("", 1, width, height, w.get("steps", self.cfg.warmup_steps),
                                            w.get("guidance_scale", 1.0), 0, frames=w.get("frames", 1))
                for _ in range(3):
                    self.predictor.observe(req, w["seconds"], w.get("stages", {}))

    def on_worker_died(self, code: int | None) -> None:
        self.m.worker_up.set(0)
        self.m.service_ready.set(0)
        if self._stop.is_set():
            return
        if self.fatal is not None:
            log.error("worker cannot start; not restarting (see the error above)")
            self._fail_queued(_server_error(503, WORKER_FAILED, "worker_failed"))
            return
        self.m.worker_restarts_total.inc()
        # A worker that keeps dying before it is ready (killed during warm-up, say) is restarted with backoff.
        delay = min(60.0, 2.0 ** self._quick_deaths - 1)
        self._quick_deaths += 1
        log.error("%s; restarting it%s", exit_text(code), f" in {delay:.0f}s" if delay else "")
        if self._stop.wait(delay):
            return
        self.worker.start()

    def _overridable(self) -> tuple[str, ...]:
        return (OVERRIDABLE + (VIDEO_OVERRIDABLE if self.cfg.video_active else ())
                + (STREAM_OVERRIDABLE if self.cfg.stream_active else ()))

    def config_id(self) -> str:
        """The fingerprint plus every knob: changes with any runtime change (the fingerprint proper leaves out
        the lossy knobs, since quality baselines must stay comparable across them)."""
        # Only when set: a config without per-shape thresholds keeps the id it had before they existed.
        shape_cache = {"shape_cache": self.cfg.shape_cache} if self.cfg.shape_cache else {}
        return fingerprint_id({"fingerprint": self.fingerprint, "knobs": self.knobs, **shape_cache})

    def _note_startup_config(self) -> None:
        """The first ready worker's configuration is the process's start-up one: compared with the previous
        process's (service/config_history.py), so a restart onto another configuration is a known rollout."""
        if self._history_started:
            return
        self._history_started = True
        settings = {**{k: self.knobs.get(k) for k in self._overridable()},
                    "fingerprint": fingerprint_id(self.fingerprint), "shape_cache": self.cfg.shape_cache or None}
        rollout = self.history.start(self.config_id(), settings)
        if rollout is not None:
            log.warning("configuration rolled out by restart: %s (config %s -> %s)", ", ".join(rollout.keys),
                        rollout.previous_config_id, rollout.config_id)

    def publish_config(self) -> None:
        info = {"instance_id": self.instance_id, "fingerprint_id": fingerprint_id(self.fingerprint),
                "config_id": self.config_id()}
        for k, v in sorted(self.knobs.items()):
            info[k] = json.dumps(v) if isinstance(v, dict) else str(v)
        # Info metrics keep old label sets; clear so only the current config shows.
        self.m.service_config.clear()
        self.m.service_config.info(info)
        publish_rollout(self.m, self.history.last, (*self._overridable(), "fingerprint", "shape_cache"))
        started = self.started_knobs or {}
        for k in self._overridable():
            self.m.service_knob_override_active.labels(knob=k).set(
                int(k in started and self.knobs.get(k) != started[k]))

    # ----- dispatch -------------------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        while not self._stop.is_set():
            if not self.worker.ready.wait(timeout=0.5):
                continue
            t = self.scheduler.take(timeout=0.5)
            if t is None:
                continue
            if not t.future.set_running_or_notify_cancel():  # its client gave up while it queued
                self.scheduler.done(t)
                self._update_gauges()
                continue
            if t.on_start is not None:
                t.on_start()
            self._update_gauges()
            self.m.queue_wait_seconds.labels(pool=t.pool).observe(time.monotonic() - t.enqueued)
            try:
                with self._gate.generation():
                    self._run_ticket(t)
            finally:
                self.scheduler.done(t)
                self._update_gauges()

    def _run_ticket(self, t: Ticket) -> None:
        """One request on the worker; its client's Future gets the reply or the error to answer."""
        timeout = self.cfg.request_timeout_seconds
        self.inflight.start(t.pool, t.predicted)
        try:
            reply = self._await_reply(
                self.worker.call({"op": "generate", "id": t.call_id, "request": t.request.__dict__}), timeout)
            if not t.future.done():
                t.future.set_result(reply)
        except _Stalled as e:
            log.error("the worker stalled: %.0fs on one generation (predicted %.1fs); restarting it",
                      e.busy.seconds, e.busy.expected_seconds)
            self.worker.kill()  # first: not ready before the client hears why
            if not t.future.done():
                t.future.set_exception(_server_error(
                    504, f"the worker stalled ({e.busy.seconds:.0f}s on this request, predicted "
                         f"{e.busy.expected_seconds:.1f}s); it is restarting", "timeout"))
        except WorkerDied as e:
            if not t.future.done():
                t.future.set_exception(_worker_died(
                    f"the worker died while generating this request ({e}); it is restarting, retry shortly"))
        except FutureTimeout:
            log.error("request timed out after %ss; killing the worker", timeout)
            self.worker.kill()  # first: not ready before the client hears why
            if not t.future.done():
                t.future.set_exception(_server_error(
                    504, f"generation took longer than {timeout:.0f}s; the worker is restarting", "timeout"))
        finally:
            self.inflight.finish()

    def _await_reply(self, call: Any, timeout: float) -> Any:
        """The worker's reply; FutureTimeout past ``timeout``, _Stalled once a restart is due (checked each
        second: a hung worker never answers, so waiting out the request timeout would hold everyone)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return call.result(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except FutureTimeout:
                busy = self.inflight.busy()
                if busy is not None and restart_due(busy, self.stall):
                    raise _Stalled(busy) from None
                if time.monotonic() >= deadline:
                    raise

    def stalled_seconds(self) -> float:
        """Seconds on the generation in flight when the worker is stalled, else 0 (for /readyz, /healthz)."""
        return stalled_seconds(self.inflight.busy(), self.stall)

    def _ticker(self) -> None:
        while not self._stop.wait(1.0):
            self._update_gauges()

    def _update_gauges(self) -> None:
        if self.videos is not None:
            self.videos.update_gauges()
        busy = self.inflight.busy()
        for pool, s in self.scheduler.snapshot().items():
            self.m.queue_depth.labels(pool=pool).set(s["depth"])
            self.m.queue_estimated_wait_seconds.labels(pool=pool).set(s["estimated_wait"])
            mine = busy is not None and busy.pool == pool
            self.m.worker_busy_seconds.labels(pool=pool).set(busy.seconds if mine and busy else 0)
            self.m.worker_expected_seconds.labels(pool=pool).set(busy.expected_seconds if mine and busy else 0)

    # ----- requests -------------------------------------------------------------------------
    def pool_of(self, body: Any) -> str:
        """The pool a request body would go to (for its metrics, even when the body is bad)."""
        size = body.get("size") if isinstance(body, dict) else None
        return self.cfg.pool_for((size if isinstance(size, str) else self.cfg.default_size).lower()).name

    def count(self, pool: str, status: int, t0: float) -> None:
        """One answered request in the service's request counter and latency histogram."""
        self.m.service_requests_total.labels(pool=pool, code=str(status)).inc()
        self.m.service_request_duration_seconds.labels(pool=pool).observe(time.monotonic() - t0)

    def admit(self, body: dict[str, Any]) -> Admission:
        """Validate and queue a request (its ticket's Future gets the worker's reply); raises ApiError."""
        req = api.validate(body, self.cfg)
        pool = self.cfg.pool_for(req.size)
        t0 = time.monotonic()
        return Admission(req, pool, self._admit(req, pool.name), t0)

    def answer_timeout(self, adm: Admission) -> float:
        """How long a client waits for its reply before a 504: the pool's queue limit, the run, a margin."""
        return adm.pool.max_wait_seconds + self.cfg.request_timeout_seconds + 60

    @staticmethod
    def timed_out() -> api.ApiError:
        return _server_error(504, "generation did not finish in time", "timeout")

    def abandon(self, adm: Admission) -> None:
        """Its client gave up: a request still queued is cancelled (it never runs) and leaves the queue."""
        if adm.ticket.future.cancel():
            self.scheduler.remove(adm.ticket)
            self._update_gauges()

    def finish(self, adm: Admission, reply: Reply) -> Answer:
        """The answer to an admitted request from the worker's reply; raises ApiError (507, 500)."""
        return self._answer(adm.req, adm.pool.name, adm.ticket, reply, adm.t0)

    def _admit(self, req: api.GenerationRequest, pool: str, on_start: Any = None, call_id: str = "") -> Ticket:
        if self._stop.is_set():
            raise _server_error(503, "the service is shutting down", "shutting_down")
        if self.fatal is not None:
            raise _server_error(503, WORKER_FAILED, "worker_failed")
        if not self.ready:
            raise _server_error(503, "warming up (compiling the serving resolutions); retry shortly", "not_ready",
                                {"Retry-After": "10"})
        try:
            ticket = self.scheduler.submit(req, pool, on_start, call_id)
        except QueueFull as e:
            self.m.queue_rejected_total.labels(pool=pool).inc()
            raise api.ApiError(429, f"pool '{pool}' is overloaded: estimated wait {e.estimated_wait:.0f}s is past "
                               f"its limit of {e.limit:.0f}s; retry after {e.retry_after}s", None, "overloaded",
                               "rate_limit_error", {"Retry-After": str(e.retry_after)}) from None
        self._update_gauges()
        return ticket

    def _answer(self, req: api.GenerationRequest, pool: str, ticket: Ticket, reply: Reply, t0: float) -> Answer:
        if reply["op"] == "error":
            if reply["kind"] == "oom":
                raise _server_error(507, reply["message"], "out_of_memory")
            raise _server_error(500, f"generation failed: {reply.get('message', '')}", "internal_error")
        if reply["op"] != "result":
            raise _server_error(500, f"generation failed: unexpected reply {reply['op']!r}", "internal_error")
        self.predictor.observe(req, reply["seconds"], reply.get("stages", {}))
        if reply.get("nonfinite"):
            self.m.service_images_nonfinite_total.labels(pool=pool).inc(reply["nonfinite"])
        body = {
            "created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(png).decode()} for png in reply["images"]],
            "stepwatch": self._stepwatch_fields(req, pool, ticket, reply, t0),
        }
        return 200, body, {}

    def _stepwatch_fields(self, req: api.GenerationRequest, pool: str, ticket: Ticket, reply: ResultMsg,
                          t0: float) -> dict[str, Any]:
        """The answer's ``stepwatch`` object: where the time went, and what served it."""
        queue_s = (ticket.started or t0) - ticket.enqueued
        return {
            "shape": reply.get("shape", req.shape), "pool": pool, "queue_seconds": round(queue_s, 4),
            "seconds": round(reply["seconds"], 4), "total_seconds": round(time.monotonic() - t0, 4),
            "stages": reply.get("stages", {}),
            "steps": reply.get("steps"), "cache": reply.get("cache"), "instance_id": self.instance_id,
            "fingerprint_id": fingerprint_id(self.fingerprint), "seed": req.seed,
            "nonfinite_images": reply.get("nonfinite", 0),
            # with ranks: the per-rank busy time of the last request every rank finished, usually the one
            # before this (``requests_ago``): the ranks ship their timings in the background
            **({"ranks": reply["ranks"]} if reply.get("ranks") else {}),
        }

    # ----- video jobs -------------------------------------------------------------------------
    def _jobs(self) -> VideoJobs:
        if self.videos is None:
            why = "ranks > 1" if self.cfg.video.enabled else "video.enabled is false"
            raise api.ApiError(404, f"video jobs are off on this service ({why})", None, "video_off")
        return self.videos

    def submit_video(self, body: dict[str, Any]) -> dict[str, Any]:
        """Validate and queue a video job; its view (status queued).  Raises ApiError (400, 429, 503)."""
        jobs = self._jobs()
        req = api.validate_video(body, self.cfg)
        jobs.reserve()
        job = jobs.submit(req, self._enqueue_video)
        return self._view(job)

    def _view(self, job: Job) -> dict[str, Any]:
        return job.view(time.monotonic(), model_name(self.cfg.video.model), self.cfg.video.fps)

    def list_videos(self, limit: int, after: str | None, order: str) -> dict[str, Any]:
        """``GET /v1/videos``: the jobs remembered, a page at a time (OpenAI's list with its cursor)."""
        page, more = self._jobs().page(limit, after, order)
        data = [self._view(j) for j in page]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    def _enqueue_video(self, req: api.GenerationRequest, on_start: Any, call_id: str) -> Ticket:
        return self._admit(req, self.cfg.video_pool().name, on_start=on_start, call_id=call_id)

    def video(self, job_id: str) -> dict[str, Any]:
        return self._view(self._jobs().get(job_id))

    def video_content(self, job_id: str) -> tuple[bytes, str]:
        """The finished job's video; 409 while it is not (yet) there, naming its status."""
        job = self._jobs().get(job_id)
        if job.content is None:
            why = {"failed": "it failed", "cancelled": "it was cancelled"}.get(job.status, f"it is {job.status}")
            raise api.ApiError(409, f"video job {job_id} has no video: {why}", "id", f"video_{job.status}")
        return job.content, job.content_type

    def cancel_video(self, job_id: str) -> dict[str, Any]:
        """``DELETE``, answered at once: a job in flight is cancelled (a queued one at once, a denoising one
        says ``cancel_requested`` until it stops after its step: poll it; a decoding one is a 409); a finished
        one is deleted with its video, as OpenAI's delete does."""
        jobs = self._jobs()
        job = jobs.get(job_id)
        if job.done:
            jobs.delete(job_id)
            return {"id": job_id, "object": "video.deleted", "deleted": True}
        job = jobs.cancel(job_id, self.scheduler.remove)
        self._update_gauges()
        return self._view(job)

    def _cancel_running(self, seq: int) -> None:
        cancel = getattr(self.worker, "cancel", None)
        if cancel is not None:
            cancel.value = seq

    def _on_progress(self, msg: ProgressMsg) -> None:
        if self.videos is not None:
            self.videos.progress(msg)

    def _video_result(self, job: Job, reply: ResultMsg) -> None:
        self.predictor.observe(job.req, reply["seconds"], reply.get("stages", {}))
        job.details["fingerprint_id"] = fingerprint_id(self.fingerprint)
        job.details["instance_id"] = self.instance_id
        if reply.get("nonfinite"):
            self.m.service_images_nonfinite_total.labels(pool=job.pool).inc(reply["nonfinite"])

    def info(self) -> dict[str, Any]:
        worker: dict[str, Any] = {}
        if self.ready:
            try:
                worker = {**self.worker.call({"op": "info", "id": ""}).result(timeout=30)}
            except Exception:
                worker = {}
        if worker.get("pid") is None:  # warming up, or answering nothing: the process's own pid, if one runs
            worker["pid"] = self.worker.pid()
        ready = self.worker.ready_info
        return {
            "instance_id": self.instance_id, "fingerprint": self.fingerprint,
            "fingerprint_id": fingerprint_id(self.fingerprint) if self.fingerprint else None,
            "knobs": self.knobs, "config_id": self.config_id(), "ready": self.ready,
            "pools": {p.name: {"sizes": p.sizes, "slo_seconds": p.slo_seconds, "max_wait_seconds": p.max_wait_seconds}
                      for p in self.cfg.all_pools()},
            "default_size": self.cfg.default_size, "default_steps": self.cfg.default_steps,
            "warmup": self.cfg.warmup,
            "video": self._video_info(),
            "worker": {**{k: worker.get(k) for k in ("pid", "rss_bytes", "vm_bytes", "budget_bytes")},
                       # from the ready message: known even while the worker is stuck and answers nothing
                       "ranks": (ready.get("ranks") if ready is not None else None) or []},
            "uptime_seconds": round(time.time() - self.started, 1),
        }

    def _video_info(self) -> dict[str, Any] | None:
        if self.videos is None:
            return None
        v = self.cfg.video
        return {"sizes": v.sizes, "default_size": v.default_size, "default_frames": v.default_frames,
                "max_frames": v.max_frames, "default_steps": v.default_steps, "guidance_scale": v.guidance_scale,
                "fps": v.fps, "jobs": self.videos.counts()}

    def set_knobs(self, new: Any) -> dict[str, Any]:
        """Check the knobs, have the worker apply them, publish the new config; raises ApiError."""
        try:
            knobs.validate(new, self.cfg.ranks, self.cfg.video_active, self.cfg.stream_active)
        except knobs.KnobError as e:
            raise api.ApiError(400, str(e), e.param, "invalid_knobs") from None
        if not self.ready:
            raise _server_error(503, "warming up; retry shortly", "not_ready")
        before = dict(self.knobs)
        with self._gate.knobs():  # after the generation in flight, before the next: never timed as one
            reply = self._apply_knobs(new)
        self.knobs = reply["knobs"]
        self.fingerprint = reply["fingerprint"]
        self.publish_config()
        log.warning("admin knobs changed: %s -> %s (fingerprint %s, config %s)", before, self.knobs,
                    fingerprint_id(self.fingerprint), self.config_id())
        return {"knobs": self.knobs, "fingerprint": self.fingerprint,
                "fingerprint_id": fingerprint_id(self.fingerprint), "config_id": self.config_id()}

    def _apply_knobs(self, new: dict[str, Any]) -> dict[str, Any]:
        try:
            reply = self.worker.call({"op": "knobs", "id": "", "knobs": new}).result(
                timeout=self.cfg.request_timeout_seconds)
        except WorkerDied as e:
            raise _worker_died(f"the worker died while applying the knobs ({e}); it is restarting") from None
        except FutureTimeout:
            raise _server_error(504, "the worker did not apply the knobs in time (busy with a long request?)",
                                "timeout") from None
        if reply["op"] == "error" and reply["kind"] == "invalid":
            raise api.ApiError(400, reply["message"], reply.get("param"), "invalid_knobs")
        if reply["op"] != "knobs":
            raise _server_error(500, f"applying knobs failed: {reply.get('message')}", "internal_error")
        return dict(reply)

    def metrics_text(self) -> bytes:
        """The service's metrics, then the worker's exporter metrics (absent while it restarts)."""
        self._update_gauges()
        text = self._renderer.render()
        info = self.worker.ready_info
        if info and info.get("metrics_port"):
            try:
                r = httpclient.request("GET", f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=2)
                r.raise_for_status()
                text += r.content
            except httpx.HTTPError as e:
                log.debug("worker metrics unavailable: %s", e)
        return text
