"""Video jobs over real HTTP against the real service (one start): create, poll, download, cancel, an OOM that
fails its job and not the worker, images served in between, and job counters that add up on /metrics."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.promtext import total, value
from tests.servicefixture import ServiceProc
from tests.test_exposition_lint import assert_lint_clean

# Small and fast: no compile (the video pipeline is served eager anyway), default video jobs of 128x128 x 9 frames.
OVERRIDES = {"compile": {"enabled": False}, "warmup": ["256x256"]}
LONG = {"size": "256x256", "frames": 121, "steps": 1}  # untiled + unchunked: ~1.2 GiB, past the worker's budget


def wait(svc: ServiceProc, job_id: str, until: tuple[str, ...], timeout: float = 240) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status, job, _ = svc.get(f"/v1/videos/{job_id}")
        assert status == 200, job
        if job["status"] in until or time.monotonic() > deadline:
            return dict(job)
        time.sleep(0.05)


def create(svc: ServiceProc, **body: Any) -> dict[str, Any]:
    body.setdefault("prompt", "a lighthouse at dusk, waves")
    status, job, headers = svc.request("POST", "/v1/videos", body)
    assert status == 202, job
    assert headers["Location"] == f"/v1/videos/{job['id']}"
    return dict(job)


def job_counters(svc: ServiceProc) -> dict[str, float]:
    m = svc.metrics()
    c = {o: value(m, "stepwatch_video_jobs_finished_total", pool="video", outcome=o)
         for o in ("succeeded", "failed", "cancelled")}
    c["created"] = value(m, "stepwatch_video_jobs_created_total", pool="video")
    c["in_flight"] = total(m, "stepwatch_video_jobs_depth", pool="video")
    return c


@pytest.mark.heavy
def test_video_jobs_over_http(tmp_path: Path) -> None:
    import io

    import av

    svc = ServiceProc(tmp_path / "svc", OVERRIDES)
    try:
        worker_pid = svc.get("/v1/stepwatch/info")[1]["worker"]["pid"]
        # 1. Create, poll (step k of n), download: an H.264 MP4 of 9 frames at 128x128.
        job = create(svc, seed=3)
        assert job["status"] in ("queued", "in_progress") and job["steps"] == 4 and job["frames"] == 9
        done = wait(svc, job["id"], ("completed", "failed"))
        assert done["status"] == "completed" and done["progress"] == 100 and done["step"] == 4, done
        assert done["stepwatch"]["shape"] == "128x128x9_4s" and done["stepwatch"]["stages"]["vae_decode"] > 0
        status, _, headers = svc.request("GET", f"/v1/videos/{job['id']}/content")
        raw = svc.request_raw(f"/v1/videos/{job['id']}/content")
        assert status == 200 and headers["Content-Type"] == "video/mp4"
        with av.open(io.BytesIO(raw)) as f:
            frames = [fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]
        assert len(frames) == 9 and frames[0].shape == (128, 128, 3)
        # 2. Bad input: a clear 400 naming the field.
        for body, param in (({"frames": 8}, "frames"), ({"frames": 125}, "frames"), ({"size": "512x512"}, "size")):
            status, err, _ = svc.request("POST", "/v1/videos", {"prompt": "x", **body})
            assert status == 400 and err["error"]["param"] == param, err
        # 3. Cancel: a running job stops after its step; one queued behind it never runs.
        slow = create(svc, steps=40)  # many steps: seconds of work, the cancel lands between two of them
        queued = create(svc)
        running = wait(svc, slow["id"], ("in_progress",), timeout=120)
        assert running["status"] == "in_progress"
        assert svc.request("DELETE", f"/v1/videos/{queued['id']}")[1]["status"] == "cancelled"
        assert svc.request("DELETE", f"/v1/videos/{slow['id']}")[0] == 200
        stopped = wait(svc, slow["id"], ("cancelled", "completed", "failed"))
        assert stopped["status"] == "cancelled" and stopped["step"] < 40, stopped
        assert svc.get(f"/v1/videos/{slow['id']}/content")[0] == 409
        # Images are served between jobs.
        assert svc.generate(size="256x256", steps=4)[0] == 200
        # 4. The untiled long clip fails its job out of memory, with the stage and the fix; the worker serves on.
        assert svc.knobs(vae_tiling=False, video_decode_chunk_frames=0)[0] == 200
        failed = wait(svc, create(svc, **LONG)["id"], ("completed", "failed"))
        assert failed["status"] == "failed" and failed["error"]["code"] == "out_of_memory", failed
        assert "vae_decode" in failed["error"]["message"] and "tiling" in failed["error"]["message"]
        assert svc.knobs(vae_tiling=True, video_decode_chunk_frames=4)[0] == 200
        again = wait(svc, create(svc)["id"], ("completed", "failed"))
        assert again["status"] == "completed"
        assert svc.get("/v1/stepwatch/info")[1]["worker"]["pid"] == worker_pid  # no restart
        # 5. Counters add up: created = succeeded + failed + cancelled + in flight.
        c = job_counters(svc)
        assert c == {"created": 5, "succeeded": 2, "failed": 1, "cancelled": 2, "in_flight": 0}, c
        m = svc.metrics()
        assert value(m, "stepwatch_oom_total", shape="other", stage="vae_decode") == 1
        assert total(m, "stepwatch_pipeline_requests_total", outcome="cancelled") == 1
        assert total(m, "stepwatch_pipeline_requests_total", outcome="error") == 0
        assert value(m, "stepwatch_video_frames_total", pool="video") == 18
        assert_lint_clean(svc.get("/metrics")[1], "the service with video jobs")
        _video_probes_score_frames(svc, tmp_path)
        _openai_client_drives_video_jobs(svc)
    finally:
        svc.close()


def _openai_client_drives_video_jobs(svc: ServiceProc) -> None:
    """OpenAI's own client, as its documentation uses it: a multipart create polled to completed, the MP4
    downloaded, the job in the list, typed errors for a bad size and an unknown id, delete."""
    import io

    import av
    import openai

    client = openai.OpenAI(base_url=svc.url + "/v1", api_key="unused", max_retries=0)
    job = client.videos.create_and_poll(prompt="a lighthouse at dusk", size="128x128",  # type: ignore[arg-type]
                                        seconds="0.5", poll_interval_ms=50)  # type: ignore[arg-type]
    assert job.status == "completed" and job.progress == 100 and job.model == "stepwatch-practice-wan", job
    assert job.seconds == "0.562" and job.size == "128x128"  # 0.5 s at 16 fps: the nearest 4k+1 is 9 frames
    with av.open(io.BytesIO(client.videos.download_content(job.id).read())) as f:
        assert sum(1 for _ in f.decode(video=0)) == 9
    page = client.videos.list(limit=1)
    assert page.data[0].id == job.id and page.has_more  # newest first; earlier jobs follow
    assert job.id in {v.id for v in client.videos.list(order="asc")}  # every page, through ``after``
    with pytest.raises(openai.BadRequestError) as bad:
        client.videos.create(prompt="a wave", size="720x1280")
    assert bad.value.code == "unknown_size" and "128x128" in bad.value.message
    with pytest.raises(openai.BadRequestError) as long:
        client.videos.create(prompt="a wave", seconds="12")
    assert long.value.code == "invalid_value" and "7.5" in long.value.message
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_nope")
    assert client.videos.delete(job.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(job.id)


def _video_probes_score_frames(svc: ServiceProc, tmp_path: Path) -> None:
    """The prober on the real service: a video probe set captured as jobs (the same seed reproduces the MP4:
    PSNR inf), then a cache on the few-step video model changes the frames: scored frame by frame, the worst
    frame's PSNR and SSIM fall, the SSIM gate the alert reads is the video gate, and the exporter counted the
    few-step hits."""
    from prometheus_client import CollectorRegistry

    from stepwatch.exporter.sidecar.capture import capture_baseline
    from stepwatch.exporter.sidecar.config import parse_probe_set
    from stepwatch.exporter.sidecar.prober import Prober
    from stepwatch.thresholds import load
    from tests.promtext import scrape

    probes = parse_probe_set({"name": "clips", "size": "128x128", "steps": 4, "frames": 9, "prompts": ["a wave"],
                              "seeds": [0]})
    capture_baseline(svc.url, probes, tmp_path / "base")
    reg = CollectorRegistry()
    prober = Prober(svc.url, registry=reg, baseline_dir=tmp_path / "base", probe_set=probes, interval_s=60.0)
    try:
        same = prober.run_once()
        assert same.status == "ok" and same.psnr["min"] == float("inf") and same.ssim["min"] == 1.0
        assert svc.knobs(video_cache="first_block_cache", video_cache_threshold=0.5)[0] == 200
        cached = prober.run_once()
    finally:
        svc.knobs(video_cache="none")
        prober.close()
    assert cached.status == "ok" and cached.scored[0].frames == 9 and len(cached.scored[0].frame_psnr) == 9
    assert cached.psnr["min"] < same.psnr["min"] and cached.ssim["min"] < 1.0
    d = scrape(reg)
    assert value(d, "stepwatch_quality_ssim_gate_ratio", probe_set="clips") == load().quality.ssim_gate["video"]
    assert value(d, "stepwatch_quality_ssim_ratio", probe_set="clips", instance_id=cached.scored[0].instance_id or "",
                 stat="min") == cached.ssim["min"]
    assert total(svc.metrics(), "stepwatch_cache_few_step_hits_total") >= 2


def _worker_vm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmSize")


@pytest.mark.heavy
def test_a_large_job_leaves_later_jobs_their_memory(tmp_path: Path) -> None:
    """A job that fails out of memory (the long clip untiled) and one at the advertised maximum leave the worker
    its address space: the next jobs within the limits succeed and the VM the budget caps comes back.  (With
    glibc's rising mmap threshold the freed 1-32 MiB blocks stayed in the heap: every later 41-frame job failed
    out of memory.)"""
    svc = ServiceProc(tmp_path / "svc", OVERRIDES)
    try:
        pid = svc.get("/v1/stepwatch/info")[1]["worker"]["pid"]
        clip = {"size": "256x256", "frames": 41, "steps": 2}
        assert wait(svc, create(svc, **clip)["id"], ("completed", "failed"))["status"] == "completed"
        level = _worker_vm_mb(pid)
        assert svc.knobs(vae_tiling=False, video_decode_chunk_frames=0)[0] == 200
        failed = wait(svc, create(svc, **LONG)["id"], ("completed", "failed"))
        assert failed["status"] == "failed" and failed["error"]["code"] == "out_of_memory", failed
        assert svc.knobs(vae_tiling=True, video_decode_chunk_frames=4)[0] == 200
        for body in ({**clip, "frames": 121}, clip, {**clip, "frames": 81}, clip):
            done = wait(svc, create(svc, **body)["id"], ("completed", "failed"))
            assert done["status"] == "completed", (body, done)
        assert _worker_vm_mb(pid) <= level * 1.1, (level, _worker_vm_mb(pid))
        assert svc.get("/v1/stepwatch/info")[1]["worker"]["pid"] == pid
    finally:
        svc.close()
