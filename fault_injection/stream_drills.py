"""Drills on the practice service's streaming sessions: chunks slower than real time (steps raised, or a CPU-bound
neighbour), a KV window past memory, drift.

All run on the one-rank drill stack (streaming is on there) while its image traffic goes on: every image
request must still be answered.  Their blocks are in runbooks/drills.md ("Streaming sessions"); the sessions
go through the public API (``POST /v1/stream/sessions``, server-sent events), as a viewer's player would.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from stepwatch import httpclient
from stepwatch.fault_injection import queries
from stepwatch.fault_injection.drill import Drill, DrillResult
from stepwatch.fault_injection.neighbours import crowd_worker, stop_neighbours
from stepwatch.fault_injection.stack import LocalStack
from stepwatch.fault_injection.traffic import ClientLoop
from stepwatch.sse import parse_sse

SESSION_TIMEOUT_S = 300.0


def run_session(service_url: str, live: dict[str, list[float]] | None = None, **body: Any) -> dict[str, Any]:
    """Open a session and read its events to the end: what the viewer saw (status, chunks, each chunk's
    ``seconds`` and, after the first, its real-time factor against the frames it plays, the time to the first
    frames) and the ``end`` event's outcome, reason and message.  ``live`` (``chunk_seconds``,
    ``realtime_factors``) gets each chunk's figures the moment it arrives (a caller that watches live)."""
    body.setdefault("prompt", "a kite over a grey sea")
    live = live if live is not None else {"chunk_seconds": [], "realtime_factors": []}
    seen: dict[str, Any] = {"status": 0, "chunks": 0, "first_frames_s": None, **live}
    t0 = time.perf_counter()
    with httpclient.client(timeout=SESSION_TIMEOUT_S) as c, \
            c.stream("POST", service_url + "/v1/stream/sessions", json=body) as r:
        seen["status"] = r.status_code
        if r.status_code != 200:
            r.read()
            seen["error"] = r.text[:500]
            return seen
        for kind, data in parse_sse(r.iter_lines()):
            _take(seen, kind, data, t0)
    return seen


def _take(seen: dict[str, Any], kind: str, data: dict[str, Any], t0: float) -> None:
    if kind == "session":
        seen["frames_per_chunk"], seen["fps"] = list(data.get("frames_per_chunk") or []), data.get("fps")
    elif kind == "chunk":
        if seen["first_frames_s"] is None:
            seen["first_frames_s"] = time.perf_counter() - t0
        seen["chunks"] += 1
        seen["chunk_seconds"].append(float(data["seconds"]))
        seen["realtime_factors"].extend(_realtime_factor(seen, int(data["index"]), float(data["seconds"])))
    elif kind == "end":
        seen.update({k: data.get(k) for k in ("outcome", "reason", "message")})
        seen["delivered"] = data.get("chunks")


def _realtime_factor(seen: dict[str, Any], index: int, seconds: float) -> list[float]:
    """A chunk's generation time over the time its frames play, as the stall alert reads it (not chunk 0:
    it carries the call's start)."""
    frames, fps = seen.get("frames_per_chunk") or [], seen.get("fps")
    if index < 1 or index >= len(frames) or not fps or frames[index] < 1:
        return []
    return [seconds / (frames[index] / float(fps))]


def check_session_after_restore(stack: LocalStack, drill: Drill, r: DrillResult) -> None:
    """The block's ``then`` session streams to its ``expect_outcome`` (default: done).  It is smaller than the
    faults' sessions: beside the baseline's image clients a 128x128 session plays at a real-time factor of
    0.9-1.1 on the practice stack, so a check session of that size could page the stall alert itself."""
    then = drill.spec.traffic.get("then") or {}
    seen = run_session(stack.service_url, **dict(then.get("session") or {}))
    r.details["session_after_restore"] = {k: seen.get(k) for k in ("status", "outcome", "chunks")}
    r.checks["sessions_stream_after_restore"] = seen.get("outcome") == then.get("expect_outcome", "done")


