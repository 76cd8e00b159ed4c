"""What the HTTP service layer costs, against calling the pipeline in-process (``stepwatch bench service``).

Starts ``stepwatch serve`` (compile off, the same cache settings as the
in-process pipeline) and measures throughput and p50/p99 latency at 1, 2 and 4
concurrent clients, then the same requests on an instrumented pipeline in this
process.  One GPU (here: one worker) serves one request at a time, so with more
clients the latency grows with queueing while throughput stays flat: the
compute-bound shape of diffusion serving.  The overhead ratio is the service's
p50 latency at 1 client over the in-process p50 (what a request pays for HTTP,
validation, queueing, the worker hop and PNG encoding).

Video jobs are measured side by side: ``jobs`` jobs through the job API (create,
poll every 20 ms, download the MP4) interleaved with the same calls on the
in-process video pipeline (so both see the same load on a shared host): seconds
per job and per frame, and the median of the paired ratios (what a job pays for
the queue, the worker hop, the MP4 encoding and the polling).
"""

from __future__ import annotations

import base64
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from prometheus_client import CollectorRegistry

from stepwatch import httpclient
from stepwatch.exporter import instrument
from stepwatch.procs import free_port
from stepwatch.service.cache import apply_cache
from stepwatch.service.config import load, parse_size
from stepwatch.service.pipeline import build_pipeline, prompt_words

PROMPT = "a lighthouse at dusk"
WARM_REQUESTS = 5  # in-process requests before the measured ones (the service warms its HTTP path with 3)


POLL_S = 0.02  # how often the bench polls a video job (a client's polling adds up to this to a job's time)


@dataclass(frozen=True)
class VideoBench:
    """The video jobs to measure: ``jobs`` default-prompt jobs of one shape."""

    size: str = "128x128"
    frames: int = 9
    steps: int = 4
    jobs: int = 6


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def bench_config(size: str, steps: int, video: VideoBench | None = None) -> dict[str, Any]:
    """The service config the bench runs: compile off, one pool for ``size``, no memory budget, long SLOs (the
    bench measures, the queue must not shed), video jobs of ``video``'s one shape (or video off)."""
    return {
        "compile": {"enabled": False}, "warmup": [size], "default_steps": steps, "memory_budget_mb": None,
        "pools": {"bench": {"sizes": [size], "slo_seconds": 600}}, "queue": {"max_queued": 1024},
        "video": ({"sizes": [video.size], "default_size": video.size, "default_frames": video.frames,
                   "max_frames": max(video.frames, 9), "default_steps": video.steps, "slo_seconds": 600,
                   "max_wait_seconds": 1200} if video else {"enabled": False})}


@contextmanager
def running_service(size: str, steps: int, video: VideoBench | None = None) -> Iterator[str]:
    """``stepwatch serve`` on a free loopback port (compile off, one pool for ``size``, video jobs of ``video``'s
    shape when given), ready: its URL."""
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="stepwatch-bench-"))
    conf = bench_config(size, steps, video)
    (tmp / "bench.yaml").write_text(yaml.safe_dump(conf))
    print(f"starting stepwatch serve on :{port} (compile off, {size} x {steps} steps)...", file=sys.stderr)
    with open(tmp / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "stepwatch.cli", "serve", "--config", str(tmp / "bench.yaml"),
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 300
            while not httpclient.ok(url + "/readyz"):
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"service did not become ready; see {tmp / 'serve.log'}")
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def _load(url: str, body: dict[str, Any], clients: int, n: int) -> dict[str, float]:
    """``n`` requests from ``clients`` threads, each on its own keep-alive connection."""
    lat: list[float] = []
    lock = threading.Lock()
    todo = list(range(n))

    def client() -> None:
        with httpclient.client(timeout=600) as c:
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop()
                t = time.perf_counter()
                r = c.post(url, json={**body, "seed": i})
                r.raise_for_status()
                base64.b64decode(r.json()["data"][0]["b64_json"])  # a client decodes what it gets
                with lock:
                    lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"throughput_rps": n / wall, "p50_s": _pct(lat, 0.5), "p99_s": _pct(lat, 0.99)}


