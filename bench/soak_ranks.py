"""``stepwatch bench soak --ranks 2``: the two-rank service under steady traffic beside CPU hogs.

An operator's report started it: two ranks, FirstBlockCache on, CPU-bound processes beside a rank, steady
traffic, and the service hung after ~100 s.  A rarer failure is native: a follower rank aborting on a glibc
heap check ("malloc(): unaligned tcache chunk detected").  Neither shows in a short test, so this runs by name
for as long as asked, with the hogs pinned round-robin over rank 1's CPUs first (the crowded rank), then the
rest.  ``--malloc-check`` loads glibc's debugging allocator into every process of the service
(``libc_malloc_debug.so.0`` with ``glibc.malloc.check=3``: a corrupted heap aborts at the first bad free,
with the message naming it) and allows core files in the work directory; Python's faulthandler prints each
thread's stack on an abort.

The bar (PASS, exit 0): every request answered 200, no worker restart, no abort line in the service's log,
and, with hogs, the rank timing charges the crowded rank (rank 1's busy seconds more than 1.1x rank 0's:
the rank-skew alert's 10% line).
"""

from __future__ import annotations

import os
import re
import resource
import secrets
import threading
import time
from pathlib import Path
from typing import Any, TextIO

import httpx
from prometheus_client.parser import text_string_to_metric_families

from stepwatch import httpclient
from stepwatch.bench.soak import PracticeService, Sample, Tally, practice_service, read_sample, restarts_in
from stepwatch.fault_injection.neighbours import start_neighbours

CROWDED_RANK = 1
CHARGED_RATIO = 1.1  # the rank-skew alert's line: the crowded rank's busy time this much above rank 0's
SIZES = ("256x256", "512x512")
PROMPTS = ("a red fox in snow", "city at night", "a bowl of fruit", "mountain lake", "portrait of a cat")
MALLOC_DEBUG = "libc_malloc_debug.so.0"
# What a native abort leaves in the log: glibc's heap checks, C++'s terminate, CPython's fatal error.
ABORT_LINE = re.compile(r"malloc\(\)|free\(\)|double free|corrupted (size|double-linked)|tcache|"
                        r"terminate called|Fatal Python error|killed by SIGABRT|killed by SIGSEGV")

RANKS_CONFIG: dict[str, Any] = {
    "ranks": 2, "compile": {"enabled": False}, "warmup": list(SIZES), "default_steps": 8,
    "cache": {"kind": "first_block_cache", "threshold": 0.7},
    "pools": {"small": {"sizes": list(SIZES), "slo_seconds": 30}},
    "request_timeout_seconds": 120,
}


def hog_cpus(crowded: list[int], every: list[int], hogs: int) -> list[int]:
    """The CPU each hog is pinned to: round-robin over the crowded rank's CPUs, then over the others."""
    order = list(crowded) + [c for c in every if c not in crowded]
    return [order[i % len(order)] for i in range(hogs)] if order else []


def malloc_check_env() -> dict[str, str]:
    """The environment that loads glibc's checking allocator into the service and its ranks."""
    return {"LD_PRELOAD": MALLOC_DEBUG, "GLIBC_TUNABLES": "glibc.malloc.check=3", "PYTHONFAULTHANDLER": "1"}