class SessionLoop(ClientLoop):
    """Sessions one after another (a viewer that reconnects): outcomes are the sessions' ``end`` outcomes, and
    every chunk's latency and real-time factor as the worker reported them are kept as they arrive (the alert
    may fire mid-session)."""

    def __init__(self, stack: LocalStack, body: dict[str, Any]) -> None:
        super().__init__(self._session, "stepwatch-sessions", SESSION_TIMEOUT_S)
        self.stack, self.body = stack, body
        self.live: dict[str, list[float]] = {"chunk_seconds": [], "realtime_factors": []}

    def _session(self) -> str:
        seen = run_session(self.stack.service_url, self.live, **self.body)
        return str(seen.get("outcome") or f"http_{seen['status']}")


class StreamStall(Drill):
    name = "stream-stall"
    doc_id = "stream_stall"
    in_place_when_injected = True  # a knob: from the next streaming session on
    reads_baselines = False
    # Eight times the steps of every chunk take the worker's CPUs from the image requests beside them.
    companions = ("step_time_regression", "queue_wait", "probe_failing")
    description = ("The steps per chunk raised eightfold while sessions stream: every chunk takes longer to "
                   "generate than its frames play. The real-time-factor alert fires, triage names the raised steps; "
                   "the sessions still deliver every chunk, late, and images are served throughout.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        r.details["serving_knobs"] = stack.info()["knobs"]
        stack.knobs(**self.inject_knobs())
        r.details["_sessions"] = SessionLoop(stack, dict(self.spec.traffic.get("session") or {})).start()
        r.notes.append(f"knobs {self.inject_knobs()}: sessions at {self.spec.traffic.get('session')}")

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        loop: SessionLoop | None = r.details.get("_sessions")
        late = [s for s in (loop.live["chunk_seconds"] if loop else [])[1:] if s > 0]
        rtf = loop.live["realtime_factors"] if loop else []
        r.details["chunk_seconds_p50"] = statistics.median_high(late) if late else None
        r.details["realtime_factor_p50"] = round(statistics.median_high(rtf), 2) if rtf else None
        r.checks["chunks_slower_than_they_play"] = bool(rtf) and statistics.median_high(rtf) > 1.0

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        loop: SessionLoop | None = r.details.pop("_sessions", None)
        if loop is not None:
            loop.stop()
            r.details["session_outcomes"] = dict(loop.outcomes)
            r.checks["sessions_deliver_every_chunk"] = set(loop.outcomes) == {"done"}
            if loop.errors:
                r.notes.append(f"session client errors: {loop.errors[:3]}")
        knobs = self.restore_knobs(r.details.get("serving_knobs", {}))
        if knobs:
            stack.knobs(**knobs)

    def after(self, stack: LocalStack, r: DrillResult) -> None:
        check_session_after_restore(stack, self, r)


class StreamCpuContention(StreamStall):
    """CPU-bound processes beside the worker while sessions stream, no knob touched: the rival of raised steps
    behind the real-time-factor alert (the host side of every step of every chunk runs late)."""

    name = "stream-cpu-contention"
    doc_id = "stream_cpu_contention"
    in_place_when_injected = True  # the neighbours run from the moment they are started
    description = ("CPU-bound processes share every CPU of the worker while sessions stream (a co-located job, no "
                   "knob touched): every chunk takes longer to generate than its frames play. The real-time-factor "
                   "alert fires and triage names the CPU contention, not the steps or the window.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        r.details["serving_knobs"] = stack.info()["knobs"]
        per_cpu = int(self.spec.inject["cpu_neighbours"].get("per_cpu", 1))
        cpus = crowd_worker(stack, r, per_cpu)
        r.details["_sessions"] = SessionLoop(stack, dict(self.spec.traffic.get("session") or {})).start()
        r.notes.append(f"{per_cpu} CPU-bound process(es) pinned to each of the worker's CPUs {cpus}; sessions at "
                       f"{self.spec.traffic.get('session')}")

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        stop_neighbours(r)
        super().restore(stack, r)


class KvWindowTooLong(Drill):
    name = "kv-window-too-long"
    doc_id = "kv_window_too_long"
    in_place_when_injected = False  # the fault is the long session itself
    reads_baselines = False
    description = ("The KV window made 32 chunks long and a long session opened at 128x128: its KV cache needs more "
                   "than the worker's KV memory. That session fails at once as an out-of-memory of stage kv_cache, "
                   "triage names the window; the next streaming session and the images are served by the same worker.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        info = stack.info()
        r.details["serving_knobs"] = info["knobs"]
        r.details["worker_pid_before"] = info["worker"]["pid"]
        stack.knobs(**self.inject_knobs())
        tr = self.spec.traffic
        seen = run_session(stack.service_url, **dict(tr["session"]))
        msg = str(seen.get("message") or "")
        r.details["long_session"] = {k: seen.get(k) for k in ("status", "outcome", "reason", "chunks", "message")}
        r.checks["long_session_fails_out_of_memory"] = seen.get("outcome") == "failed" and seen.get("reason") == "oom"
        r.checks["error_names_kv_cache_and_fix"] = "KV cache" in msg and "fix:" in msg and "stream_window_chunks" in msg

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        knobs = self.restore_knobs(r.details.get("serving_knobs", {}))
        if knobs:
            stack.knobs(**knobs)

    def after(self, stack: LocalStack, r: DrillResult) -> None:
        info = stack.info()
        r.checks["same_worker_no_restart"] = info["worker"]["pid"] == r.details.get("worker_pid_before")
        check_session_after_restore(stack, self, r)


class Drift(Drill):
    name = "drift"
    doc_id = "drift"
    in_place_when_injected = True  # a knob: the next probe session runs with it
    reads_baselines = False
    stream_probe = True
    description = ("Every chunk from chunk 4 on sampled with 1 step instead of 4: the stream probe's session starts "
                   "exactly as its baseline and drifts below the video gate from chunk 4. The drift alert fires, "
                   "triage names the cut steps; sessions and images are served throughout.")

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        r.details["serving_knobs"] = stack.info()["knobs"]
        stack.knobs(**self.inject_knobs())
        r.notes.append(f"knobs {self.inject_knobs()}")

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        """What the probe read: chunks 0-3 at their baseline, the later ones below the gate."""
        rows = stack.prom.query(queries.stream_chunk_psnr())
        psnr = {s.labels.get("chunk_index", ""): s.value for s in rows if s.labels.get("probe_set") == "stream"}
        gate = self.th.quality.video_psnr_gate_db
        early = [v for k, v in psnr.items() if k in ("0", "1", "2-3")]
        late = [v for k, v in psnr.items() if k not in ("0", "1", "2-3")]
        r.details["chunk_psnr_db"] = {k: round(v, 1) for k, v in sorted(psnr.items())}
        r.checks["early_chunks_pass"] = bool(early) and min(early) >= gate
        r.checks["late_chunks_below_gate"] = bool(late) and min(late) < gate

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        knobs = self.restore_knobs(r.details.get("serving_knobs", {}))
        if knobs:
            stack.knobs(**knobs)

    def after(self, stack: LocalStack, r: DrillResult) -> None:
        seen = run_session(stack.service_url, chunks=4)
        r.checks["sessions_stream_after_restore"] = seen.get("outcome") == "done"


class WindowDrift(Drift):
    """The drift drill's probe and checks, another cause: the KV window raised past the one the model learned."""

    name = "window-drift"
    doc_id = "window_drift"
    description = ("The KV window raised from 3 chunks to 6: chunks 0-2 stay exact, the later ones read "
                   "full-resolution context where the model learned compressed and drift below the video gate. "
                   "The drift alert fires, triage names the window; sessions and images are served throughout.")


STREAM_DRILLS: tuple[type[Drill], ...] = (StreamStall, KvWindowTooLong, Drift, WindowDrift, StreamCpuContention)
