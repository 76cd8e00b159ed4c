"""Instrumentation overhead, measured (``stepwatch bench overhead``; see cli_overhead for the method).

The stub pipeline isolates the hooks' own host cost; ``run_case`` measures a real
pipeline bare and instrumented, interleaved and paired so drift cancels.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from stepwatch.bench.paired import StopRule, paired_difference, paired_ratio
from stepwatch.exporter import instrument
from stepwatch.service.cache import apply_cache
from stepwatch.service.pipeline import build_pipeline


@dataclass(frozen=True)
class RealCase:
    """One row of the real-pipeline table: the tiny FLUX pipeline at a shape and configuration."""

    size: int
    steps: int
    cfg: bool = False  # true CFG: a negative prompt and true_cfg_scale 2, two transformer calls per step
    cache: str = "none"  # the cross-step cache on both variants (threshold 0.5)

    @property
    def shape(self) -> str:
        return f"{self.size}x{self.size}_{self.steps}s" + ("_cfg" if self.cfg else "")


# The smallest and a large shape, a distilled model's serving shape (4 steps, no CFG, 512^2 like
# FLUX-schnell's cheapest useful size), and FirstBlockCache with true CFG (its readers run every step).
REAL_CASES = {"small": RealCase(256, 4), "large": RealCase(1024, 4), "few_step": RealCase(512, 4),
              "fbc_cfg2": RealCase(256, 8, cfg=True, cache="first_block_cache")}
DEFAULT_CASES = tuple(REAL_CASES)


def _timed_call(pipe: Any, case: RealCase, seed: int) -> tuple[float, list[float]]:
    marks: list[float] = []

    def on_step(_pipe: Any, _i: int, _t: Any, kw: dict[str, Any]) -> dict[str, Any]:
        marks.append(time.perf_counter())
        return kw

    extra: dict[str, Any] = {"negative_prompt": "w7 w8", "true_cfg_scale": 2.0} if case.cfg else {}
    t0 = time.perf_counter()
    pipe("w1 w2 w3", height=case.size, width=case.size, num_inference_steps=case.steps, max_sequence_length=32,
         output_type="np", generator=torch.Generator().manual_seed(seed), callback_on_step_end=on_step, **extra)
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


class _CacheState:
    """One branch's state as diffusers' FirstBlockCache keeps it (``should_compute``)."""

    __slots__ = ("should_compute",)

    def __init__(self) -> None:
        self.should_compute = True


class _StubBlock:
    """A first transformer block carrying a FirstBlockCache leader hook, as diffusers registers it."""

    def __init__(self, branches: tuple[str, ...]) -> None:
        self.states = {b: _CacheState() for b in branches}
        manager = type("StateManager", (), {"_state_cache": self.states})()
        hook = type("FBCHook", (), {"state_manager": manager})()
        self._diffusers_hook = type("HookRegistry", (), {"hooks": {"fbc_leader_block_hook": hook}})()

    def modules(self) -> Any:
        return iter((self,))


class _StubTransformer:
    """Enough of a diffusers transformer for the hooks: cache_context, a block list and, with ``cache``, a
    FirstBlockCache whose decision alternates in the middle steps (first and last computed, as real caches do)."""

    def __init__(self, branches: tuple[str, ...] = ("cond",), cache: bool = False) -> None:
        self._modules: dict[str, Any] = {}
        self._block = _StubBlock(branches) if cache else None
        if self._block is not None:
            self._modules["transformer_blocks"] = [self._block]
        self._branch = "cond"
        self.step_index = 0
        self.steps = 0

    @property
    def transformer_blocks(self) -> list[Any]:
        return self._modules.get("transformer_blocks", [])

    def modules(self) -> Any:
        return iter((self, *self.transformer_blocks))

    def named_children(self) -> Any:
        return iter(())

    def named_modules(self) -> Any:
        return iter(())

    def cache_context(self, name: str) -> Any:
        self._branch = name
        return contextlib.nullcontext()

    def __call__(self, hidden_states: Any) -> Any:
        if self._block is not None:
            i = self.step_index
            self._block.states[self._branch].should_compute = i in (0, self.steps - 1) or i % 2 == 0
        return hidden_states


class _Latents:
    """What a transformer call receives, as far as the hooks look: its shape (batch, tokens, channels)."""

    __slots__ = ("shape",)

    def __init__(self, batch: int) -> None:
        self.shape = (batch, 256, 64)


class _StubVae:
    def decode(self, x: Any) -> Any:
        return x


class StubPipeline:
    """The call structure of a diffusers pipeline with no compute: isolates the hooks' own cost.

    ``branches`` transformer calls per step (2: CFG's cond and uncond), each under its own cache_context;
    ``cache`` puts a FirstBlockCache leader hook on the first block, so the exporter reads its decisions."""

    default_sample_size = 128
    vae_scale_factor = 8

    def __init__(self, branches: int = 1, cache: bool = False) -> None:
        self.scheduler = _StubScheduler()
        self.transformer = _StubTransformer(("cond", "uncond")[:branches], cache)
        self.vae = _StubVae()
        self.device = "cpu"
        self._branches = ("cond", "uncond")[:branches]

    def encode_prompt(self, prompt: str) -> str:
        return prompt

    def latents(self) -> Any:
        """One prompt's latents: each call holds one branch."""
        return _Latents(1)

    def __call__(self, prompt: str, height: int = 256, width: int = 256, num_inference_steps: int = 4) -> Any:
        self.encode_prompt(prompt)
        self.scheduler.set_timesteps(num_inference_steps)
        t = self.transformer
        t.steps = num_inference_steps
        x = self.latents()
        for i in self.scheduler.timesteps:
            t.step_index = i
            for b in self._branches:
                with t.cache_context(b):
                    x = t(hidden_states=x)
            x = self.scheduler.step(x)
        return self.vae.decode(x)


# name -> (steps, CFG branches, FirstBlockCache): plain FLUX-dev serving, FBC with true CFG, a distilled model.
STUB_CASES = {"plain": (28, 1, False), "fbc_cfg2": (28, 2, True), "few_step": (4, 1, False)}


def _low(values: list[float]) -> float:
    """The 10th percentile: what the code costs when nothing else on the host is in the way."""
    return statistics.quantiles(values, n=10)[0] if len(values) >= 10 else min(values)


def _overhead_us(bare: Any, inst: Any, steps: int, calls: int) -> float:
    """Instrumented minus bare request time (us) from batches interleaved so drift cancels: the 10th
    percentile of each side's batch times, because the stub does the same pure-Python work every time and
    a neighbour on the host only adds to it (five runs on this VM, fbc_cfg2 per step: medians 1.9-4.9 us,
    10th percentiles 2.4-2.7)."""
    per: dict[str, list[float]] = {"bare": [], "inst": []}
    batch = 100
    for r in range(max(2, calls // batch)):
        order = (("bare", bare), ("inst", inst)) if r % 2 == 0 else (("inst", inst), ("bare", bare))
        for name, pipe in order:
            t0 = time.perf_counter()
            for _ in range(batch):
                pipe("p", num_inference_steps=steps)
            per[name].append((time.perf_counter() - t0) / batch)
    return (_low(per["inst"]) - _low(per["bare"])) * 1e6


def hooks_cost(steps: int = 4, calls: int = 20000, branches: int = 1, cache: bool = False) -> dict[str, float]:
    """Per-request host cost of the hooks at ``steps`` (bare vs instrumented stub), and that over steps."""
    bare, inst = StubPipeline(branches, cache), StubPipeline(branches, cache)
    instrument(inst, registry=CollectorRegistry())
    for p in (bare, inst):
        p("p", num_inference_steps=steps)
    request_us = _overhead_us(bare, inst, steps, calls)
    return {"request_us": round(request_us, 2), "per_step_us": round(request_us / steps, 2)}


def stub_case(name: str, calls: int = 6000) -> dict[str, Any]:
    """One STUB_CASES row: the hooks' cost per step (the slope between a short and a long request of the
    case's configuration, so per-request work does not count), the fixed cost per request, and the whole
    overhead of a request of the case's own length spread over its steps."""
    steps, branches, cache = STUB_CASES[name]
    bare, inst = StubPipeline(branches, cache), StubPipeline(branches, cache)
    instrument(inst, registry=CollectorRegistry())
    lo, hi = 4, 68  # a long lever: the slope of two noisy medians, over 64 steps rather than 32
    for p in (bare, inst):
        p("p", num_inference_steps=hi)
    d_lo, d_hi = _overhead_us(bare, inst, lo, calls), _overhead_us(bare, inst, hi, calls // 4)
    per_step = (d_hi - d_lo) / (hi - lo)
    fixed = d_lo - lo * per_step
    own = _overhead_us(bare, inst, steps, calls if steps <= lo else calls // 4)
    return {"steps": steps, "branches": branches, "cache": "first_block_cache" if cache else "none",
            "per_step_us": round(per_step, 2), "request_fixed_us": round(fixed, 1),
            "request_us": round(own, 1), "request_us_per_step": round(own / steps, 2)}


def _ci(values: list[float]) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``values`` (bench/ranks.py's rows; the paired rows use paired.py)."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(400))
    return meds[10], meds[389]


Sides = tuple[Callable[[Any], Any], Callable[[Any], Any]]


def _instrument_fresh(pipe: Any) -> Any:
    return instrument(pipe, registry=CollectorRegistry())


# How deep below the bench's own frames each round calls the pipelines, drawn per round (both sides alike).
# CPython 3.11 keeps frames in 16 KB data-stack chunks and frees a chunk as soon as the stack leaves it; a call
# tree that loops across a chunk boundary pays an mmap, a page fault and a munmap at every crossing
# (python/cpython#142183, fixed from 3.13 on by keeping one spare chunk).  Measured on the FAR pipeline: 227 to
# 4,518 page faults per call and 164-192 ms depending only on the depth it was called at, and the hooks' wrapper
# frames move that phase: a fixed depth made each launcher a "mode" (bench stream read 1.04 from `-m
# stepwatch.cli`, 1.01 from `-c`).  Spread evenly over about two chunks' worth of frames (a golden-ratio
# sequence: any run of rounds covers the span nearly uniformly), every round samples the phase afresh and both
# variants see the same distribution of it.
DEPTH_SPAN = 300
_GOLDEN = 0.6180339887498949


def round_depth(r: int) -> int:
    """Round ``r``'s depth: the golden-ratio sequence over ``DEPTH_SPAN`` (even coverage, no generator state)."""
    return int((r * _GOLDEN) % 1.0 * DEPTH_SPAN)


def at_depth(depth: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` called ``depth`` Python frames further down the stack (each frame a few words of data stack)."""
    return fn() if depth <= 0 else at_depth(depth - 1, fn)


def crossover(pipes: tuple[Any, Any], call: Any, rounds: int, block: int = 8, progress: Any = None,
              stop: Callable[[dict[str, list[Any]]], bool] | None = None,
              sides: Sides | None = None) -> tuple[dict[str, list[Any]], Any]:
    """Paired bare/instrumented calls of ``call(pipe, round)`` on two pipelines built alike, the instrumented one
    swapped every ``block`` rounds; returns {"bare": [...], "inst": [...]} of call results and the last handle.

    Each round calls both variants at one depth, ``round_depth(r)`` (why: above ``DEPTH_SPAN``).
    Two pipelines built alike are not equally fast on a shared VM (an A/A of two bare FAR pipelines read 0.95-0.99;
    the FLUX few-step case read 1.02 over 48 rounds with hooks costing microseconds), so each one spends half the
    rounds on each side (a crossover) and that difference cancels.  Within a round the order alternates (drift
    cancels in each pair); after each swap one discarded call per side pays the first-call costs.  ``rounds``
    is the most it runs; ``stop(out)`` is asked after every two blocks (both pipelines once on each side).
    ``sides`` = (turn on, turn off) replaces instrument/uninstrument: the calibration arms use it.
    """
    from stepwatch.exporter import uninstrument

    turn_on, turn_off = sides or (_instrument_fresh, uninstrument)
    out: dict[str, list[Any]] = {"bare": [], "inst": []}
    handle: Any = None
    side = 0
    for r in range(rounds):
        if r % block == 0:
            if stop is not None and r and r % (2 * block) == 0 and stop(out):
                break
            side = (r // block) % 2
            turn_off(pipes[1 - side])
            handle = turn_on(pipes[side])
            for p in pipes:
                call(p, r)
        named = (("bare", pipes[1 - side]), ("inst", pipes[side]))
        depth = round_depth(r)
        for name, pipe in named if r % 2 == 0 else named[::-1]:
            out[name].append(at_depth(depth, functools.partial(call, pipe, r)))
        if progress is not None:
            progress(r, out)
    return out, handle


def _stop_on_totals(rule: StopRule | None, block: int) -> Callable[[dict[str, list[Any]]], bool] | None:
    """The stop rule asked of (total, steps) call results."""
    if rule is None:
        return None
    return lambda out: rule.done([t for t, _ in out["inst"]], [t for t, _ in out["bare"]], 2 * block)


def summarize(case: RealCase, calls: dict[str, list[tuple[float, list[float]]]], block: int) -> dict[str, Any]:
    """One row of the real-pipeline table from the paired calls (paired.py says why these statistics)."""
    steps = case.steps
    totals = {k: [t for t, _ in v] for k, v in calls.items()}
    step_s = {k: [s for _, st in v for s in st] for k, v in calls.items()}
    diff, (lo, hi) = paired_difference(totals["inst"], totals["bare"], 2 * block)
    ratio, (ratio_lo, ratio_hi) = paired_ratio(totals["inst"], totals["bare"], 2 * block)
    return {
        "shape": case.shape,
        "step_ms_bare": round(statistics.median(step_s["bare"]) * 1e3, 4),
        "step_ms_instrumented": round(statistics.median(step_s["inst"]) * 1e3, 4),
        "overhead_us_per_step": round(diff / steps * 1e6, 2),
        "ratio": round(ratio, 4),
        "overhead_us_per_step_ci95": [round(lo / steps * 1e6, 1), round(hi / steps * 1e6, 1)],
        "ratio_ci95": [round(ratio_lo, 4), round(ratio_hi, 4)],
        "request_ms_bare": round(statistics.median(totals["bare"]) * 1e3, 3),
        "request_ms_instrumented": round(statistics.median(totals["inst"]) * 1e3, 3),
        "rounds": len(totals["bare"]),
    }


def run_case(pipes: tuple[Any, Any], case: RealCase, rounds: int, stop: StopRule | None = None,
             block: int = 8) -> dict[str, Any]:
    """Bare vs instrumented calls of ``case``: ``rounds`` of them, or as many as ``stop`` asks for."""
    cap = stop.max_rounds if stop is not None else rounds
    calls, _ = crossover(pipes, lambda p, r: _timed_call(p, case, r), cap, block, stop=_stop_on_totals(stop, block))
    return summarize(case, calls, block)


KNOWN_COST = 0.01  # the calibration's busy-wait, as a fraction of the call it follows


def calibrate(pipes: tuple[Any, Any], case: RealCase, stop: StopRule, block: int = 8) -> dict[str, Any]:
    """The estimator asked two questions whose answers are known, on the same pipelines and host: an A/A (the
    "instrumented" side is bare too: the ratio must read 1 within its interval) and a known cost (that side
    busy-waits 1% of its own call's time after each call: it must read about 1.01; a fixed burn read 1.006
    once, being 1% of a quick moment's median).  A bench whose A/A drifts or whose 1% reads 1.00 cannot tell
    1.01 from 1.00 either."""
    from stepwatch.exporter import uninstrument

    for p in pipes:
        uninstrument(p)
    marked: list[Any] = [None]

    def mark(pipe: Any) -> None:
        marked[0] = pipe

    def burning(pipe: Any, r: int) -> tuple[float, list[float]]:
        t0 = time.perf_counter()
        _, steps = _timed_call(pipe, case, r)
        if pipe is marked[0]:
            end = time.perf_counter() + KNOWN_COST * (time.perf_counter() - t0)
            while time.perf_counter() < end:
                pass
        return time.perf_counter() - t0, steps

    rows = {}
    for name, call, sides in (("aa", lambda p, r: _timed_call(p, case, r), (mark, mark)),
                              ("known_1pct", burning, (mark, lambda p: None))):
        rule = StopRule(stop.min_rounds, stop.max_rounds, stop.precision, stop.budget_s, progress=stop.progress)
        calls, _ = crossover(pipes, call, rule.max_rounds, block, stop=_stop_on_totals(rule, block), sides=sides)
        rows[name] = summarize(case, calls, block)
    return {"known_cost": KNOWN_COST} | rows


def parse_case(case: str) -> tuple[str, RealCase]:
    """A REAL_CASES name, or ``SIZExSTEPS`` (e.g. ``256x4``: plain, no CFG, no cache) -> (name, case);
    ValueError naming the expected forms."""
    if case in REAL_CASES:
        return case, REAL_CASES[case]
    try:
        size_s, steps_s = case.lower().split("x")
        size, steps = int(size_s), int(steps_s)
    except ValueError:
        raise ValueError(f"bad case {case!r}; expected one of {', '.join(REAL_CASES)} or SIZExSTEPS like 256x4") \
            from None
    if size < 64 or size % 16 or steps < 1:
        raise ValueError(f"bad case {case!r}: the size must be a multiple of 16 from 64, steps at least 1")
    return case, RealCase(size, steps)


def default_rounds(size: int) -> int:
    """Enough pairs for a ratio interval near the 1% bar where a request takes milliseconds."""
    return 160 if size <= 512 else 24


def pipelines(cache: str = "none") -> tuple[Any, Any]:
    """Two identical practice pipelines (seed 0), ``cache`` on both unless "none"; ``crossover`` instruments
    one side at a time."""
    pair = build_pipeline("flux", seed=0), build_pipeline("flux", seed=0)
    if cache != "none":
        for p in pair:
            apply_cache(p, cache, 0.5)
    return pair