def measure_service(size: str, steps: int, requests: int, clients: list[int],
                    video: VideoBench | None = None) -> tuple[list[dict[str, float]], dict[str, Any] | None]:
    """Throughput and latency of ``stepwatch serve`` at each concurrency level; its video jobs when asked."""
    out = []
    with running_service(size, steps, video) as url:
        gen = url + "/v1/images/generations"
        body = {"prompt": PROMPT, "size": size, "steps": steps}
        _load(gen, body, 1, 3)  # warm the HTTP path
        for c in clients:
            print(f"  {c} concurrent client(s), {requests} requests...", file=sys.stderr)
            r = _load(gen, body, c, requests)
            out.append({"clients": c, **{k: round(v, 4) for k, v in r.items()}})
        jobs = measure_video(url, video) if video else None
    return out, jobs


def _video_job(c: Any, url: str, body: dict[str, Any]) -> tuple[float, float]:
    """One job as a client runs it: (seconds from POST to the downloaded MP4, the worker's generation seconds)."""
    t = time.perf_counter()
    r = c.post(url + "/v1/videos", json=body)
    r.raise_for_status()
    job = r.json()
    while job["status"] in ("queued", "in_progress"):
        time.sleep(POLL_S)
        job = c.get(f"{url}/v1/videos/{job['id']}").json()
    if job["status"] != "completed":
        raise RuntimeError(f"video job {job['id']} {job['status']}: {job.get('error')}")
    c.get(f"{url}/v1/videos/{job['id']}/content").raise_for_status()
    return time.perf_counter() - t, float(job["stepwatch"]["seconds"])


def _local_video(v: VideoBench) -> Any:
    """The video pipeline as the worker builds it (the config's decode chunk, tiling on), instrumented, in this
    process: ``job(seed)`` runs one job's pipeline call (no MP4: what the service adds is what is measured)."""
    from stepwatch.service.video import set_decode_chunk

    cfg = load()
    w, h = parse_size(v.size)
    pipe = build_pipeline("wan", seed=cfg.seed)
    set_decode_chunk(pipe.vae, cfg.video.decode_chunk_frames)
    pipe.vae.enable_tiling()
    instrument(pipe, registry=CollectorRegistry(), text_tokens=cfg.text_tokens)

    def job(seed: int) -> float:
        t = time.perf_counter()
        pipe(prompt_words(PROMPT), height=h, width=w, num_frames=v.frames, num_inference_steps=v.steps,
             guidance_scale=cfg.video.guidance_scale, max_sequence_length=cfg.text_tokens, output_type="np",
             generator=torch.Generator().manual_seed(seed))
        return time.perf_counter() - t

    return job


def measure_video(url: str, v: VideoBench) -> dict[str, Any]:
    """``v.jobs`` jobs through the job API and the same jobs in-process, interleaved (which goes first alternates),
    so that both see the same load on a shared host; the ratio is the median of the per-job ratios."""
    print(f"  {v.jobs} video jobs ({v.size} x {v.frames} frames x {v.steps} steps) through /v1/videos and "
          "in-process, interleaved...", file=sys.stderr)
    body = {"prompt": PROMPT, "size": v.size, "frames": v.frames, "steps": v.steps}
    local = _local_video(v)
    served, here, gen_s = [], [], []
    with httpclient.client(timeout=600) as c:
        _video_job(c, url, {**body, "seed": 10_000})  # warm both paths
        local(10_000)
        for i in range(v.jobs):
            if i % 2:
                here.append(local(i))
            total, gen = _video_job(c, url, {**body, "seed": i})
            served.append(total)
            gen_s.append(gen)
            if not i % 2:
                here.append(local(i))
    ratio = statistics.median(a / b for a, b in zip(served, here, strict=True))
    return {"size": v.size, "frames": v.frames, "steps": v.steps,
            "service": _video_stats(served, v.frames) | {"worker_generation_p50_s": round(_pct(gen_s, 0.5), 4)},
            "in_process": _video_stats(here, v.frames), "job_overhead_ratio": round(ratio, 4),
            "job_overhead_ms_p50": round((_pct(served, 0.5) - _pct(here, 0.5)) * 1e3, 1)}


