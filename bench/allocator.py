"""``stepwatch bench allocator``: what the worker's malloc settings cost an image, side by side with glibc's own.

The worker caps malloc at two arenas and fixes the mmap threshold at glibc's ceiling outside video jobs
(``stepwatch/procs.py`` says why: its memory budget is its address space).  Settings of a process's allocator
are set once per process, so the variants are two processes, each with the practice FLUX pipeline built from
the same seed; the parent asks them for one image each in turn (crossover order: A B B A), so the host's drift
hits both alike.  The process is the unit that varies (memory layout differs per process: paired.py), so the
answer pools several process pairs: a ratio (the worker's settings / glibc's) with a t interval across pairs.

Two checks that it can answer: ``--variant aa`` runs the worker's settings on both sides (the interval must
hold 1), ``--variant known`` runs a 1 MiB threshold on side A for images too, a setting measured 1.55-1.77x
slower at 512x512 (every tensor of a MiB and more in a fresh mapping): the ratio must show it.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from typing import IO, Any

from stepwatch.bench.paired import paired_ratio, pooled_ratio

SETTINGS = {
    "worker": "the worker's (2 arenas, mmap threshold fixed at 32 MiB)",
    "glibc": "glibc's defaults (arenas per thread, a rising threshold)",
    "mmap1m": "a 1 MiB mmap threshold (the video jobs' setting, for images too)",
}
VARIANTS = {"worker": ("worker", "glibc"), "aa": ("worker", "worker"), "known": ("mmap1m", "glibc")}
BLOCK = 2  # crossover blocks of A B B A: two pairs


def apply(setting: str) -> None:
    """Set this process's allocator as ``setting`` says (before the pipeline allocates)."""
    from stepwatch import procs

    if setting == "worker":
        procs.limit_arenas()
        procs.set_mmap_threshold(procs.MMAP_THRESHOLD_CEILING_BYTES)
    elif setting == "mmap1m":
        procs.set_mmap_threshold(procs.MMAP_THRESHOLD_BYTES)


def child(setting: str, size: int, steps: int) -> None:
    """One side: build the pipeline, then time one image per line read from stdin."""
    apply(setting)
    import torch

    from stepwatch.service.pipeline import build_pipeline

    torch.set_num_threads(1)  # both sides share the host's cores; one each keeps them from fighting
    pipe = build_pipeline("flux", seed=0)
    for _ in range(2):  # warm: the allocator's working set, the first call's one-off costs
        pipe("a lighthouse", height=size, width=size, num_inference_steps=steps, output_type="np")
    print("ready", flush=True)
    for line in sys.stdin:
        seed = int(line)
        t = time.perf_counter()
        pipe("a lighthouse", height=size, width=size, num_inference_steps=steps, output_type="np",
             generator=torch.Generator().manual_seed(seed))
        print(f"{time.perf_counter() - t:.6f}", flush=True)


class Side:
    def __init__(self, setting: str, size: int, steps: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "stepwatch.bench.allocator", "--child", setting,
                                      "--size", str(size), "--steps", str(steps)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._out: IO[str] = self.proc.stdout  # type: ignore[assignment]
        self._in: IO[str] = self.proc.stdin  # type: ignore[assignment]
        if self._out.readline().strip() != "ready":
            raise RuntimeError(f"bench allocator: the {setting} side did not start")

    def time_one(self, seed: int) -> float:
        self._in.write(f"{seed}\n")
        self._in.flush()
        return float(self._out.readline())

    def close(self) -> None:
        self._in.close()
        self.proc.wait(timeout=30)


def one_pair(a: str, b: str, rounds: int, size: int, steps: int) -> tuple[float, tuple[float, float]]:
    """One process pair: ``rounds`` crossover rounds; the within-pair ratio A/B and its interval."""
    sa, sb = Side(a, size, steps), Side(b, size, steps)
    ta: list[float] = []
    tb: list[float] = []
    try:
        for r in range(rounds):
            first_a = r % 2 == 0
            for side in ((sa, sb) if first_a else (sb, sa)):
                (ta if side is sa else tb).append(side.time_one(r))
    finally:
        sa.close()
        sb.close()
    return paired_ratio(ta, tb, BLOCK)


def compare(variant: str, pairs: int, rounds: int, size: int, steps: int) -> dict[str, Any]:
    a, b = VARIANTS[variant]
    within: list[dict[str, Any]] = []
    ratios: list[float] = []
    for i in range(pairs):
        ratio, (lo, hi) = one_pair(a, b, rounds, size, steps)
        ratios.append(ratio)
        within.append({"ratio": round(ratio, 4), "interval": [round(lo, 4), round(hi, 4)]})
        print(f"  pair {i + 1}/{pairs}: {a}/{b} {ratio:.4f} [{lo:.4f}, {hi:.4f}]", file=sys.stderr, flush=True)
    ratio, (lo, hi) = pooled_ratio(ratios)
    return {"variant": variant, "a": SETTINGS[a], "b": SETTINGS[b], "shape": f"{size}x{size}_{steps}s",
            "pairs": pairs, "rounds": rounds, "ratio": round(ratio, 4),
            "interval": [round(lo, 4), round(hi, 4)], "within_pairs": within,
            "holds_1": lo <= 1.0 <= hi if not math.isnan(lo) else None}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variant", choices=tuple(VARIANTS), default="worker",
                   help="worker: the worker's settings / glibc's (default); aa: the worker's on both sides (must "
                        "hold 1); known: a 1 MiB threshold / glibc's (a known cost the answer must show)")
    p.add_argument("--pairs", type=int, default=3, help="process pairs (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=24, help="crossover rounds per pair (default: %(default)s)")
    p.add_argument("--size", type=int, default=512, help="image side (default: %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="denoising steps (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--child", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.child:
        child(args.child, args.size, args.steps)
        return 0
    res = compare(args.variant, args.pairs, args.rounds, args.size, args.steps)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{res['shape']}: {res['a']} / {res['b']} = {res['ratio']:.4f} "
              f"[{res['interval'][0]:.4f}, {res['interval'][1]:.4f}] over {args.pairs} process pairs")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="stepwatch bench allocator", description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
