"""``stepwatch bench service``: what the HTTP service layer costs, against calling the pipeline in-process.

Starts ``stepwatch serve`` (compile off, the same cache settings as the
in-process pipeline) and measures throughput and p50/p99 latency at 1, 2 and 4
concurrent clients, then the same requests on an instrumented pipeline in this
process.  One GPU (here: one worker) serves one request at a time, so with more
clients the latency grows with queueing while throughput stays flat: the
compute-bound shape of diffusion serving.  The overhead ratio is the service's
p50 latency at 1 client over the in-process p50 (what a request pays for HTTP,
validation, queueing, the worker hop and PNG encoding).
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="512x512", help="image size WxH (default: %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="denoising steps (default: %(default)s)")
    p.add_argument("--requests", type=int, default=24, help="requests per concurrency level (default: %(default)s)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4], help="concurrency levels (default: 1 2 4)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the results")


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out: dict[str, Any] = json.loads(r.read())
    base64.b64decode(out["data"][0]["b64_json"])  # a client decodes what it gets
    return out


def _load(url: str, body: dict[str, Any], clients: int, n: int) -> dict[str, float]:
    lat: list[float] = []
    lock = threading.Lock()
    todo = list(range(n))

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            t = time.perf_counter()
            _post(url, {**body, "seed": i})
            with lock:
                lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"throughput_rps": n / wall, "p50_s": _pct(lat, 0.5), "p99_s": _pct(lat, 0.99)}


def run(args: argparse.Namespace) -> int:
    import socket

    import torch
    import yaml
    from prometheus_client import CollectorRegistry

    from stepwatch.exporter import instrument
    from stepwatch.service.cache import apply_cache
    from stepwatch.service.config import load, parse_size
    from stepwatch.service.pipeline import build_pipeline, prompt_words

    w, h = parse_size(args.size)
    cfg = load()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp(prefix="stepwatch-bench-"))
    conf = {"compile": {"enabled": False}, "warmup": [args.size], "default_steps": args.steps,
            "memory_budget_mb": None, "pools": {"bench": {"sizes": [args.size], "slo_seconds": 600}},
            "queue": {"max_queued": 1024}}
    (tmp / "bench.yaml").write_text(yaml.safe_dump(conf))
    print(f"starting stepwatch serve on :{port} (compile off, {args.size} x {args.steps} steps)...", file=sys.stderr)
    log = open(tmp / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "stepwatch.cli", "serve", "--config", str(tmp / "bench.yaml"),
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {"size": args.size, "steps": args.steps, "service": []}
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            print("service did not become ready; see " + str(tmp / "serve.log"), file=sys.stderr)
            return 1
        body = {"prompt": "a lighthouse at dusk", "size": args.size, "steps": args.steps}
        _load(url + "/v1/images/generations", body, 1, 3)  # warm the HTTP path
        for c in args.clients:
            print(f"  {c} concurrent client(s), {args.requests} requests...", file=sys.stderr)
            r = _load(url + "/v1/images/generations", body, c, args.requests)
            results["service"].append({"clients": c, **{k: round(v, 4) for k, v in r.items()}})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    print("  in-process instrumented pipeline (same seed sequence)...", file=sys.stderr)
    pipe = build_pipeline(cfg.family, seed=cfg.seed)
    apply_cache(pipe, cfg.cache.kind, cfg.cache.threshold, steps=args.steps)
    pipe.vae.enable_tiling()
    instrument(pipe, registry=CollectorRegistry(), text_tokens=cfg.text_tokens)
    lat = []
    for i in range(5 + args.requests):
        t = time.perf_counter()
        pipe(prompt_words("a lighthouse at dusk"), height=h, width=w, num_inference_steps=args.steps,
             max_sequence_length=cfg.text_tokens, output_type="np", generator=torch.Generator().manual_seed(i))
        if i >= 5:
            lat.append(time.perf_counter() - t)
    inproc = {"throughput_rps": round(1 / statistics.median(lat), 4), "p50_s": round(_pct(lat, 0.5), 4),
              "p99_s": round(_pct(lat, 0.99), 4)}
    results["in_process"] = inproc
    one = next((r for r in results["service"] if r["clients"] == 1), results["service"][0])
    results["service_overhead_ratio"] = round(one["p50_s"] / inproc["p50_s"], 4)
    results["service_overhead_ms_p50"] = round((one["p50_s"] - inproc["p50_s"]) * 1e3, 2)
    print(f"\n{'variant':<22}{'clients':>8}{'req/s':>9}{'p50 s':>9}{'p99 s':>9}")
    print(f"{'in-process pipeline':<22}{1:>8}{inproc['throughput_rps']:>9.3f}{inproc['p50_s']:>9.3f}"
          f"{inproc['p99_s']:>9.3f}")
    for r in results["service"]:
        print(f"{'stepwatch serve':<22}{r['clients']:>8}{r['throughput_rps']:>9.3f}{r['p50_s']:>9.3f}"
              f"{r['p99_s']:>9.3f}")
    print(f"service layer: p50 {results['service_overhead_ratio']:.3f}x the in-process pipeline at 1 client "
          f"({results['service_overhead_ms_p50']:+.1f} ms at p50); throughput stays flat as clients grow "
          "because one worker is compute-bound")
    if args.json:
        print(json.dumps(results))
    return 0