def _video_stats(job_s: list[float], frames: int) -> dict[str, Any]:
    p50 = _pct(job_s, 0.5)
    return {"jobs": len(job_s), "p50_s": round(p50, 4), "p99_s": round(_pct(job_s, 0.99), 4),
            "per_frame_p50_s": round(p50 / frames, 5)}


def measure_in_process(size: str, steps: int, requests: int) -> dict[str, float]:
    """The same requests (same seed sequence) on an instrumented pipeline in this process."""
    print("  in-process instrumented pipeline (same seed sequence)...", file=sys.stderr)
    cfg = load()
    w, h = parse_size(size)
    pipe = build_pipeline(cfg.family, seed=cfg.seed)
    apply_cache(pipe, cfg.cache.kind, cfg.cache.threshold, steps=steps)
    pipe.vae.enable_tiling()
    instrument(pipe, registry=CollectorRegistry(), text_tokens=cfg.text_tokens)
    lat = []
    for i in range(WARM_REQUESTS + requests):
        t = time.perf_counter()
        pipe(prompt_words(PROMPT), height=h, width=w, num_inference_steps=steps,
             max_sequence_length=cfg.text_tokens, output_type="np", generator=torch.Generator().manual_seed(i))
        if i >= WARM_REQUESTS:
            lat.append(time.perf_counter() - t)
    return {"throughput_rps": round(1 / statistics.median(lat), 4), "p50_s": round(_pct(lat, 0.5), 4),
            "p99_s": round(_pct(lat, 0.99), 4)}


def bench(size: str, steps: int, requests: int, clients: list[int], video: VideoBench | None = None) -> dict[str, Any]:
    """The service at each concurrency, the in-process pipeline, and the service's overhead at 1 client; the
    same for video jobs when ``video`` is given."""
    service, jobs = measure_service(size, steps, requests, clients, video)
    results: dict[str, Any] = {"size": size, "steps": steps, "service": service}
    inproc = results["in_process"] = measure_in_process(size, steps, requests)
    one = next((r for r in results["service"] if r["clients"] == 1), results["service"][0])
    results["service_overhead_ratio"] = round(one["p50_s"] / inproc["p50_s"], 4)
    results["service_overhead_ms_p50"] = round((one["p50_s"] - inproc["p50_s"]) * 1e3, 2)
    if jobs is not None:
        results["video"] = jobs
    return results


def table(results: dict[str, Any]) -> str:
    inproc = results["in_process"]
    lines = [f"\n{'variant':<22}{'clients':>8}{'req/s':>9}{'p50 s':>9}{'p99 s':>9}",
             f"{'in-process pipeline':<22}{1:>8}{inproc['throughput_rps']:>9.3f}{inproc['p50_s']:>9.3f}"
             f"{inproc['p99_s']:>9.3f}"]
    for r in results["service"]:
        lines.append(f"{'stepwatch serve':<22}{r['clients']:>8}{r['throughput_rps']:>9.3f}{r['p50_s']:>9.3f}"
                     f"{r['p99_s']:>9.3f}")
    lines.append(f"service layer: p50 {results['service_overhead_ratio']:.3f}x the in-process pipeline at 1 client "
                 f"({results['service_overhead_ms_p50']:+.1f} ms at p50); throughput stays flat as clients grow "
                 "because one worker is compute-bound")
    if "video" in results:
        lines += video_table(results["video"])
    return "\n".join(lines)


def video_table(v: dict[str, Any]) -> list[str]:
    lines = [f"\nvideo jobs, {v['size']} x {v['frames']} frames x {v['steps']} steps",
             f"{'variant':<26}{'jobs':>6}{'p50 s/job':>11}{'p99 s/job':>11}{'p50 s/frame':>13}"]
    for name, r in (("in-process pipeline", v["in_process"]), ("stepwatch serve (jobs)", v["service"])):
        lines.append(f"{name:<26}{r['jobs']:>6}{r['p50_s']:>11.3f}{r['p99_s']:>11.3f}{r['per_frame_p50_s']:>13.4f}")
    lines.append(f"job API: {v['job_overhead_ratio']:.3f}x the in-process pipeline (median of paired jobs) "
                 f"({v['job_overhead_ms_p50']:+.0f} ms per job: queue, worker hop, MP4 encoding, polling every "
                 f"{POLL_S * 1e3:.0f} ms, download)")
    return lines
