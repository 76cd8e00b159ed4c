"""``stepwatch bench soak``: mixed traffic on one practice service for N minutes; does anything leak or fail?

A bug that needs minutes of mixed traffic to show (a worker whose address space creeps up until a job within the
advertised limits fails out of memory, an HTTP process that keeps every closed session's events) passes every
short test.  This starts one ``stepwatch serve`` (compile off, video and streaming on) and runs three clients
beside each other until the time is up: images at every pool size; video jobs at both video sizes with frames
9 to ``video.max_frames``, some cancelled mid-run; streaming sessions read to the end, dropped after a chunk, or
left unread for a while.  Once a minute a line on stderr says where it stands.

The bar (PASS, exit 0; else FAIL, exit 1):

- no request failed within the limits: a job or session the service accepted that later failed (out of memory,
  an internal error, a session's outcome ``failed``), or an image answered 5xx other than 503/429 (those are
  admission refusals, not failures); a video job of at most ``video.max_frames`` at one of ``video.sizes`` that
  fails out of memory is exactly the bug this looks for;
- the worker's VM (its address space, what the memory budget caps) and the HTTP process's RSS at the end are
  at most 10% above their level after the first minute (``*_start_mb``: by then each client's traffic has
  run, so allocators and pipelines have their working size; a fall is no leak);
- no worker restart.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from stepwatch import httpclient
from stepwatch.procs import Child, free_port
from stepwatch.sse import parse_sse

DEFAULT_MINUTES = 10
TOLERANCE = 0.10  # the end level may be this much above the first minute's
MB = 1 << 20
PROMPT = "a lighthouse at dusk, waves"
RESTARTS = "stepwatch_worker_restarts_total"
READY_TIMEOUT_S = 300.0
POLL_S = 0.2  # how often a video job is polled
DRAIN_TIMEOUT_S = 180.0  # after the time is up: clients finish (or cancel) what they have in flight

VIDEO_SIZES = ["128x128", "256x256"]
VIDEO_FRAMES = (9, 41, 81, 121)
MAX_FRAMES = 121
STREAM_SIZES = ["64x64", "128x128"]
IMAGE_POOL_SIZES = {"small": ["256x256", "512x512"], "large": ["1024x1024", "2048x2048"]}
IMAGE_POOL_SLO_S = {"small": 30, "large": 120}

# Compile off (a soak measures serving, not compiling); the memory budget is the service's default; long SLOs,
# so the one queue admits what the clients send rather than shedding it.
SOAK_CONFIG: dict[str, Any] = {
    "compile": {"enabled": False},
    "warmup": ["256x256"],
    "default_size": "256x256",
    "default_steps": 4,
    "pools": {name: {"sizes": sizes, "slo_seconds": IMAGE_POOL_SLO_S[name]}
              for name, sizes in IMAGE_POOL_SIZES.items()},
    "other_pool": {"slo_seconds": 120},
    "video": {"enabled": True, "sizes": VIDEO_SIZES, "max_frames": MAX_FRAMES, "slo_seconds": 300,
              "max_wait_seconds": 600},
    "stream": {"enabled": True, "sizes": STREAM_SIZES, "max_sessions": 2},
}
IMAGE_SIZES = [s for sizes in IMAGE_POOL_SIZES.values() for s in sizes]
# Every video size at every frame count, smallest first; each third job is cancelled once it runs.
VIDEO_PLAN = [(size, frames) for frames in VIDEO_FRAMES for size in VIDEO_SIZES]
CANCEL_EVERY = 3


@dataclass(frozen=True)
class StreamPlan:
    """One streaming client: ``read`` to the end, ``drop`` after the first chunk, or ``stall``: take the first
    event, then hold the socket unread for ``hold_s`` (past the idle timeout, 30 s, the service closes it)."""

    mode: str
    size: str
    hold_s: float = 0.0


STREAM_PLANS = [StreamPlan("read", "64x64"), StreamPlan("stall", "128x128", 10.0), StreamPlan("read", "128x128"),
                StreamPlan("drop", "64x64"), StreamPlan("stall", "64x64", 40.0), StreamPlan("drop", "128x128")]


# ----- what the clients saw ---------------------------------------------------------------------------------
@dataclass
class Tally:
    """Requests, refusals and failures counted by the client threads (thread-safe)."""

    requests: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)  # "<kind> <status>": admission refusals, bad input
    failures: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)  # "video completed", "stream done": the mix that ran
    examples: list[str] = field(default_factory=list)  # the first few failures, to say what went wrong
    client_errors: list[str] = field(default_factory=list)  # this tool's own bugs: not the service's failures
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def request(self, kind: str) -> None:
        with self.lock:
            self.requests[kind] += 1

    def outcome(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.outcomes[f"{kind} {outcome}"] += 1

    def fail(self, kind: str, detail: str) -> None:
        with self.lock:
            self.failures[kind] += 1
            if len(self.examples) < 10:
                self.examples.append(f"{kind}: {detail}"[:300])

    def answered(self, kind: str, response: httpx.Response) -> None:
        """A request not taken: a 5xx other than 503 is a failure, anything else a refusal (counted apart)."""
        status = response.status_code
        if status >= 500 and status != 503:
            self.fail(f"{kind}_{status}", response.text[:200])
        else:
            with self.lock:
                self.refused[f"{kind} {status}"] += 1

    def total_requests(self) -> int:
        with self.lock:
            return sum(self.requests.values())


def video_within_limits(size: str, frames: int) -> bool:
    """A job the service advertises it serves: one of ``video.sizes``, at most ``video.max_frames``."""
    return size in VIDEO_SIZES and frames <= MAX_FRAMES


# ----- the service ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PracticeService:
    """A running ``stepwatch serve``: its URL and the pid of its HTTP process (the worker is its child)."""

    url: str
    pid: int
    child: Child


@contextmanager
def practice_service(workdir: Path, config: dict[str, Any] | None = None, ready_timeout: float = READY_TIMEOUT_S,
                     env: dict[str, str] | None = None, cwd: Path | None = None) -> Iterator[PracticeService]:
    """``stepwatch serve`` on a free loopback port with ``config`` (default: the soak's), ready; stopped after,
    with whatever it started (its own process group).  ``env`` is added to this process's environment."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "service.yaml"
    path.write_text(yaml.safe_dump(config or SOAK_CONFIG))
    port = free_port()
    argv = [sys.executable, "-m", "stepwatch.cli", "serve", "--config", str(path), "--port", str(port)]
    child = Child("serve", argv, workdir / "service.log", env={"TOKENIZERS_PARALLELISM": "false", **(env or {})},
                  cwd=cwd)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + ready_timeout
        while not httpclient.ok(url + "/readyz"):
            if not child.alive():
                raise RuntimeError(f"the service exited with {child.proc.returncode}:\n{child.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the service was not ready after {ready_timeout:.0f} s:\n{child.tail()}")
            time.sleep(0.5)
        yield PracticeService(url, child.proc.pid, child)
    finally:
        child.stop()


# ----- the traffic ----------------------------------------------------------------------------------------
def image_client(url: str, tally: Tally, stop: threading.Event) -> None:
    """Images at every pool size in turn, one at a time, until stopped."""
    with httpclient.client(base_url=url, timeout=600) as c:
        i = 0
        while not stop.is_set():
            size = IMAGE_SIZES[i % len(IMAGE_SIZES)]
            tally.request("image")
            try:
                r = c.post("/v1/images/generations", json={"prompt": PROMPT, "size": size, "steps": 4, "seed": i})
            except httpx.HTTPError as e:
                tally.fail("image_transport", f"{size}: {type(e).__name__}: {e}")
            else:
                if r.status_code == 200:
                    tally.outcome("image", "ok")
                else:
                    tally.answered("image", r)
            i += 1


def video_client(url: str, tally: Tally, stop: threading.Event) -> None:
    """Video jobs through the plan, over and over, until stopped; each third one cancelled once it runs."""
    with httpclient.client(base_url=url, timeout=60) as c:
        i = 0
        while not stop.is_set():
            size, frames = VIDEO_PLAN[i % len(VIDEO_PLAN)]
            try:
                video_job(c, tally, stop, size, frames, cancel=i % CANCEL_EVERY == CANCEL_EVERY - 1, seed=i)
            except httpx.HTTPError as e:
                tally.fail("video_transport", f"{size} x {frames}: {type(e).__name__}: {e}")
            i += 1


def video_job(c: httpx.Client, tally: Tally, stop: threading.Event, size: str, frames: int, cancel: bool,
              seed: int) -> None:
    """One job as a client runs it: create, poll to its end (cancelling it when asked, or when the time is up,
    so the soak ends on time), then judge its outcome."""
    tally.request("video")
    r = c.post("/v1/videos", json={"prompt": PROMPT, "size": size, "frames": frames, "steps": 4, "seed": seed})
    if r.status_code != 202:
        tally.answered("video", r)
        return
    job = r.json()
    cancelled, give_up = False, time.monotonic() + DRAIN_TIMEOUT_S
    while job["status"] in ("queued", "in_progress"):
        if not cancelled and (stop.is_set() or (cancel and job["status"] == "in_progress" and job["step"] >= 1)):
            c.delete(f"/v1/videos/{job['id']}")  # any answer is fine: cancelled, cancel_requested, 409 decoding
            cancelled = True
        if stop.is_set() and time.monotonic() > give_up:
            tally.fail("video_unfinished", f"{size} x {frames}: still {job['status']} after being cancelled")
            return
        if not stop.is_set():
            give_up = time.monotonic() + DRAIN_TIMEOUT_S
        time.sleep(POLL_S)
        r = c.get(f"/v1/videos/{job['id']}")
        if r.status_code != 200:
            tally.fail(f"video_poll_{r.status_code}", r.text[:200])
            return
        job = r.json()
    tally.outcome("video", job["status"])
    error = job.get("error") or {}
    if job["status"] == "failed" and error.get("code") in ("out_of_memory", "internal_error") \
            and video_within_limits(size, frames):
        tally.fail(f"video_{error['code']}", f"{size} x {frames} frames: {error.get('message', '')}")


def stream_client(url: str, tally: Tally, stop: threading.Event) -> None:
    """Streaming sessions through the plans, over and over, until stopped."""
    i = 0
    while not stop.is_set():
        plan = STREAM_PLANS[i % len(STREAM_PLANS)]
        try:
            stream_session(url, tally, stop, plan, seed=i)
        except httpx.HTTPError as e:
            tally.fail("stream_transport", f"{plan.mode} {plan.size}: {type(e).__name__}: {e}")
        i += 1


def stream_session(url: str, tally: Tally, stop: threading.Event, plan: StreamPlan, seed: int) -> None:
    """One session on a connection of its own (closing it is the client going away); a session read to its end
    must end ``done`` or ``closed``, never ``failed``."""
    tally.request("stream")
    body = {"prompt": PROMPT, "size": plan.size, "chunks": 8, "seed": seed}
    with httpclient.client(base_url=url, timeout=120) as c, c.stream("POST", "/v1/stream/sessions", json=body) as r:
        if r.status_code != 200:
            r.read()
            tally.answered("stream", r)
            return
        for kind, data in parse_sse(r.iter_lines()):
            if plan.mode == "stall":
                stop.wait(plan.hold_s)  # the socket stays open, unread
                tally.outcome("stream", "left unread")
                return
            if plan.mode == "drop" and kind == "chunk":
                tally.outcome("stream", "dropped")
                return
            if kind == "end":
                tally.outcome("stream", str(data.get("outcome")))
                if data.get("outcome") == "failed":
                    tally.fail("stream_failed", f"{plan.size}: {data.get('reason')}: {data.get('message')}")
                return
    tally.fail("stream_cut", f"{plan.mode} {plan.size}: the stream ended without an end event")


CLIENTS: tuple[Callable[[str, Tally, threading.Event], None], ...] = (image_client, video_client, stream_client)


def start_clients(url: str, tally: Tally, stop: threading.Event) -> list[threading.Thread]:
    """One thread per kind of traffic; a bug of this tool in one is noted and that client goes on."""

    def guarded(client: Callable[[str, Tally, threading.Event], None]) -> None:
        while not stop.is_set():
            try:
                client(url, tally, stop)
            except Exception as e:
                with tally.lock:
                    tally.client_errors.append(f"{client.__name__}: {type(e).__name__}: {e}"[:300])
                stop.wait(1.0)

    threads = [threading.Thread(target=guarded, args=(c,), name=f"soak-{c.__name__}", daemon=True) for c in CLIENTS]
    for t in threads:
        t.start()
    return threads


# ----- what the service says about itself -------------------------------------------------------------------
@dataclass
class Sample:
    """The levels at one moment (None: could not be read)."""

    minute: int
    requests: int
    worker_vm_mb: float | None
    worker_rss_mb: float | None
    http_rss_mb: float | None
    restarts: int | None
    worker_pid: int | None = None


def proc_status_mb(pid: int | None, key: str) -> float | None:
    """A ``kB`` line (VmRSS, VmSize) of /proc/<pid>/status in MiB; None when the process is gone."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024 / MB
    except (OSError, ValueError, IndexError):
        return None
    return None


def restarts_in(metrics_text: str) -> int:
    """The service's worker restarts counter in its exposition."""
    return int(sum(s.value for fam in text_string_to_metric_families(metrics_text) for s in fam.samples
                   if s.name == RESTARTS))


def read_sample(c: httpx.Client, svc: PracticeService, minute: int, requests: int) -> Sample:
    """The worker's VM and RSS as /v1/stepwatch/info reports them (from /proc when the worker, busy on a long job,
    does not answer in time), the HTTP process's RSS, the restarts counter."""
    worker: dict[str, Any] = {}
    restarts = None
    try:
        worker = c.get("/v1/stepwatch/info").json().get("worker") or {}
        restarts = restarts_in(c.get("/metrics").text)
    except (httpx.HTTPError, ValueError):
        pass
    pid = worker.get("pid")
    vm = worker["vm_bytes"] / MB if worker.get("vm_bytes") else proc_status_mb(pid, "VmSize")
    rss = worker["rss_bytes"] / MB if worker.get("rss_bytes") else proc_status_mb(pid, "VmRSS")
    return Sample(minute, requests, _round(vm), _round(rss), _round(proc_status_mb(svc.pid, "VmRSS")), restarts,
                  pid)


def _round(mb: float | None) -> float | None:
    return None if mb is None else round(mb, 1)


# ----- the verdict ------------------------------------------------------------------------------------------
def grew(start: float | None, end: float | None, tolerance: float = TOLERANCE) -> bool:
    """End more than ``tolerance`` above start (or either unknown: a level that cannot be read is no pass)."""
    return start is None or end is None or end > start * (1 + tolerance)


def verdict(start: Sample, end: Sample, failed: int, restarts: int | None,
            tolerance: float = TOLERANCE) -> list[str]:
    """Why the soak fails the bar; empty: it passes."""
    reasons = []
    if failed:
        reasons.append(f"{failed} request(s) failed within the limits")
    for what, a, b in (("worker VM", start.worker_vm_mb, end.worker_vm_mb),
                       ("HTTP RSS", start.http_rss_mb, end.http_rss_mb)):
        if grew(a, b, tolerance):
            reasons.append(f"{what} {_mb(b)} at the end vs {_mb(a)} after the first minute "
                           f"(more than {tolerance:.0%} above)")
    if restarts is None:
        reasons.append("the worker restarts counter could not be read")
    elif restarts:
        reasons.append(f"the worker restarted {restarts} time(s)")
    return reasons


def _mb(v: float | None) -> str:
    return "unknown" if v is None else f"{v:.0f} MB"


def worker_restarts(samples: list[Sample]) -> int | None:
    """Restarts by the counter, or by the worker's pid changing (a restart the counter missed is one too)."""
    counted = samples[-1].restarts
    pids = {s.worker_pid for s in samples if s.worker_pid is not None}
    if counted is None:
        return None
    return max(counted, len(pids) - 1)


def result(minutes: int, tally: Tally, samples: list[Sample]) -> dict[str, Any]:
    """The JSON of a soak: the bar's figures, per-kind counts, and the verdict."""
    start, end = samples[0], samples[-1]
    with tally.lock:
        failures, requests, outcomes = dict(tally.failures), dict(tally.requests), dict(tally.outcomes)
        refused, examples, errors = dict(tally.refused), list(tally.examples), list(tally.client_errors)
    failed = sum(failures.values())
    restarts = worker_restarts(samples)
    reasons = verdict(start, end, failed, restarts)
    return {"minutes": minutes, "requests": sum(requests.values()), "failed_within_limits": failed,
            "worker_vm_start_mb": start.worker_vm_mb, "worker_vm_end_mb": end.worker_vm_mb,
            "http_rss_start_mb": start.http_rss_mb, "http_rss_end_mb": end.http_rss_mb, "restarts": restarts,
            "worker_rss_start_mb": start.worker_rss_mb, "worker_rss_end_mb": end.worker_rss_mb,
            "requests_by_kind": requests, "outcomes": outcomes, "failures": failures, "failure_examples": examples,
            "refused": refused, "client_errors": errors, "passed": not reasons, "reasons": reasons}


# ----- the run ----------------------------------------------------------------------------------------------
def progress_line(s: Sample, minutes: int) -> str:
    return (f"soak: minute {s.minute} of {minutes}: {s.requests} requests, worker VM {_mb(s.worker_vm_mb)}, "
            f"HTTP RSS {_mb(s.http_rss_mb)}")


def soak(minutes: int, workdir: Path, out: TextIO = sys.stderr) -> dict[str, Any]:
    """Start the service, run the clients for ``minutes``, sampling once a minute; the result once they drained."""
    print(f"soak: starting stepwatch serve (log: {workdir / 'service.log'})...", file=out, flush=True)
    with practice_service(workdir) as svc, httpclient.client(base_url=svc.url, timeout=60) as probe:
        tally, stop = Tally(), threading.Event()
        print(f"soak: ready on {svc.url}; {minutes} minute(s) of traffic", file=out, flush=True)
        threads = start_clients(svc.url, tally, stop)
        t0, samples = time.monotonic(), []
        try:
            for k in range(1, minutes + 1):
                time.sleep(max(0.0, t0 + 60 * k - time.monotonic()))
                samples.append(read_sample(probe, svc, k, tally.total_requests()))
                print(progress_line(samples[-1], minutes), file=out, flush=True)
        finally:
            stop.set()
            for t in threads:
                t.join(DRAIN_TIMEOUT_S + 60)
        samples.append(read_sample(probe, svc, minutes, tally.total_requests()))
        if not svc.child.alive():
            tally.fail("service_exited", f"exit code {svc.child.proc.returncode}")
    return result(minutes, tally, samples)


def summary(res: dict[str, Any]) -> str:
    """The readable form of a result."""
    lines = [f"soak: {res['minutes']} minute(s), {res['requests']} requests {res['requests_by_kind']}",
             f"  outcomes: {res['outcomes']}",
             f"  failed within limits: {res['failed_within_limits']} {res['failures'] or ''}".rstrip(),
             *(f"    {e}" for e in res["failure_examples"]),
             f"  refused (not failures): {res['refused'] or 'none'}",
             f"  worker VM: {_mb(res['worker_vm_start_mb'])} after the first minute -> "
             f"{_mb(res['worker_vm_end_mb'])} at the end",
             f"  HTTP RSS:  {_mb(res['http_rss_start_mb'])} after the first minute -> "
             f"{_mb(res['http_rss_end_mb'])} at the end",
             f"  worker restarts: {res['restarts']}",
             *(f"  client error (this tool's, not the service's): {e}" for e in res["client_errors"]),
             "PASS" if res["passed"] else "FAIL: " + "; ".join(res["reasons"])]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=int, default=DEFAULT_MINUTES,
                   help="minutes of traffic after the service is ready (default: %(default)s); the *_start_mb "
                        "levels are read after the first minute, the *_end_mb ones once the clients drained")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (minutes, requests, failed_within_limits, worker_vm_start_mb, "
                        "worker_vm_end_mb, http_rss_start_mb, http_rss_end_mb, restarts, ...) instead of the "
                        "summary; *_start_mb is the level after the first minute")
    p.add_argument("--ranks", type=int, choices=(1, 2), default=1,
                   help="1 (default): the mixed traffic above on one worker; 2: a two-rank service (FirstBlockCache "
                        "on) under steady images, for the follower-rank and collective failures only minutes show; "
                        "its bar: every request 200, no restart, no abort line in the log, the crowded rank charged")
    p.add_argument("--hogs", type=int, default=0,
                   help="with --ranks 2: CPU-bound busy loops, pinned round-robin over rank 1's CPUs first, then "
                        "the others (default: %(default)s)")
    p.add_argument("--malloc-check", action="store_true",
                   help="with --ranks 2: glibc's checking allocator in every process of the service "
                        "(libc_malloc_debug, glibc.malloc.check=3), core files allowed in the work directory, "
                        "faulthandler on")


def run(args: argparse.Namespace) -> int:
    if args.minutes < 1:
        raise SystemExit("bench soak: --minutes must be >= 1")
    if args.hogs < 0:
        raise SystemExit("bench soak: --hogs must be >= 0")
    if args.ranks == 1 and (args.hogs or args.malloc_check):
        raise SystemExit("bench soak: --hogs and --malloc-check go with --ranks 2")
    from stepwatch.bench import soak_ranks  # it builds on this module

    workdir = Path(tempfile.mkdtemp(prefix="stepwatch-soak-"))
    try:
        if args.ranks == 2:
            res = soak_ranks.soak_ranks(args.minutes, args.hogs, args.malloc_check, workdir, sys.stderr)
        else:
            res = soak(args.minutes, workdir)
    except RuntimeError as e:
        print(f"bench soak: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(res))
        print("PASS" if res["passed"] else "FAIL: " + "; ".join(res["reasons"]), file=sys.stderr)
    else:
        print(soak_ranks.summary(res) if args.ranks == 2 else summary(res))
    return 0 if res["passed"] else 1
