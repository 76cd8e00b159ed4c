"""Video jobs through the HTTP layer in-process (FastAPI's TestClient, a stand-in worker that runs steps):
create, poll, download, cancel (queued and running), failures, bad input, and counters that add up."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from stepwatch.service.app import create_app
from stepwatch.service.config import parse
from stepwatch.service.engine import Service
from tests.promtext import scrape, value

CFG = {"pools": {"small": {"sizes": ["256x256"], "slo_seconds": 10}}, "warmup": [],
       "video": {"sizes": ["128x128", "256x256"], "default_frames": 9, "max_frames": 33, "default_steps": 4}}


class Shared:
    value = 0


class StepWorker:
    """Stands in for the worker: a video job runs its steps on a thread (progress after each, the shared cancel
    number read after each, as the real worker does); ``hold`` keeps a job at its first step until set; a
    ``fail`` prompt answers an OOM."""

    def __init__(self, on_progress: Callable[[Any], None]) -> None:
        self.ready = threading.Event()
        self.ready.set()
        self.ready_info = None
        self.cancel = Shared()
        self.hold = threading.Event()
        self.hold.set()
        self.decoding = threading.Event()  # cleared: a job holds after its last step, as in a long VAE decode
        self.decoding.set()
        self.runs: list[dict[str, Any]] = []
        self._progress = on_progress

    def call(self, msg: dict[str, Any]) -> Future[dict[str, Any]]:
        fut: Future[dict[str, Any]] = Future()
        if msg["op"] != "generate":
            fut.set_result({"op": "info", "pid": 1, "rss_bytes": 2, "vm_bytes": 3, "budget_bytes": None})
            return fut
        self.runs.append(msg["request"])
        threading.Thread(target=self._run, args=(msg, fut), daemon=True).start()
        return fut

    def _run(self, msg: dict[str, Any], fut: Future[dict[str, Any]]) -> None:
        req = msg["request"]
        if req["frames"] <= 1:
            fut.set_result({"op": "result", "id": msg["id"], "seconds": 0.01, "images": [b"png"], "stages": {},
                            "shape": "256x256_4s", "steps": 4, "cache": None, "nonfinite": 0})
            return
        if req["prompt"] == "fail":
            fut.set_result({"op": "error", "id": msg["id"], "kind": "oom", "stage": "vae_decode",
                            "message": "out of memory in vae_decode; fix: enable VAE tiling"})
            return
        for step in range(1, req["steps"] + 1):
            self.hold.wait(10)
            if self.cancel.value == req["job"]:
                fut.set_result({"op": "error", "id": msg["id"], "kind": "cancelled", "message": "cancelled"})
                return
            self._progress({"op": "progress", "id": msg["id"], "step": step, "steps": req["steps"]})
            time.sleep(0.01)
        self.decoding.wait(10)
        fut.set_result({"op": "result", "id": msg["id"], "seconds": 0.2, "images": [b"mp4 bytes"],
                        "stages": {"denoise": 0.1, "vae_decode": 0.1}, "shape": "128x128x9_4s", "steps": 4,
                        "cache": None, "nonfinite": 0, "content_type": "video/mp4", "frames": req["frames"]})

    def alive(self) -> bool:
        return True

    def kill(self) -> None:
        pass

    def stop(self) -> None:
        pass


@pytest.fixture
def svc() -> Iterator[Service]:
    s = Service(parse(CFG), CollectorRegistry())
    s.worker = StepWorker(s._on_progress)  # type: ignore[assignment]
    s._dispatcher.start()
    yield s
    s._stop.set()


@pytest.fixture
def client(svc: Service) -> Iterator[TestClient]:
    with TestClient(create_app(svc), client=("127.0.0.1", 40000)) as c:
        yield c


def wait_status(client: TestClient, job_id: str, statuses: tuple[str, ...], timeout: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        body: dict[str, Any] = client.get(f"/v1/videos/{job_id}").json()
        if body["status"] in statuses or time.monotonic() > deadline:
            return body
        time.sleep(0.02)


def counters(svc: Service) -> dict[str, float]:
    data = scrape(svc.registry)
    out = {o: value(data, "stepwatch_video_jobs_finished_total", pool="video", outcome=o)
           for o in ("succeeded", "failed", "cancelled")}
    out["created"] = value(data, "stepwatch_video_jobs_created_total", pool="video")
    out["in_flight"] = sum(value(data, "stepwatch_video_jobs_depth", pool="video", state=s)
                           for s in ("queued", "running"))
    return out


def adds_up(c: dict[str, float]) -> bool:
    return c["created"] == c["succeeded"] + c["failed"] + c["cancelled"] + c["in_flight"]


def test_create_poll_download(client: TestClient, svc: Service) -> None:
    # Every job series exists at 0 before the first job (a series born at 1 is no increase to rate()).
    before = scrape(svc.registry)
    assert value(before, "stepwatch_video_job_duration_seconds_count", pool="video") == 0
    assert value(before, "stepwatch_video_jobs_finished_total", pool="video", outcome="failed") == 0
    r = client.post("/v1/videos", json={"prompt": "a boat at dawn", "seed": 7})
    assert r.status_code == 202
    job = r.json()
    assert job["object"] == "video" and job["status"] in ("queued", "in_progress") and job["steps"] == 4
    assert r.headers["location"] == f"/v1/videos/{job['id']}"
    assert job["size"] == "128x128" and job["frames"] == 9 and job["stepwatch"]["shape"] == "128x128x9_4s"
    done = wait_status(client, job["id"], ("completed",))
    assert done["status"] == "completed" and done["progress"] == 100 and done["step"] == 4
    assert done["stepwatch"]["seconds_per_frame"] == pytest.approx(0.2 / 9, rel=1e-3)
    content = client.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.content == b"mp4 bytes"
    assert content.headers["content-type"] == "video/mp4"
    c = counters(svc)
    assert c["created"] == 1 and c["succeeded"] == 1 and adds_up(c)
    data = scrape(svc.registry)
    assert value(data, "stepwatch_video_frames_total", pool="video") == 9
    assert value(data, "stepwatch_service_requests_total", pool="video", code="202") == 1
    assert value(data, "stepwatch_queue_slo_seconds", pool="video") == 60


def test_progress_is_step_k_of_n(client: TestClient, svc: Service) -> None:
    worker: StepWorker = svc.worker  # type: ignore[assignment]
    job = client.post("/v1/videos", json={"prompt": "slow", "steps": 6}).json()
    deadline = time.monotonic() + 5
    seen = set()
    while time.monotonic() < deadline:
        body = client.get(f"/v1/videos/{job['id']}").json()
        seen.add((body["status"], body["step"]))
        if body["status"] == "completed":
            break
        worker.hold.clear()
        time.sleep(0.05)
        worker.hold.set()
    assert ("completed", 6) in seen
    assert any(status == "in_progress" and 0 < step < 6 for status, step in seen)


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"prompt": "x", "frames": 8}, "frames", "invalid_frames"),
    ({"prompt": "x", "frames": 37}, "frames", "too_many_frames"),
    ({"prompt": "x", "frames": 1}, "frames", "invalid_frames"),
    ({"prompt": "x", "size": "512x512"}, "size", "unknown_size"),
    ({"prompt": "x", "steps": 0}, "steps", "invalid_value"),
    ({"prompt": "x", "fps": 8}, "fps", "unknown_parameter"),
    ({"frames": 9}, "prompt", "missing_required_parameter"),
    ({"prompt": "x", "seconds": "4"}, "seconds", "invalid_value"),  # 65 frames: past max_frames 33
    ({"prompt": "x", "seconds": "soon"}, "seconds", "invalid_value"),
    ({"prompt": "x", "seconds": "1", "frames": 9}, "seconds", "conflicting_fields"),
])
def test_bad_input_is_a_clear_400(client: TestClient, svc: Service, body: dict[str, Any], param: str,
                                  code: str) -> None:
    r = client.post("/v1/videos", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code and param in err["message"]
    assert counters(svc)["created"] == 0
    assert value(scrape(svc.registry), "stepwatch_service_requests_total", pool="video", code="400") == 1


def test_a_multipart_form_is_read_as_the_json_body_is(client: TestClient, svc: Service) -> None:
    """OpenAI's client sends a form: its text numbers are numbers, ``seconds`` the nearest 4k+1 frames at the
    fps, ``model`` is accepted; a file part, a non-number and a form without a boundary are clear 400s."""
    form = {"prompt": "a wave", "size": "128x128", "seconds": "1", "model": "sora-2", "steps": "2", "seed": "7"}
    r = client.post("/v1/videos", data=form, files={"unused": (None, "")})  # files: multipart, as OpenAI's
    assert r.status_code == 400 and r.json()["error"]["param"] == "unused"  # an unknown field, as in JSON
    r = client.post("/v1/videos", files={k: (None, v) for k, v in form.items()})
    assert r.status_code == 202, r.json()
    job = r.json()
    assert (job["frames"], job["steps"], job["seed"], job["seconds"]) == (17, 2, 7, "1.06")  # 16 fps
    assert job["model"] == "stepwatch-practice-wan" and job["prompt"] == "a wave"
    r = client.post("/v1/videos", files={"prompt": (None, "x"), "input_reference": ("ref.png", b"png", "image/png")})
    assert r.status_code == 400 and "file uploads" in r.json()["error"]["message"]
    r = client.post("/v1/videos", files={"prompt": (None, "x"), "steps": (None, "four")})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_type"
    r = client.post("/v1/videos", content=b"prompt=x", headers={"Content-Type": "multipart/form-data"})
    assert r.status_code == 400 and "boundary" in r.json()["error"]["message"]
    assert wait_status(client, job["id"], ("completed",))["status"] == "completed"


def test_jobs_are_listed_a_page_at_a_time(client: TestClient, svc: Service) -> None:
    ids = [client.post("/v1/videos", json={"prompt": f"clip {i}"}).json()["id"] for i in range(3)]
    page = client.get("/v1/videos", params={"limit": 2}).json()
    assert [j["id"] for j in page["data"]] == ids[::-1][:2] and page["has_more"] is True
    assert (page["first_id"], page["last_id"]) == (ids[2], ids[1])
    rest = client.get("/v1/videos", params={"limit": 2, "after": page["last_id"]}).json()
    assert [j["id"] for j in rest["data"]] == [ids[0]] and rest["has_more"] is False
    assert [j["id"] for j in client.get("/v1/videos", params={"order": "asc"}).json()["data"]] == ids
    for bad in ({"limit": 0}, {"limit": "ten"}, {"limit": 101}, {"order": "newest"}):
        r = client.get("/v1/videos", params=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad)), (bad, r.text)
    assert client.get("/v1/videos", params={"after": "video_nope"}).status_code == 404
    for i in ids:
        wait_status(client, i, ("completed",))


def test_unknown_job_and_content_before_done(client: TestClient, svc: Service) -> None:
    assert client.get("/v1/videos/video_nope").status_code == 404
    assert client.delete("/v1/videos/video_nope").status_code == 404
    worker: StepWorker = svc.worker  # type: ignore[assignment]
    worker.hold.clear()
    job = client.post("/v1/videos", json={"prompt": "held"}).json()
    r = client.get(f"/v1/videos/{job['id']}/content")
    assert r.status_code == 409 and r.json()["error"]["code"] in ("video_queued", "video_in_progress")
    worker.hold.set()
    assert wait_status(client, job["id"], ("completed",))["status"] == "completed"


def test_a_decoding_job_is_not_cancellable_and_says_so_at_once(client: TestClient, svc: Service) -> None:
    """Past its last step the worker no longer reads the cancel: DELETE answers 409 ``not_cancellable`` without
    waiting, and the job then succeeds as it would have."""
    worker: StepWorker = svc.worker  # type: ignore[assignment]
    worker.decoding.clear()
    job = client.post("/v1/videos", json={"prompt": "decoding"}).json()
    deadline = time.monotonic() + 10
    while client.get(f"/v1/videos/{job['id']}").json()["step"] < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    r = client.delete(f"/v1/videos/{job['id']}")
    assert r.status_code == 409 and r.json()["error"]["code"] == "not_cancellable", r.json()
    worker.decoding.set()
    assert wait_status(client, job["id"], ("completed", "cancelled"))["status"] == "completed"


def test_cancel_queued_and_running(client: TestClient, svc: Service) -> None:
    """A running job stops after its step; the job queued behind it never runs; both free their slots, and an
    image request and a new job are served after them."""
    worker: StepWorker = svc.worker  # type: ignore[assignment]
    worker.hold.clear()
    running = client.post("/v1/videos", json={"prompt": "first"}).json()
    queued = client.post("/v1/videos", json={"prompt": "second"}).json()
    assert wait_status(client, running["id"], ("in_progress",))["status"] == "in_progress"
    gone = client.delete(f"/v1/videos/{queued['id']}").json()
    assert gone["status"] == "cancelled"
    asked = client.delete(f"/v1/videos/{running['id']}").json()  # at once: it stops after its step
    assert asked["status"] == "in_progress" and asked["cancel_requested"] is True
    worker.hold.set()
    stopped = wait_status(client, running["id"], ("cancelled", "completed"))
    assert stopped["status"] == "cancelled" and stopped["step"] < 4
    assert [r["prompt"] for r in worker.runs] == ["first"]  # the queued one never reached the worker
    assert client.get(f"/v1/videos/{running['id']}/content").json()["error"]["code"] == "video_cancelled"
    # Again, now that it ended: deleted with its video, as OpenAI's delete does.
    assert client.delete(f"/v1/videos/{running['id']}").json() == {"id": running["id"], "object": "video.deleted",
                                                                    "deleted": True}
    assert client.get(f"/v1/videos/{running['id']}").status_code == 404
    assert client.post("/v1/images/generations", json={"prompt": "an image", "size": "256x256"}).status_code == 200
    after = client.post("/v1/videos", json={"prompt": "third"}).json()
    assert wait_status(client, after["id"], ("completed",))["status"] == "completed"
    c = counters(svc)
    assert c == {"created": 3, "succeeded": 1, "failed": 0, "cancelled": 2, "in_flight": 0}
    assert value(scrape(svc.registry), "stepwatch_video_oldest_job_age_seconds", pool="video") == 0


def test_failed_job_says_why_and_frees_its_slot(client: TestClient, svc: Service) -> None:
    job = client.post("/v1/videos", json={"prompt": "fail", "frames": 33, "size": "256x256"}).json()
    failed = wait_status(client, job["id"], ("failed",))
    assert failed["status"] == "failed" and failed["error"]["code"] == "out_of_memory"
    assert "vae_decode" in failed["error"]["message"] and failed["stepwatch"]["stage"] == "vae_decode"
    ok = client.post("/v1/videos", json={"prompt": "fine"}).json()
    assert wait_status(client, ok["id"], ("completed",))["status"] == "completed"
    c = counters(svc)
    assert c["failed"] == 1 and c["succeeded"] == 1 and adds_up(c) and c["in_flight"] == 0


def test_in_flight_jobs_are_counted_while_they_run(client: TestClient, svc: Service) -> None:
    worker: StepWorker = svc.worker  # type: ignore[assignment]
    worker.hold.clear()
    ids = [client.post("/v1/videos", json={"prompt": f"job {i}"}).json()["id"] for i in range(3)]
    wait_status(client, ids[0], ("in_progress",))
    svc._update_gauges()
    c = counters(svc)
    assert c["created"] == 3 and c["in_flight"] == 3 and adds_up(c)
    data = scrape(svc.registry)
    assert value(data, "stepwatch_video_jobs_depth", pool="video", state="running") == 1
    assert value(data, "stepwatch_video_jobs_depth", pool="video", state="queued") == 2
    assert value(data, "stepwatch_video_oldest_job_age_seconds", pool="video") > 0
    worker.hold.set()
    for i in ids:
        wait_status(client, i, ("completed",))
    svc._update_gauges()
    assert adds_up(counters(svc)) and counters(svc)["in_flight"] == 0


def test_video_off_with_two_ranks() -> None:
    svc = Service(parse({**CFG, "ranks": 2}), CollectorRegistry())
    assert svc.videos is None and "video" not in {p.name for p in svc.cfg.all_pools()}
    with TestClient(create_app(svc), client=("127.0.0.1", 40000)) as c:
        r = c.post("/v1/videos", json={"prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "video_off"


def test_video_knobs_are_checked() -> None:
    from stepwatch.service import knobs

    assert knobs.validate({"video_cache": "first_block_cache", "video_decode_chunk_frames": 0}, 1)
    with pytest.raises(knobs.KnobError, match="video_cache"):
        knobs.validate({"video_cache": "teacache"}, 1)
    with pytest.raises(knobs.KnobError, match="serves no video"):
        knobs.validate({"video_decode_chunk_frames": 2}, 2, video=False)
    with pytest.raises(knobs.KnobError, match=">= 0"):
        knobs.validate({"video_decode_chunk_frames": -1}, 1)


def test_the_distilled_configuration_is_few_step_without_a_cache() -> None:
    """service/distilled.yaml: every default request, image and video, is few-step by the thresholds' line, and no
    cache is on (one would hit on every request of a distilled model)."""
    from pathlib import Path

    from stepwatch.exporter.shapes import ShapeKey
    from stepwatch.service import config
    from stepwatch.thresholds import load as load_thresholds

    cfg = config.load(Path(config.__file__).with_name("distilled.yaml"))
    line = load_thresholds().few_step_max_steps
    assert cfg.cache.kind == "none" and cfg.video.cache.kind == "none"
    image = ShapeKey.parse(f"{cfg.default_size}_{cfg.default_steps}s")
    video = ShapeKey.parse(cfg.video_serving_shapes()[0])
    assert image.few_step(line) and video.few_step(line) and cfg.video.guidance_scale <= 1.0
    default = config.load()  # the default deployment's images are not few-step: its cache may hit
    assert not ShapeKey.parse(f"{default.default_size}_{default.default_steps}s").few_step(line)


def test_bench_service_config_and_video_table() -> None:
    """`bench service` starts the service with a config it accepts (video on for the measured shape, off without
    one), and its video rows read per job and per frame."""
    from stepwatch.bench import service as bench

    v = bench.VideoBench("128x128", 9, 4, 3)
    cfg = parse(bench.bench_config("512x512", 8, v))
    assert cfg.video_active and cfg.video.sizes == ["128x128"] and cfg.video.default_frames == 9
    assert not parse(bench.bench_config("512x512", 8)).video_active
    stats = bench._video_stats([0.9, 1.0, 1.2], 9)
    assert stats == {"jobs": 3, "p50_s": 1.0, "p99_s": 1.2, "per_frame_p50_s": round(1.0 / 9, 5)}
    lines = bench.video_table({"size": "128x128", "frames": 9, "steps": 4, "service": stats,
                               "in_process": {**stats, "p50_s": 0.5}, "job_overhead_ratio": 2.0,
                               "job_overhead_ms_p50": 500.0})
    assert any("stepwatch serve (jobs)" in line and "0.111" in line for line in lines)
    assert "2.000x the in-process pipeline (median of paired jobs)" in lines[-1]


def test_frame_chunked_decode_equals_the_stock_decode(wan_pipe: Any) -> None:
    """Wan's VAE is causal in time: decoding 1, 2 or all latent frames per decoder call gives diffusers' own
    frames (to float rounding), so the chunk is a memory knob, never a quality one."""
    import torch

    from stepwatch.service.video import set_decode_chunk

    vae = wan_pipe.vae
    torch.manual_seed(0)
    z = torch.randn(1, 16, 4, 8, 8)  # 4 latent frames -> 13 frames of 64x64
    with torch.no_grad():
        stock = vae.decode(z).sample
        try:
            outs = {}
            for k in (1, 2, 0):
                set_decode_chunk(vae, k)
                outs[k] = vae.decode(z).sample
        finally:
            set_decode_chunk(vae, 1)
    assert stock.shape == (1, 3, 13, 64, 64)
    for k, out in outs.items():
        assert out.shape == stock.shape and torch.allclose(out, stock, atol=1e-5), k


def test_mp4_encoding_is_reproducible() -> None:
    """The same frames give the same MP4 bytes (one encoder thread), which decode back to the frames closely."""
    import io

    import av
    import numpy as np

    from stepwatch.exporter.sidecar.client import decode_mp4
    from stepwatch.service.video import encode_mp4, to_uint8

    rng = np.random.default_rng(0)
    frames, bad = to_uint8(rng.random((9, 32, 48, 3)).astype(np.float32) * 0.5 + 0.25)
    assert bad == 0 and frames.dtype == np.uint8
    a, b = encode_mp4(frames, 16), encode_mp4(frames, 16)
    assert a == b and a[4:8] == b"ftyp"
    with av.open(io.BytesIO(a)) as f:
        assert f.streams.video[0].codec_context.name == "h264"
    back = decode_mp4(a)
    assert len(back) == 9 and back[0].shape == (32, 48, 3)
    _frames, nonfinite = to_uint8(np.concatenate([np.zeros((1, 4, 4, 3)), np.full((1, 4, 4, 3), np.nan)]))
    assert nonfinite == 2
