"""The soak's bar on hand-made samples (no service starts here) and its command line."""

from __future__ import annotations

import copy
import json
import threading

import httpx
import pytest

from stepwatch import httpclient
from stepwatch.bench import soak
from stepwatch.bench.soak import Sample, Tally, grew, result, verdict, worker_restarts
from stepwatch.cli import main
from stepwatch.sse import sse


def sample(minute: int = 1, vm: float | None = 2000.0, http: float | None = 300.0, restarts: int | None = 0,
           pid: int | None = 41) -> Sample:
    return Sample(minute, 10 * minute, vm, 500.0, http, restarts, pid)


def test_levels_within_ten_percent_of_the_first_minute_pass() -> None:
    assert verdict(sample(), sample(10, vm=2199.0, http=329.0), failed=0, restarts=0) == []
    assert verdict(sample(), sample(10, vm=1500.0, http=200.0), failed=0, restarts=0) == []  # a fall is no leak


@pytest.mark.parametrize(("end", "named"), [
    (sample(10, vm=2201.0), "worker VM"),
    (sample(10, http=331.0), "HTTP RSS"),
    (sample(10, vm=None), "worker VM"),  # a level that cannot be read is no pass
])
def test_growth_past_ten_percent_fails(end: Sample, named: str) -> None:
    reasons = verdict(sample(), end, failed=0, restarts=0)
    assert len(reasons) == 1 and reasons[0].startswith(named), reasons


def test_failures_and_restarts_fail() -> None:
    assert verdict(sample(), sample(10), failed=2, restarts=0) == ["2 request(s) failed within the limits"]
    assert verdict(sample(), sample(10), failed=0, restarts=1) == ["the worker restarted 1 time(s)"]
    assert verdict(sample(), sample(10), failed=0, restarts=None) == [
        "the worker restarts counter could not be read"]


def test_grew_is_relative_to_the_start() -> None:
    assert not grew(100.0, 110.0) and grew(100.0, 110.5) and grew(None, 1.0)
    assert not grew(100.0, 120.0, tolerance=0.2)


def test_a_new_worker_pid_counts_as_a_restart_the_counter_missed() -> None:
    assert worker_restarts([sample(1), sample(2), sample(3)]) == 0
    assert worker_restarts([sample(1), sample(2, pid=77), sample(3, pid=77)]) == 1
    assert worker_restarts([sample(1), sample(2, restarts=2)]) == 2
    assert worker_restarts([sample(1), sample(2, restarts=None)]) is None


def test_admission_refusals_are_not_failures() -> None:
    tally = Tally()
    for status in (429, 503, 400):
        tally.answered("image", httpx.Response(status, text="busy"))
    assert not tally.failures and tally.refused == {"image 429": 1, "image 503": 1, "image 400": 1}
    tally.answered("image", httpx.Response(507, text="out of memory"))
    tally.answered("image", httpx.Response(500, text="boom"))
    assert tally.failures == {"image_507": 1, "image_500": 1}


def test_only_jobs_within_the_advertised_limits_are_judged() -> None:
    assert soak.video_within_limits("256x256", soak.MAX_FRAMES)
    assert not soak.video_within_limits("256x256", soak.MAX_FRAMES + 4)
    assert not soak.video_within_limits("512x512", 9)
    assert all(soak.video_within_limits(size, frames) for size, frames in soak.VIDEO_PLAN)


def test_the_result_carries_the_bar_and_the_counts_per_kind() -> None:
    tally = Tally()
    for kind in ("image", "image", "video", "stream"):
        tally.request(kind)
    tally.fail("video_out_of_memory", "256x256 x 121 frames: over the budget")
    res = result(2, tally, [sample(1), sample(2, vm=2100.0), sample(2, vm=2100.0, http=310.0)])
    assert {k: res[k] for k in ("minutes", "requests", "failed_within_limits", "worker_vm_start_mb",
                                "worker_vm_end_mb", "http_rss_start_mb", "http_rss_end_mb", "restarts")} == {
        "minutes": 2, "requests": 4, "failed_within_limits": 1, "worker_vm_start_mb": 2000.0,
        "worker_vm_end_mb": 2100.0, "http_rss_start_mb": 300.0, "http_rss_end_mb": 310.0, "restarts": 0}
    assert res["failures"] == {"video_out_of_memory": 1} and not res["passed"]
    json.dumps(res)  # what --json prints
    assert soak.summary(res).splitlines()[-1] == "FAIL: 1 request(s) failed within the limits"


