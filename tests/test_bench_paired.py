"""The paired estimate of bench overhead / bench stream (bench/paired.py): what it reads on synthetic pairs
whose answer is known, and when the crossover stops."""

from __future__ import annotations

import math
import random
from typing import Any

from stepwatch.bench.overhead import StubPipeline, crossover
from stepwatch.bench.paired import StopRule, paired_difference, paired_ratio, trimmed_mean


def _pairs(cost: float, n: int, seed: int = 1) -> tuple[list[float], list[float]]:
    """Pairs with this VM's noise shape: a drift both calls of a pair share, 7% independent noise per call, and
    a burst of contention (+60%) on one call in twenty; the instrumented call costs ``cost`` more."""
    rng = random.Random(seed)
    inst: list[float] = []
    bare: list[float] = []
    for r in range(n):
        drift = 1 + 0.2 * math.sin(r / 30)
        for out, extra in ((bare, 0.0), (inst, cost)):
            burst = 1.6 if rng.random() < 0.05 else 1.0
            out.append(0.05 * drift * (1 + extra) * math.exp(rng.gauss(0, 0.07)) * burst)
    return inst, bare


def test_the_trimmed_mean_ignores_a_burst() -> None:
    assert trimmed_mean([1.0] * 8 + [100.0, -100.0]) == 1.0
    assert trimmed_mean([2.0]) == 2.0


def test_an_a_a_reads_one_and_a_known_one_percent_reads_one_percent() -> None:
    inst, bare = _pairs(0.0, 2000)
    ratio, (lo, hi) = paired_ratio(inst, bare, block=16)
    assert lo <= 1.0 <= hi and abs(ratio - 1) < 0.005 and hi - lo < 0.012
    inst, bare = _pairs(0.01, 2000, seed=2)
    ratio, (lo, hi) = paired_ratio(inst, bare, block=16)
    assert lo <= 1.01 <= hi and lo > 1.0 and abs(ratio - 1.01) < 0.005
    diff, (dlo, dhi) = paired_difference(inst, bare, block=16)
    assert dlo <= diff <= dhi and 0 < diff < 0.001


def test_the_stop_rule_waits_for_its_minimum_then_for_the_precision() -> None:
    inst, bare = _pairs(0.0, 2000)
    rule = StopRule(min_rounds=160, max_rounds=4000, precision=0.006, budget_s=1e9)
    assert not rule.done(inst[:100], bare[:100], 16)  # under the minimum
    assert not rule.done(inst[:160], bare[:160], 16) and rule.half_width > 0.006  # too wide yet
    assert rule.done(inst, bare, 16) and rule.half_width <= 0.006
    assert StopRule(2, 2).done(inst[:2], bare[:2], 16)  # a fixed count
    assert StopRule(10, precision=1e-9, budget_s=0.0).done(inst[:10], bare[:10], 16)  # out of time


def test_the_crossover_asks_the_stop_rule_after_both_pipelines_sat_on_both_sides() -> None:
    pipes = (StubPipeline(), StubPipeline())
    asked: list[int] = []

    def stop(out: dict[str, list[Any]]) -> bool:
        asked.append(len(out["bare"]))
        return len(out["bare"]) >= 8

    out, _ = crossover(pipes, lambda p, r: pipes.index(p), rounds=100, block=2, stop=stop)
    assert asked == [4, 8] and len(out["bare"]) == len(out["inst"]) == 8
    assert out["inst"] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_a_registry_instrumented_and_let_go_is_freed() -> None:
    """bench's crossover instruments a fresh registry per swap: each must go with its instrumentation (a
    weak-keyed map of metric sets kept every one alive)."""
    import gc
    import weakref

    from prometheus_client import CollectorRegistry

    from stepwatch.exporter import instrument, uninstrument

    pipe = StubPipeline()
    registry = CollectorRegistry()
    instrument(pipe, registry=registry)
    pipe("p", num_inference_steps=2)
    uninstrument(pipe)
    gone = weakref.ref(registry)
    del registry
    gc.collect()
    assert gone() is None


def test_processes_that_disagree_widen_the_pooled_interval() -> None:
    from stepwatch.bench.paired import pooled_ratio

    ratio, (lo, hi) = pooled_ratio([1.0, 1.0, 1.0])
    assert ratio == lo == hi == 1.0
    ratio, (lo, hi) = pooled_ratio([0.994, 1.019, 1.0119, 1.0003])
    assert 1.005 < ratio < 1.007 and lo < 0.995 and hi > 1.017  # four processes, t with 3 degrees of freedom
    assert pooled_ratio([1.02])[1] == (1.02, 1.02)


def test_bench_stream_pools_its_processes(monkeypatch: Any, capsys: Any) -> None:
    """`bench stream --processes N`: each child's last JSON line, pooled; a failed child is left out and said."""
    import argparse
    import json

    from stepwatch.bench import stream as bench_stream

    runs = iter([{"ratio": 1.02, "ci95": [1.01, 1.03]}, None, {"ratio": 1.0, "ci95": [0.99, 1.01]}])
    base = {"chunk_ms_bare": 60.0, "chunk_ms_instrumented": 61.0, "hooks_us_per_chunk": 12.0, "rounds": 96,
            "chunks": 4, "steps_per_chunk": 4, "wall_diff_us_per_chunk": 500.0, "kv_bytes": 43008,
            "kv_ledger_bytes": 43008}

    def child(args: argparse.Namespace, k: int) -> dict[str, Any] | None:
        r = next(runs)
        return None if r is None else base | r

    monkeypatch.setattr(bench_stream, "_child", child)
    p = argparse.ArgumentParser()
    bench_stream.add_arguments(p)
    assert bench_stream.run(p.parse_args(["--processes", "3", "--json"])) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["processes"] == 2 and out["process_ratios"] == [1.02, 1.0]
    assert abs(out["ratio"] - math.sqrt(1.02)) < 1e-4 and out["ci95"][0] < 1.0 < 1.02 < out["ci95"][1]
    assert out["kv_bytes"] == out["kv_ledger_bytes"] == 43008
    assert bench_stream.run(p.parse_args(["--processes", "0"])) == 2


def test_each_round_calls_both_variants_at_one_depth_and_the_depths_cover_the_span() -> None:
    """CPython 3.11's data-stack chunks make a call's speed depend on the depth it starts at (bench.DEPTH_SPAN):
    both variants of a round must start at the same depth, and the rounds must cover the span evenly."""
    import inspect

    from stepwatch.bench.overhead import DEPTH_SPAN, at_depth, round_depth

    def frames() -> int:
        return len(inspect.stack(0))

    assert at_depth(37, frames) - at_depth(0, frames) == 37
    pipes = (StubPipeline(), StubPipeline())
    out, _ = crossover(pipes, lambda p, r: (r, len(inspect.stack(0))), rounds=24, block=4)
    first = out["bare"][0][1] - round_depth(0)
    for (r_bare, d_bare), (r_inst, d_inst) in zip(out["bare"], out["inst"], strict=True):
        assert r_bare == r_inst and d_bare == d_inst == first + round_depth(r_bare)  # one depth per round, its own
    depths = [round_depth(r) for r in range(300)]
    assert all(0 <= d < DEPTH_SPAN for d in depths)
    tenths = [sum(1 for d in depths if k * DEPTH_SPAN // 10 <= d < (k + 1) * DEPTH_SPAN // 10) for k in range(10)]
    assert min(tenths) >= 27 and max(tenths) <= 33, tenths  # within 10% of even in every tenth
    assert len(set(depths[:24])) == 24  # no depth repeats early
