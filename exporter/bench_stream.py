"""``stepwatch bench stream``: the exporter's per-chunk cost on the tiny causal FAR pipeline, side by side.

Two pipelines built from the same seed, one instrumented, called in alternating order round by round (so the
host's drift cancels in each pair); per round the instrumented call's time over the bare one's is a paired
ratio with its 95% interval.  The chunk's own time is the call's time over its chunks (text encoding
included: what a session pays per chunk).

On a shared 2-core VM one call's wall time wanders by ~5%, far more than the hooks cost, so the hooks' cost
per chunk is also timed directly: the two per-chunk hooks (``set_timesteps`` and ``encode_kv_cache``, with
a request in flight and a KV cache of the tiny model's shape) around no-ops, minus the no-ops alone; over
the chunk's time that gives the overhead the wall clock cannot resolve (``hooks_ratio``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

SIZE, FRAMES, STEPS = 64, 25, 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=12,
                   help="paired rounds, each one bare and one instrumented call (default: %(default)s)")
    p.add_argument("--steps", type=int, default=STEPS, help="denoising steps per chunk (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the results")


def _timed(pipe: Any, steps: int) -> float:
    import torch

    t0 = time.perf_counter()
    pipe("w1 w2 w3", height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=steps, output_type="latent",
         generator=torch.Generator().manual_seed(0))
    return time.perf_counter() - t0


def hooks_cost_us(inst: Any, calls: int = 20000) -> float:
    """The per-chunk hooks' own cost (us): both wrappers around no-ops with a request in flight, minus the
    no-ops alone, interleaved in batches so drift cancels."""
    import torch

    from stepwatch.exporter import hooks

    model = inst._chunks
    full, compressed = model.tokens_per_frame(SIZE, SIZE)
    span = max(model.partition)
    kv = {layer: {"full_cache": torch.zeros(2, 1, model.heads, model.full_chunk_limit * span * full, model.head_dim),
                  "compressed_cache": torch.zeros(2, 1, model.heads, span * compressed, model.head_dim)}
          for layer in range(model.layers)}

    def set_timesteps(*a: Any, **k: Any) -> None:
        return None

    def encode(kv_cache: Any, flag: Any, **k: Any) -> Any:
        flag["num_cached_chunks"] += 1
        return kv_cache

    wrapped = (hooks.set_timesteps(inst, set_timesteps), hooks.encode_kv_cache(inst, encode))
    req = inst._begin((), {"prompt": "w1", "height": SIZE, "width": SIZE, "num_frames": FRAMES,
                           "num_inference_steps": STEPS})
    per: dict[str, list[float]] = {"bare": [], "hooked": []}
    try:
        batch = 500
        for r in range(max(2, calls // batch)):
            for name, (st, enc) in (("bare", (set_timesteps, encode)), ("hooked", wrapped))[::1 if r % 2 else -1]:
                flag = {"num_cached_chunks": 0}
                t0 = time.perf_counter()
                for _ in range(batch):
                    st(STEPS)
                    enc(kv, flag)
                per[name].append((time.perf_counter() - t0) / batch)
                req.stream.outs.clear()
                req.stream.starts.clear()
                req.stream.kv.clear()
    finally:
        inst._local.req = None
        inst._stream.done(id(req.stream))
    return (statistics.median(per["hooked"]) - statistics.median(per["bare"])) * 1e6


def measure(rounds: int, steps: int, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Bare vs instrumented FAR calls, paired round by round; per chunk figures and the ratio's 95% interval."""
    from stepwatch.exporter import instrument
    from stepwatch.exporter.bench import _ci  # torch: only once a measurement runs
    from stepwatch.service.pipeline import build_pipeline

    bare, inst_pipe = build_pipeline("far", seed=0), build_pipeline("far", seed=0)
    inst = instrument(inst_pipe, registry=CollectorRegistry())
    chunks = len(inst_pipe.transformer.config.chunk_partition)
    for p in (bare, inst_pipe):  # the first call of each pays one-time costs
        _timed(p, steps)
    times: dict[str, list[float]] = {"bare": [], "inst": []}
    for r in range(rounds):
        order = (("bare", bare), ("inst", inst_pipe)) if r % 2 == 0 else (("inst", inst_pipe), ("bare", bare))
        for name, pipe in order:
            times[name].append(_timed(pipe, steps))
        progress(f"round {r + 1}/{rounds}: bare {times['bare'][-1] * 1e3:.0f} ms, "
                 f"instrumented {times['inst'][-1] * 1e3:.0f} ms")
    ratios = [i / b for i, b in zip(times["inst"], times["bare"], strict=True)]
    diffs = [i - b for i, b in zip(times["inst"], times["bare"], strict=True)]
    lo, hi = _ci(ratios)
    report = inst.last_report
    hooks_us = hooks_cost_us(inst)
    chunk_s = statistics.median(times["bare"]) / chunks
    return {
        "chunks": chunks, "steps_per_chunk": steps, "rounds": rounds,
        "chunk_ms_bare": round(statistics.median(times["bare"]) / chunks * 1e3, 3),
        "chunk_ms_instrumented": round(statistics.median(times["inst"]) / chunks * 1e3, 3),
        "ratio": round(statistics.median(ratios), 4), "ci95": [round(lo, 4), round(hi, 4)],
        "hooks_us_per_chunk": round(hooks_us, 2),
        "hooks_ratio": round(1 + hooks_us * 1e-6 / chunk_s, 5),
        "wall_diff_us_per_chunk": round(statistics.median(diffs) / chunks * 1e6, 1),
        "kv_bytes": report.stream.kv_allocated_bytes if report is not None and report.stream else None,
        "kv_ledger_bytes": report.stream.kv_ledger_bytes if report is not None and report.stream else None,
    }


def run(args: argparse.Namespace) -> int:
    if args.rounds < 2 or args.steps < 1:
        print("bench stream: --rounds must be at least 2 and --steps at least 1", file=sys.stderr)
        return 2
    print(f"building two tiny causal FAR pipelines ({SIZE}x{SIZE}, {FRAMES} frames, {args.steps} steps per chunk)"
          "...", file=sys.stderr)
    r = measure(args.rounds, args.steps, progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(f"per chunk: bare {r['chunk_ms_bare']:.2f} ms, instrumented {r['chunk_ms_instrumented']:.2f} ms; "
          f"ratio {r['ratio']:.4f} [{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}] (paired median, 95% CI); "
          f"wall-clock difference {r['wall_diff_us_per_chunk']:.0f} us per chunk")
    print(f"hooks timed directly: {r['hooks_us_per_chunk']:.2f} us per chunk -> instrumented / bare "
          f"{r['hooks_ratio']:.5f} of the chunk's time")
    print(f"KV cache: {r['kv_bytes']} bytes read from the tensors, {r['kv_ledger_bytes']} by the ledger")
    if args.json:
        print(json.dumps(r))
    return 0