def test_restarts_are_read_from_the_exposition() -> None:
    text = ("# HELP stepwatch_worker_restarts_total Worker processes restarted after dying.\n"
            "# TYPE stepwatch_worker_restarts_total counter\nstepwatch_worker_restarts_total 3.0\n")
    assert soak.restarts_in(text) == 3


def test_help_names_minutes_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "soak", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert "--minutes" in out and "--json" in out and "after the first minute" in out


def test_the_config_serves_every_size_the_clients_send() -> None:
    from stepwatch.service.config import ServiceConfig, parse

    cfg = parse(copy.deepcopy(soak.SOAK_CONFIG))
    assert cfg.video_active and cfg.stream_active and not cfg.compile.enabled
    assert sorted(s for p in cfg.pools for s in p.sizes) == sorted(soak.IMAGE_SIZES)
    assert cfg.video.sizes == soak.VIDEO_SIZES and cfg.video.max_frames == soak.MAX_FRAMES
    assert {p.size for p in soak.STREAM_PLANS} <= set(cfg.stream.sizes)
    assert cfg.memory_budget_mb == ServiceConfig().memory_budget_mb


def _video_service(final: dict[str, object]) -> tuple[httpx.MockTransport, list[str]]:
    """A job API that runs a job for two polls, then ends it with ``final``; the methods it saw."""
    seen: list[str] = []
    polls = iter([{"status": "in_progress", "step": 1}, {"status": "in_progress", "step": 2}])

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.method)
        base = {"id": "j1", "steps": 4, "error": None}
        if request.method == "POST":
            return httpx.Response(202, json={**base, "status": "queued", "step": 0})
        if request.method == "DELETE":
            return httpx.Response(200, json={**base, "status": "in_progress", "cancel_requested": True})
        return httpx.Response(200, json={**base, **next(polls, final)})

    return httpx.MockTransport(handle), seen


