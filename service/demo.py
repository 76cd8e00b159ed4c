"""``stepwatch demo``: the main job on the embedded default.

Brings up the local stack on loopback ports - the practice service (a real
offline FLUX pipeline, instrumented, compiled, under a memory budget), the
sidecar (quality prober), Prometheus with the drill-profile rules and
Alertmanager routing to a webhook receiver - sends traffic, runs every fault
drill (the seeds' three, queue overload, and a straggler rank on a two-rank
stack), and ends with the path of the drill report.

``--exporter-only`` runs the small in-process demo instead: the exporter on the
practice pipeline at two shapes, /metrics served on loopback, a summary.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drills", nargs="+", default=["all"], metavar="NAME",
                   help="drills to run (default: all; 'seeds' for the seeds' three)")
    p.add_argument("--compile-backend", choices=("inductor", "aot_eager", "eager"), default=None,
                   help="torch.compile backend of the practice service (default: inductor)")
    p.add_argument("--out", default="reports", help="report directory (default: %(default)s)")
    p.add_argument("--exporter-only", action="store_true", help="the small in-process exporter demo instead")
    p.add_argument("--port", type=int, default=9464, help="loopback port for /metrics (0: any free port)")
    p.add_argument("--shapes", nargs="+", default=["512x512", "1024x1024"], metavar="WxH",
                   help="image sizes to generate (default: %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="denoising steps per image (default: %(default)s)")
    p.add_argument("--requests", type=int, default=3, help="requests per shape (default: %(default)s)")
    p.add_argument("--cache-threshold", type=float, default=0.6,
                   help="first-block cache threshold on the second shape (default: %(default)s)")
    p.add_argument("--hold", type=float, default=0.0,
                   help="keep serving /metrics this many seconds after the summary (default: exit)")


def _parse_size(text: str) -> tuple[int, int]:
    from stepwatch.service.config import ConfigError, parse_size

    try:
        return parse_size(text)
    except ConfigError as e:
        raise SystemExit(f"demo: bad --shapes {e}") from None


def run(args: argparse.Namespace) -> int:
    if not args.exporter_only:
        from stepwatch.fault_injection import drill

        drill_args = argparse.Namespace(drills=args.drills, out=args.out, compile_backend=args.compile_backend,
                                        no_snapshots=False, no_triage=False, json=False, record=None,
                                        service=None, prometheus=None, alertmanager=None, admin_token=None)
        return drill.run(drill_args)
    return exporter_demo(args)


def exporter_demo(args: argparse.Namespace) -> int:
    import torch
    from prometheus_client import CollectorRegistry, start_http_server

    from stepwatch.exporter import instrument
    from stepwatch.exposition import parse_exposition
    from stepwatch.service.cache import apply_cache
    from stepwatch.service.pipeline import build_pipeline

    sizes = [_parse_size(s) for s in args.shapes]
    registry = CollectorRegistry()
    server, _thread = start_http_server(args.port, addr="127.0.0.1", registry=registry)
    port = server.server_port
    url = f"http://127.0.0.1:{port}/metrics"
    print(f"stepwatch demo: /metrics at {url}")
    print("building the practice FLUX pipeline (offline, seed 0)...")
    pipe = build_pipeline("flux", seed=0)
    shapes = [f"{h}x{w}_{args.steps}s" for w, h in sizes]
    inst = instrument(pipe, registry=registry, shapes=shapes, text_tokens=32)
    reports: dict[str, list[Any]] = {}
    for i, (w, h) in enumerate(sizes):
        cache = i == len(sizes) - 1 and len(sizes) > 1
        apply_cache(pipe, "first_block_cache" if cache else "none", args.cache_threshold)
        for r in range(args.requests):
            t = time.perf_counter()
            pipe(f"a lighthouse at dusk {r}", height=h, width=w, num_inference_steps=args.steps,
                 max_sequence_length=32, output_type="np", generator=torch.Generator().manual_seed(r))
            rep = inst.last_report
            assert rep is not None
            reports.setdefault(rep.shape_label, []).append(rep)
            print(f"  {w}x{h} request {r + 1}/{args.requests}: {time.perf_counter() - t:.2f}s"
                  + (f"  cache hits {rep.hits}/{rep.hits + rep.misses}" if rep.cache else ""))
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    data = parse_exposition(text)
    print()
    print(f"{'shape':<18}{'reqs':>5}{'step p50 ms':>13}{'text ms':>9}{'denoise ms':>12}{'vae ms':>9}"
          f"{'cache hits':>12}{'GFLOP/step':>12}")
    for label, reps in reports.items():
        steps = sorted(s for rep in reps for s in rep.step_seconds)
        p50 = steps[len(steps) // 2] * 1e3

        def mean_stage(stage: str, reps: list[Any] = reps) -> float:
            return sum(r.stages.get(stage, 0.0) for r in reps) / len(reps) * 1e3

        hits = data.get(("stepwatch_cache_decisions_total", (("cache", "first_block_cache"), ("decision", "hit"),
                                                             ("shape", label))), 0.0)
        count = data.get(("stepwatch_pipeline_step_duration_seconds_count", (("shape", label),)), 0.0)
        print(f"{label:<18}{len(reps):>5}{p50:>13.2f}{mean_stage('text_encode'):>9.1f}"
              f"{mean_stage('denoise'):>12.1f}{mean_stage('vae_decode'):>9.1f}{int(hits):>12}"
              f"{(reps[-1].step_flops or 0) / 1e9:>12.2f}")
        print(f"{'':<18}/metrics: {int(count)} step observations for {len(reps)} requests x {args.steps} steps")
    peak = max(r.memory_peak_bytes.get("request", 0) for reps in reports.values() for r in reps)
    cap = next(iter(reports.values()))[0].memory_capacity_bytes
    print(f"peak memory {peak / 2**20:.0f} MiB of {cap / 2**20:.0f} MiB capacity ({peak / cap:.1%})")
    print(f"exporter errors: {sum(v for k, v in data.items() if k[0] == 'stepwatch_exporter_errors_total'):.0f}")
    print(f"metrics: {url}")
    if args.hold > 0:
        print(f"serving /metrics for {args.hold:.0f}s (Ctrl-C to stop)")
        try:
            time.sleep(args.hold)
        except KeyboardInterrupt:
            pass
    server.shutdown()
    sys.stdout.flush()
    return 0