def allow_core_files() -> None:
    """Core files up to the hard limit, for this process and the children it starts (they inherit it)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))


def abort_lines(log_text: str) -> list[str]:
    """The log lines a native abort leaves (glibc, C++ terminate, CPython fatal errors, a SIGABRT exit)."""
    return [line.strip() for line in log_text.splitlines() if ABORT_LINE.search(line)]


def rank_busy(metrics_text: str) -> dict[str, float]:
    """``stepwatch_rank_busy_seconds_total`` per rank."""
    return {s.labels["rank"]: s.value for fam in text_string_to_metric_families(metrics_text)
            for s in fam.samples if s.name == "stepwatch_rank_busy_seconds_total"}


def image_client(url: str, tally: Tally, stop: threading.Event) -> None:
    """One image at a time, the two sizes in turn; anything but a 200 is a failure here."""
    with httpclient.client(base_url=url, timeout=150) as c:
        i = 0
        while not stop.is_set():
            body = {"prompt": PROMPTS[i % len(PROMPTS)], "size": SIZES[i % 2], "seed": i, "steps": 8}
            tally.request("image")
            try:
                r = c.post("/v1/images/generations", json=body)
            except httpx.HTTPError as e:
                tally.fail("image_transport", f"{body['size']} seed {i}: {type(e).__name__}: {e}")
            else:
                if r.status_code == 200:
                    tally.outcome("image", "ok")
                else:
                    tally.fail(f"image_{r.status_code}", f"{body['size']} seed {i}: {r.text[:200]}")
            i += 1


def verdict(res: dict[str, Any]) -> list[str]:
    """Why the two-rank soak fails the bar; empty: it passes."""
    reasons = []
    if res["failed_within_limits"]:
        reasons.append(f"{res['failed_within_limits']} request(s) not answered 200")
    if res["restarts"] is None or res["restarts"]:
        reasons.append(f"worker restarts: {res['restarts']}")
    if res["aborts"]:
        reasons.append(f"{len(res['aborts'])} abort line(s) in the service's log, first: {res['aborts'][0]}")
    if res["core_files"]:
        reasons.append(f"core files: {', '.join(res['core_files'])}")
    busy = res["rank_busy_seconds"]
    if res["hogs"] and not busy.get("1", 0.0) > CHARGED_RATIO * busy.get("0", float("inf")):
        reasons.append(f"the crowded rank is not charged: busy seconds {busy}")
    return reasons


def _ranks_of(c: httpx.Client) -> list[dict[str, Any]]:
    ranks = list(c.get("/v1/stepwatch/info").json()["worker"]["ranks"])
    if [r["rank"] for r in ranks] != [0, 1]:
        raise RuntimeError(f"expected ranks 0 and 1, the service reports {ranks}")
    return ranks


def _traffic(svc: PracticeService, probe: httpx.Client, minutes: int, out: TextIO) -> tuple[Tally, list[Sample]]:
    tally, stop = Tally(), threading.Event()
    thread = threading.Thread(target=image_client, args=(svc.url, tally, stop), name="soak-ranks-images", daemon=True)
    thread.start()
    t0, samples = time.monotonic(), []
    try:
        for k in range(1, minutes + 1):
            time.sleep(max(0.0, t0 + 60 * k - time.monotonic()))
            samples.append(read_sample(probe, svc, k, tally.total_requests()))
            aborts = len(abort_lines(svc.child.tail(1 << 20)))
            print(f"soak --ranks 2: minute {k} of {minutes}: {samples[-1].requests} requests, "
                  f"{sum(tally.failures.values())} failed, {aborts} abort line(s)", file=out, flush=True)
    finally:
        stop.set()
        thread.join(180)
    samples.append(read_sample(probe, svc, minutes, tally.total_requests()))
    return tally, samples


def soak_ranks(minutes: int, hogs: int, malloc_check: bool, workdir: Path, out: TextIO) -> dict[str, Any]:
    """Start the two-rank service, pin ``hogs`` busy loops, run the traffic; the result once it drained."""
    config = {**RANKS_CONFIG, "admin_token": secrets.token_hex(16)}
    if malloc_check:
        allow_core_files()
    env = malloc_check_env() if malloc_check else {}
    print(f"soak --ranks 2: starting stepwatch serve (log: {workdir / 'service.log'})...", file=out, flush=True)
    with practice_service(workdir, config, env=env, cwd=workdir) as svc, \
            httpclient.client(base_url=svc.url, timeout=60) as probe:
        ranks = _ranks_of(probe)
        cpus = hog_cpus(ranks[CROWDED_RANK]["cpus"], sorted(os.sched_getaffinity(0)), hogs)
        print(f"soak --ranks 2: ranks {[(r['rank'], r['cpus']) for r in ranks]}; hogs on CPUs {cpus}",
              file=out, flush=True)
        procs = [p for cpu in cpus for p in start_neighbours([cpu], 1)]
        try:
            tally, samples = _traffic(svc, probe, minutes, out)
            busy = rank_busy(probe.get("/metrics").text)
            restarts: int | None = restarts_in(probe.get("/metrics").text)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        log_text = svc.child.tail(1 << 24)
    res = {"minutes": minutes, "ranks": 2, "hogs": hogs, "hog_cpus": cpus, "malloc_check": malloc_check,
           "requests": tally.total_requests(), "failed_within_limits": sum(tally.failures.values()),
           "failures": dict(tally.failures), "failure_examples": list(tally.examples),
           "restarts": max(restarts or 0, len({s.worker_pid for s in samples if s.worker_pid}) - 1),
           "aborts": abort_lines(log_text), "core_files": sorted(p.name for p in workdir.glob("core*")),
           "rank_busy_seconds": {r: round(v, 1) for r, v in busy.items()},
           "worker_vm_start_mb": samples[0].worker_vm_mb, "worker_vm_end_mb": samples[-1].worker_vm_mb}
    res["reasons"] = verdict(res)
    res["passed"] = not res["reasons"]
    return res


def summary(res: dict[str, Any]) -> str:
    lines = [f"soak --ranks 2: {res['minutes']} minute(s), {res['hogs']} hog(s) on CPUs {res['hog_cpus']}, "
             f"malloc check {'on' if res['malloc_check'] else 'off'}",
             f"  requests: {res['requests']}, not answered 200: {res['failed_within_limits']} {res['failures'] or ''}",
             *(f"    {e}" for e in res["failure_examples"]),
             f"  worker restarts: {res['restarts']}; abort lines: {len(res['aborts'])}; "
             f"core files: {len(res['core_files'])}",
             *(f"    {line}" for line in res["aborts"][:10]),
             f"  rank busy seconds: {res['rank_busy_seconds']}",
             "PASS" if res["passed"] else "FAIL: " + "; ".join(res["reasons"])]
    return "\n".join(lines)
