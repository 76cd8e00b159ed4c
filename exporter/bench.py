"""``stepwatch bench overhead``: what instrumentation costs, bare vs instrumented, side by side.

Two pipelines built from the same seed (bit-identical), one instrumented, run
interleaved in one process with the same seeds, alternating which goes first
so drift (thermal, caches, other load) hits both alike.  Per case it reports
the median per-step time of each variant (a step timed by the same
``callback_on_step_end`` in both) and the overhead per step from the median of
paired whole-request differences (each instrumented call against the bare
call next to it), so per-request bookkeeping is counted too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from typing import Any

DEFAULT_CASES = ("256x4", "1024x4")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), metavar="SIZExSTEPS",
                   help="square size x steps per case (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=0,
                   help="interleaved rounds per case (default: 40 below 512^2, else 24)")
    p.add_argument("--cache", default="none", choices=("none", "first_block_cache"),
                   help="run both variants with this cache on (default: none)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the results")


def _timed_call(pipe: Any, size: int, steps: int, seed: int) -> tuple[float, list[float]]:
    import torch

    marks: list[float] = []

    def on_step(_pipe: Any, _i: int, _t: Any, kw: dict[str, Any]) -> dict[str, Any]:
        marks.append(time.perf_counter())
        return kw

    t0 = time.perf_counter()
    pipe("w1 w2 w3", height=size, width=size, num_inference_steps=steps, max_sequence_length=32,
         output_type="np", generator=torch.Generator().manual_seed(seed), callback_on_step_end=on_step)
    total = time.perf_counter() - t0
    steps_s = [b - a for a, b in itertools.pairwise(marks)]
    return total, steps_s


class _StubScheduler:
    def __init__(self) -> None:
        self.timesteps: list[int] = []

    def set_timesteps(self, n: int) -> None:
        self.timesteps = list(range(n))

    def step(self, x: Any) -> Any:
        return x


class _StubTransformer:
    """Enough of a diffusers transformer for the hooks: cache_context and a block list."""

    def __init__(self) -> None:
        self._modules: dict[str, Any] = {}

    def named_children(self) -> Any:
        return iter(())

    def named_modules(self) -> Any:
        return iter(())

    def cache_context(self, name: str) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def __call__(self, x: Any) -> Any:
        return x


class _StubVae:
    def decode(self, x: Any) -> Any:
        return x


class StubPipeline:
    """The call structure of a diffusers pipeline with no compute: isolates the hooks' own cost."""

    default_sample_size = 128
    vae_scale_factor = 8

    def __init__(self) -> None:
        self.scheduler = _StubScheduler()
        self.transformer = _StubTransformer()
        self.vae = _StubVae()
        self.device = "cpu"

    def encode_prompt(self, prompt: str) -> str:
        return prompt

    def __call__(self, prompt: str, height: int = 256, width: int = 256, num_inference_steps: int = 4) -> Any:
        x = self.encode_prompt(prompt)
        self.scheduler.set_timesteps(num_inference_steps)
        for _t in self.scheduler.timesteps:
            with self.transformer.cache_context("cond"):
                x = self.transformer(x)
            x = self.scheduler.step(x)
        return self.vae.decode(x)


def hooks_cost(steps: int = 4, calls: int = 20000) -> dict[str, float]:
    """Per-request and per-step host cost of the hooks, bare vs instrumented stub, interleaved."""
    from prometheus_client import CollectorRegistry

    from stepwatch.exporter import instrument

    bare, inst = StubPipeline(), StubPipeline()
    instrument(inst, registry=CollectorRegistry())
    per: dict[str, list[float]] = {"bare": [], "inst": []}
    batch = 500
    for r in range(calls // batch):
        order = (("bare", bare), ("inst", inst)) if r % 2 == 0 else (("inst", inst), ("bare", bare))
        for name, pipe in order:
            t0 = time.perf_counter()
            for _ in range(batch):
                pipe("p", num_inference_steps=steps)
            per[name].append((time.perf_counter() - t0) / batch)
    request_us = (statistics.median(per["inst"]) - statistics.median(per["bare"])) * 1e6
    return {"request_us": round(request_us, 2), "per_step_us": round(request_us / steps, 2)}


def _ci(diffs: list[float], steps: int) -> tuple[float, float]:
    """95% bootstrap interval of the median paired difference, in us per step."""
    import random

    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(400))
    return meds[10] / steps * 1e6, meds[389] / steps * 1e6


