"""``stepwatch bench allocator``: process pairs with the worker's and glibc's malloc settings, a pooled ratio."""

from __future__ import annotations

import pytest

from stepwatch.bench import allocator


@pytest.mark.heavy
def test_a_few_rounds_give_a_ratio_and_its_interval_per_pair_and_pooled() -> None:
    res = allocator.compare("aa", pairs=2, rounds=4, size=64, steps=2)
    assert res["shape"] == "64x64_2s" and res["a"] == res["b"] == allocator.SETTINGS["worker"]
    assert len(res["within_pairs"]) == 2
    for w in res["within_pairs"]:
        lo, hi = w["interval"]
        assert 0.5 < lo <= w["ratio"] <= hi < 2.0
    lo, hi = res["interval"]
    assert lo <= res["ratio"] <= hi


def test_each_variant_names_real_settings_and_the_help_says_what_it_checks() -> None:
    import argparse

    assert set(allocator.VARIANTS) == {"worker", "aa", "known"}
    assert all(a in allocator.SETTINGS and b in allocator.SETTINGS for a, b in allocator.VARIANTS.values())
    p = argparse.ArgumentParser()
    allocator.add_arguments(p)
    args = p.parse_args(["--variant", "known", "--pairs", "2"])
    assert (args.variant, args.pairs, args.rounds, args.size, args.steps) == ("known", 2, 24, 512, 8)
    assert "must hold 1" in p.format_help() and "1.55-1.77x" in (allocator.__doc__ or "")
