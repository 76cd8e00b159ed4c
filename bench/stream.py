"""``stepwatch bench stream``: the exporter's per-chunk cost on the tiny causal FAR pipeline, side by side.

Two pipelines built from the same seed, one instrumented, called in alternating order round by round (so the
host's drift cancels in each pair); per round the instrumented call's time over the bare one's is a paired
ratio; their trimmed mean and its block-bootstrap interval (bench/paired.py) are measured until the
interval is within --precision.  The instrumented side moves
to the other pipeline every few rounds (a crossover), because two pipelines built alike are not equally
fast on this VM.  The chunk's own time is the call's time over its chunks (text encoding
included: what a session pays per chunk).

On a shared 2-core VM one pair's ratio wanders by ~10%, far more than the hooks cost, so the hooks' cost
per chunk is also timed directly: the two per-chunk hooks (``set_timesteps`` and ``encode_kv_cache``, with
a request in flight and a KV cache of the tiny model's shape) around no-ops, minus the no-ops alone; over
the chunk's time that gives the overhead the wall clock cannot resolve (``hooks_ratio``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from stepwatch.bench.paired import (
    BUDGET_S,
    PRECISION,
    StopRule,
    paired_difference,
    paired_ratio,
    pooled_ratio,
)

SIZE, FRAMES, STEPS = 64, 25, 4
PROCESS_ROUNDS = 96  # per process when several are pooled: ~1 min each here


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=0,
                   help="a fixed number of paired rounds per process, each one bare and one instrumented call "
                        f"(default: {PROCESS_ROUNDS} per process; with --processes 1, adaptive: at least 160, then "
                        "on until the ratio's interval is within --precision)")
    p.add_argument("--precision", type=float, default=PRECISION,
                   help="with --processes 1: stop once the ratio's 95%% interval is within this of the estimate on "
                        "each side (default: %(default)s)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S,
                   help="with --processes 1: most seconds of paired rounds before it stops short of --precision "
                        "(default: %(default)s)")
    p.add_argument("--steps", type=int, default=STEPS, help="denoising steps per chunk (default: %(default)s)")
    p.add_argument("--swap-every", type=int, default=8,
                   help="rounds before the instrumented side moves to the other pipeline (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads during the calls (default: %(default)s)")
    p.add_argument("--processes", type=int, default=4,
                   help="fresh processes to measure in, one after another, each --rounds (default there: "
                        f"{PROCESS_ROUNDS}); the ratio is pooled across them, its interval from their spread "
                        "(1: this process only, adaptive rounds; default: %(default)s)")
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


def _crossover(rounds: int, steps: int, block: int, progress: Callable[[str], None],
               stop: StopRule | None) -> tuple[dict[str, list[float]], Any]:
    """The calls of bench.crossover on two FAR pipelines built alike, timed."""
    from stepwatch.bench.overhead import crossover
    from stepwatch.service.pipeline import build_pipeline

    def report(r: int, out: dict[str, list[float]]) -> None:
        progress(f"round {r + 1}/{rounds}: bare {out['bare'][-1] * 1e3:.0f} ms, "
                 f"instrumented {out['inst'][-1] * 1e3:.0f} ms")

    pipes = build_pipeline("far", seed=0), build_pipeline("far", seed=0)
    until = None if stop is None else (lambda out: stop.done(out["inst"], out["bare"], 2 * block))
    return crossover(pipes, lambda p, r: _timed(p, steps), rounds, block, report, stop=until)


def measure(rounds: int, steps: int, progress: Callable[[str], None] = lambda s: None,
            block: int = 8, threads: int = 1, stop: StopRule | None = None) -> dict[str, Any]:
    """Bare vs instrumented FAR calls, paired round by round on one torch thread (two threads on this
    2-core VM double the noise a neighbour makes); per chunk figures and the ratio's 95% interval.
    ``rounds`` of them, or with ``stop`` as many as it asks for (at most its max_rounds)."""
    import torch

    block = max(1, block)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times, inst = _crossover(stop.max_rounds if stop else rounds, steps, block, progress, stop)
    finally:
        torch.set_num_threads(before)
    report = inst.last_report
    chunks = len(report.stream.chunk_seconds) if report is not None and report.stream else 4
    ratio, (lo, hi) = paired_ratio(times["inst"], times["bare"], 2 * block)
    diff, _ = paired_difference(times["inst"], times["bare"], 2 * block)
    rounds = len(times["bare"])
    hooks_us = hooks_cost_us(inst)
    chunk_s = statistics.median(times["bare"]) / chunks
    return {
        "chunks": chunks, "steps_per_chunk": steps, "rounds": rounds, "swap_every": block, "threads": threads,
        "chunk_ms_bare": round(statistics.median(times["bare"]) / chunks * 1e3, 3),
        "chunk_ms_instrumented": round(statistics.median(times["inst"]) / chunks * 1e3, 3),
        "ratio": round(ratio, 4), "ci95": [round(lo, 4), round(hi, 4)],
        "hooks_us_per_chunk": round(hooks_us, 2),
        "hooks_ratio": round(1 + hooks_us * 1e-6 / chunk_s, 5),
        "wall_diff_us_per_chunk": round(diff / chunks * 1e6, 1),
        "kv_bytes": report.stream.kv_allocated_bytes if report is not None and report.stream else None,
        "kv_ledger_bytes": report.stream.kv_ledger_bytes if report is not None and report.stream else None,
    }


def stop_rule(rounds: int, precision: float = PRECISION, budget_s: float = BUDGET_S,
              progress: Callable[[str], None] | None = None) -> StopRule:
    """A fixed count when ``rounds`` is given, else at least 160 rounds and on until ``precision``."""
    return StopRule.of(rounds, 160, precision, budget_s, progress)


def run(args: argparse.Namespace) -> int:
    if (args.rounds and args.rounds < 2) or args.rounds < 0 or args.steps < 1 or args.swap_every < 1 \
            or args.threads < 1 or args.precision <= 0 or args.budget_s <= 0:
        print("bench stream: --rounds must be 0 (adaptive) or at least 2; --steps, --swap-every and --threads at "
              "least 1; --precision and --budget-s positive", file=sys.stderr)
        return 2
    if args.processes < 1:
        print("bench stream: --processes must be at least 1", file=sys.stderr)
        return 2
    if args.processes > 1:
        return _run_pooled(args)
    print(f"building two tiny causal FAR pipelines ({SIZE}x{SIZE}, {FRAMES} frames, {args.steps} steps per chunk)"
          "...", file=sys.stderr)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    # A fixed count says each round; an adaptive run says its interval every few seconds instead.
    r = measure(args.rounds, args.steps, progress=say if args.rounds else lambda s: None, block=args.swap_every,
                threads=args.threads, stop=stop_rule(args.rounds, args.precision, args.budget_s, say))
    print(f"per chunk: bare {r['chunk_ms_bare']:.2f} ms, instrumented {r['chunk_ms_instrumented']:.2f} ms; "
          f"ratio {r['ratio']:.4f} [{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}] over {r['rounds']} rounds (paired, "
          f"trimmed mean, 95% CI); "
          f"wall-clock difference {r['wall_diff_us_per_chunk']:.0f} us per chunk")
    print(f"hooks timed directly: {r['hooks_us_per_chunk']:.2f} us per chunk -> instrumented / bare "
          f"{r['hooks_ratio']:.5f} of the chunk's time")
    print(f"KV cache: {r['kv_bytes']} bytes read from the tensors, {r['kv_ledger_bytes']} by the ledger")
    if args.json:
        print(json.dumps(r))
    return 0


def _child(args: argparse.Namespace, k: int) -> dict[str, Any] | None:
    cmd = [sys.executable, "-m", "stepwatch.cli", "bench", "stream", "--json", "--processes", "1",
           "--rounds", str(args.rounds or PROCESS_ROUNDS), "--steps", str(args.steps),
           "--swap-every", str(args.swap_every), "--threads", str(args.threads)]
    print(f"process {k + 1}/{args.processes}: {args.rounds or PROCESS_ROUNDS} paired rounds...", file=sys.stderr,
          flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        print(f"bench stream: process {k + 1} failed (exit {done.returncode})", file=sys.stderr)
        return None
    r: dict[str, Any] = json.loads(lines[-1])
    print(f"  ratio {r['ratio']:.4f} [{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}], {r['chunk_ms_bare']:.1f} ms per "
          "chunk bare", file=sys.stderr, flush=True)
    return r


def _run_pooled(args: argparse.Namespace) -> int:
    """The measurement in several fresh processes, pooled (paired.pooled_ratio says why)."""
    runs = [r for k in range(args.processes) if (r := _child(args, k)) is not None]
    if len(runs) < 2:
        print("bench stream: fewer than two processes measured", file=sys.stderr)
        return 1
    ratio, (lo, hi) = pooled_ratio([r["ratio"] for r in runs])
    first = runs[0]
    r = {"chunk_ms_bare": round(statistics.median(x["chunk_ms_bare"] for x in runs), 3),
         "chunk_ms_instrumented": round(statistics.median(x["chunk_ms_instrumented"] for x in runs), 3),
         "ratio": round(ratio, 4), "ci95": [round(lo, 4), round(hi, 4)],
         "hooks_us_per_chunk": round(statistics.median(x["hooks_us_per_chunk"] for x in runs), 2),
         "processes": len(runs), "process_ratios": [x["ratio"] for x in runs],
         "rounds_per_process": first["rounds"], "chunks": first["chunks"], "steps_per_chunk": first["steps_per_chunk"],
         "wall_diff_us_per_chunk": round(statistics.median(x["wall_diff_us_per_chunk"] for x in runs), 1),
         "kv_bytes": first["kv_bytes"], "kv_ledger_bytes": first["kv_ledger_bytes"]}
    print(f"per chunk: bare {r['chunk_ms_bare']:.2f} ms, instrumented {r['chunk_ms_instrumented']:.2f} ms; ratio "
          f"{ratio:.4f} [{lo:.4f}, {hi:.4f}] over {len(runs)} processes of {first['rounds']} rounds (geometric mean, "
          f"t interval across processes: {', '.join(f'{x:.4f}' for x in r['process_ratios'])})")
    print(f"hooks timed directly: {r['hooks_us_per_chunk']:.2f} us per chunk")
    print(f"KV cache: {r['kv_bytes']} bytes read from the tensors, {r['kv_ledger_bytes']} by the ledger")
    if args.json:
        print(json.dumps(r))
    return 0