def run_case(bare: Any, inst_pipe: Any, size: int, steps: int, rounds: int) -> dict[str, Any]:
    for p in (bare, inst_pipe):  # warm both
        _timed_call(p, size, steps, 0)
    totals: dict[str, list[float]] = {"bare": [], "inst": []}
    step_s: dict[str, list[float]] = {"bare": [], "inst": []}
    for r in range(rounds):
        order = (("bare", bare), ("inst", inst_pipe)) if r % 2 == 0 else (("inst", inst_pipe), ("bare", bare))
        for name, pipe in order:
            total, st = _timed_call(pipe, size, steps, r)
            totals[name].append(total)
            step_s[name].extend(st)
    tb, ti = statistics.median(totals["bare"]), statistics.median(totals["inst"])
    # Paired: each round's instrumented call minus its neighbouring bare call cancels drift.
    diffs = [i - b for i, b in zip(totals["inst"], totals["bare"], strict=True)]
    paired = statistics.median(diffs)
    lo, hi = _ci(diffs, steps)
    return {
        "shape": f"{size}x{size}_{steps}s",
        "step_ms_bare": round(statistics.median(step_s["bare"]) * 1e3, 4),
        "step_ms_instrumented": round(statistics.median(step_s["inst"]) * 1e3, 4),
        "overhead_us_per_step": round(paired / steps * 1e6, 2),
        "ratio": round(ti / tb, 4),
        "overhead_us_per_step_ci95": [round(lo, 1), round(hi, 1)],
        "request_ms_bare": round(tb * 1e3, 3),
        "request_ms_instrumented": round(ti * 1e3, 3),
        "rounds": rounds,
    }


def run(args: argparse.Namespace) -> int:
    import logging

    from prometheus_client import CollectorRegistry

    from stepwatch.exporter import instrument
    from stepwatch.service.cache import apply_cache
    from stepwatch.service.pipeline import build_pipeline

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    cases = []
    for c in args.cases:
        try:
            size_s, steps_s = c.lower().split("x")
            cases.append((int(size_s), int(steps_s)))
        except ValueError:
            print(f"bench overhead: bad case {c!r}; expected SIZExSTEPS like 256x4", file=sys.stderr)
            return 2
    print("building two identical practice pipelines (seed 0)...", file=sys.stderr)
    bare = build_pipeline("flux", seed=0)
    inst_pipe = build_pipeline("flux", seed=0)
    if args.cache != "none":
        apply_cache(bare, args.cache, 0.5)
        apply_cache(inst_pipe, args.cache, 0.5)
    instrument(inst_pipe, registry=CollectorRegistry())
    print("measuring the hooks' own cost on a stub pipeline (no compute)...", file=sys.stderr)
    hooks = hooks_cost()
    results = []
    print(f"{'shape':<16}{'step ms bare':>14}{'step ms instr':>15}{'us/step':>10}{'95% CI':>18}{'ratio':>9}")
    for size, steps in cases:
        rounds = args.rounds or (40 if size < 512 else 24)
        print(f"  running {size}x{size} x {steps} steps, {rounds} interleaved rounds...", file=sys.stderr)
        r = run_case(bare, inst_pipe, size, steps, rounds)
        results.append(r)
        ci = r["overhead_us_per_step_ci95"]
        print(f"{r['shape']:<16}{r['step_ms_bare']:>14.3f}{r['step_ms_instrumented']:>15.3f}"
              f"{r['overhead_us_per_step']:>10.1f}{f'[{ci[0]:.0f}, {ci[1]:.0f}]':>18}{r['ratio']:>9.4f}")
    print(f"hooks alone (stub pipeline, 4 steps): {hooks['request_us']:.1f} us per request, "
          f"{hooks['per_step_us']:.1f} us per step")
    print("target: ratio <= 1.01 and <= 20 us per step.  Wall-clock differences below the CI width are noise;"
          " the stub row is the precise host cost.")
    if args.json:
        keys = ("shape", "step_ms_bare", "step_ms_instrumented", "overhead_us_per_step", "ratio")
        print(json.dumps({
            "cases": [{k: r[k] for k in keys} | {"ci95": r["overhead_us_per_step_ci95"], "rounds": r["rounds"]}
                      for r in results],
            "hooks_only": hooks,
        }))
    return 0