@pytest.mark.parametrize(("final", "cancel", "failures"), [
    ({"status": "completed", "step": 4}, False, {}),
    ({"status": "cancelled", "step": 2}, True, {}),
    ({"status": "failed", "step": 1, "error": {"code": "out_of_memory", "message": "over the budget"}}, False,
     {"video_out_of_memory": 1}),
])
def test_a_video_job_is_polled_to_its_end_and_judged(final: dict[str, object], cancel: bool,
                                                     failures: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(soak, "POLL_S", 0.0)
    transport, seen = _video_service(final)
    tally = Tally()
    with httpx.Client(transport=transport, base_url="http://svc") as c:
        soak.video_job(c, tally, threading.Event(), "256x256", 121, cancel=cancel, seed=0)
    assert tally.failures == failures and tally.outcomes == {f"video {final['status']}": 1}
    assert ("DELETE" in seen) == cancel


def _stream_service(end: str) -> httpx.MockTransport:
    body = (sse("session", {"id": "s1"}) + sse("chunk", {"index": 0, "frames": []})
            + sse("end", {"outcome": end, "reason": "x", "message": "m"}))
    return httpx.MockTransport(lambda request: httpx.Response(200, content=body,
                                                              headers={"content-type": "text/event-stream"}))


@pytest.mark.parametrize(("plan", "end", "outcome", "failures"), [
    (soak.StreamPlan("read", "64x64"), "done", "stream done", {}),
    (soak.StreamPlan("read", "64x64"), "failed", "stream failed", {"stream_failed": 1}),
    (soak.StreamPlan("drop", "64x64"), "failed", "stream dropped", {}),
    (soak.StreamPlan("stall", "64x64", 0.01), "done", "stream left unread", {}),
])
def test_a_stream_session_is_judged_only_when_read_to_its_end(plan: soak.StreamPlan, end: str, outcome: str,
                                                              failures: dict[str, int]) -> None:
    tally = Tally()
    with httpclient.use_transport(_stream_service(end)):
        soak.stream_session("http://svc", tally, threading.Event(), plan, seed=0)
    assert tally.outcomes == {outcome: 1} and tally.failures == failures


# ----- the two-rank soak ------------------------------------------------------------------------------------
def test_hogs_crowd_rank_one_first_then_the_rest() -> None:
    from stepwatch.bench.soak_ranks import hog_cpus

    assert hog_cpus([1], [0, 1], 3) == [1, 0, 1]
    assert hog_cpus([2, 3], [0, 1, 2, 3], 5) == [2, 3, 0, 1, 2]
    assert hog_cpus([1], [0, 1], 0) == []


def test_abort_lines_are_found_and_ordinary_lines_are_not() -> None:
    from stepwatch.bench.soak_ranks import abort_lines

    log = ("INFO ranks: 0 pid 10 cpus [0], 1 pid 11 cpus [1]\n"
           "malloc(): unaligned tcache chunk detected\n"
           "WARNING worker killed by SIGABRT; restarting\n"
           "INFO request done in 0.4 s (free memory 1.2 GB)\n")
    assert abort_lines(log) == ["malloc(): unaligned tcache chunk detected",
                                "WARNING worker killed by SIGABRT; restarting"]


def _ranks_result(**over: object) -> dict[str, object]:
    res: dict[str, object] = {"failed_within_limits": 0, "restarts": 0, "aborts": [], "core_files": [], "hogs": 3,
                              "rank_busy_seconds": {"0": 60.0, "1": 90.0}}
    return {**res, **over}


@pytest.mark.parametrize(("over", "named"), [
    ({}, None),
    ({"failed_within_limits": 1}, "not answered 200"),
    ({"restarts": 1}, "worker restarts"),
    ({"aborts": ["free(): invalid pointer"]}, "abort line"),
    ({"core_files": ["core"]}, "core files"),
    ({"rank_busy_seconds": {"0": 60.0, "1": 65.0}}, "not charged"),
    ({"rank_busy_seconds": {"0": 60.0, "1": 65.0}, "hogs": 0}, None),  # no hog: nothing to charge
])
def test_two_rank_verdict_names_what_broke(over: dict[str, object], named: str | None) -> None:
    from stepwatch.bench.soak_ranks import verdict as ranks_verdict

    reasons = ranks_verdict(_ranks_result(**over))
    assert (reasons == []) if named is None else (len(reasons) == 1 and named in reasons[0]), reasons


def test_a_heap_abort_is_found_and_the_checking_allocator_is_loaded() -> None:
    """A process that frees a block twice under the environment --malloc-check gives the service: glibc aborts
    it with a line abort_lines finds, and its memory map holds the checking allocator."""
    import os
    import signal
    import subprocess
    import sys

    from stepwatch.bench.soak_ranks import MALLOC_DEBUG, abort_lines, malloc_check_env

    code = ("import ctypes, sys\nprint(any('malloc_debug' in line for line in open('/proc/self/maps')), flush=True)\n"
            "libc = ctypes.CDLL(None)\nlibc.malloc.restype = ctypes.c_void_p\nlibc.free.argtypes = [ctypes.c_void_p]\n"
            "p = libc.malloc(64)\nlibc.free(p)\nlibc.free(p)\nprint('survived')")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **malloc_check_env()},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGABRT, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout.split() == ["True"], (MALLOC_DEBUG, proc.stdout)
    assert abort_lines(proc.stderr), proc.stderr


def test_hogs_and_malloc_check_need_two_ranks() -> None:
    with pytest.raises(SystemExit, match="--ranks 2"):
        main(["bench", "soak", "--hogs", "2"])
