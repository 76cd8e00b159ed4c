"""The small in-process exporter demo (``stepwatch demo --exporter-only``).

The exporter on the practice FLUX pipeline at a few shapes (the last one with a
first-block cache), /metrics served on loopback, and a summary of what the
reports and the scraped metrics say.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from stepwatch import httpclient
from stepwatch.exporter import instrument
from stepwatch.exposition import parse_exposition, serve_metrics
from stepwatch.service.cache import apply_cache
from stepwatch.service.pipeline import build_pipeline

TEXT_TOKENS = 32
HEADER = (f"{'shape':<18}{'reqs':>5}{'step p50 ms':>13}{'text ms':>9}{'denoise ms':>12}{'vae ms':>9}"
          f"{'cache hits':>12}{'GFLOP/step':>12}")


def exporter_demo(sizes: list[tuple[int, int]], *, port: int, steps: int, requests: int, cache_threshold: float,
                  hold: float) -> int:
    """Generate ``requests`` images per (width, height), serve /metrics on ``port``, print the summary."""
    registry = CollectorRegistry()
    server, _thread = serve_metrics(port, "127.0.0.1", registry)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    print(f"stepwatch demo: /metrics at {url}")
    print("building the practice FLUX pipeline (offline, seed 0)...")
    pipe = build_pipeline("flux", seed=0)
    inst = instrument(pipe, registry=registry, shapes=[f"{w}x{h}_{steps}s" for w, h in sizes],
                      text_tokens=TEXT_TOKENS)
    reports = _generate(pipe, inst, sizes, steps, requests, cache_threshold)
    data = parse_exposition(httpclient.request("GET", url, timeout=10).text)
    _summary(reports, data, steps)
    print(f"metrics: {url}")
    if hold > 0:
        print(f"serving /metrics for {hold:.0f}s (Ctrl-C to stop)")
        try:
            time.sleep(hold)
        except KeyboardInterrupt:
            pass
    server.shutdown()
    sys.stdout.flush()
    return 0


def _generate(pipe: Any, inst: Any, sizes: list[tuple[int, int]], steps: int, requests: int,
              cache_threshold: float) -> dict[str, list[Any]]:
    """The request reports by shape label; the last size (of several) runs with the first-block cache."""
    reports: dict[str, list[Any]] = {}
    for i, (w, h) in enumerate(sizes):
        cache = i == len(sizes) - 1 and len(sizes) > 1
        apply_cache(pipe, "first_block_cache" if cache else "none", cache_threshold)
        for r in range(requests):
            t = time.perf_counter()
            pipe(f"a lighthouse at dusk {r}", height=h, width=w, num_inference_steps=steps,
                 max_sequence_length=TEXT_TOKENS, output_type="np", generator=torch.Generator().manual_seed(r))
            rep = inst.last_report
            assert rep is not None
            reports.setdefault(rep.shape_label, []).append(rep)
            print(f"  {w}x{h} request {r + 1}/{requests}: {time.perf_counter() - t:.2f}s"
                  + (f"  cache hits {rep.hits}/{rep.hits + rep.misses}" if rep.cache else ""))
    return reports


def _summary(reports: dict[str, list[Any]], data: dict[Any, float], steps: int) -> None:
    """One row per shape from the reports, checked against what /metrics says; memory and exporter errors."""
    print()
    print(HEADER)
    for label, reps in reports.items():
        step_times = sorted(s for rep in reps for s in rep.step_seconds)
        p50 = step_times[len(step_times) // 2] * 1e3

        def mean_stage(stage: str, reps: list[Any] = reps) -> float:
            return sum(r.stages.get(stage, 0.0) for r in reps) / len(reps) * 1e3

        hits = data.get(("stepwatch_cache_decisions_total", (("cache", "first_block_cache"), ("decision", "hit"),
                                                             ("shape", label))), 0.0)
        count = data.get(("stepwatch_pipeline_step_duration_seconds_count", (("shape", label),)), 0.0)
        print(f"{label:<18}{len(reps):>5}{p50:>13.2f}{mean_stage('text_encode'):>9.1f}"
              f"{mean_stage('denoise'):>12.1f}{mean_stage('vae_decode'):>9.1f}{int(hits):>12}"
              f"{(reps[-1].step_flops or 0) / 1e9:>12.2f}")
        print(f"{'':<18}/metrics: {int(count)} step observations for {len(reps)} requests x {steps} steps")
    peak = max(r.memory_peak_bytes.get("request", 0) for reps in reports.values() for r in reps)
    cap = next(iter(reports.values()))[0].memory_capacity_bytes
    print(f"peak memory {peak / 2**20:.0f} MiB of {cap / 2**20:.0f} MiB capacity ({peak / cap:.1%})")
    print(f"exporter errors: {sum(v for k, v in data.items() if k[0] == 'stepwatch_exporter_errors_total'):.0f}")
