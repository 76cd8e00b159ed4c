"""The paired-ratio estimate every ``bench`` variant comparison reports, and when to stop measuring.

Measured on this 2-vCPU VM (2026-12-05, tiny FLUX 256^2 x 4, ~55 ms a call): one pair's instrumented/bare
ratio wanders with a standard deviation of 6-9% (neighbours on the host; no steal time, no hardware counters
to count instructions instead), so 160 pairs leave the estimate's standard error near 0.5%, half the 1% bar.
Three choices follow from it:

- **The estimate is the 20% trimmed mean of the paired log ratios** (exponentiated): as robust to a burst of
  contention as the median, and about 1.4x more efficient on these distributions (bootstrap standard errors of
  the median and the trimmed mean on the same nine runs: 0.40-0.87% vs 0.41-0.69%).
- **Its interval is a moving-block bootstrap** (blocks of two crossover blocks, so each resampled block has
  both pipelines on each side once): consecutive pairs share the host's weather, and resampling pairs one by
  one gives intervals too narrow (an A/A read 1.0107 [1.0038, 1.0183] that way).
- **Rounds run until the interval's half-width is under a precision** (0.4% by default) or a time budget is
  spent, after a minimum: the noise differs by host and by hour, so a fixed count is either wasted or short.
  The stop rule looks at the width only, never at the estimate, so it does not steer the answer.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

TRIM = 0.2
BOOTSTRAP_RESAMPLES = 400
PRECISION = 0.004  # the default half-width the benches measure to (--precision)
BUDGET_S = 300.0  # the default seconds a bench case may take before stopping short of it (--budget-s)


def trimmed_mean(values: list[float], trim: float = TRIM) -> float:
    """Mean of ``values`` with ``trim`` of them cut from each end."""
    ordered = sorted(values)
    k = int(len(ordered) * trim)
    return statistics.fmean(ordered[k:len(ordered) - k] or ordered)


def block_bootstrap(values: list[float], block: int, resamples: int = BOOTSTRAP_RESAMPLES,
                    seed: int = 0) -> tuple[float, float]:
    """95% interval of ``trimmed_mean(values)``, resampling runs of ``block`` consecutive values."""
    rng = random.Random(seed)
    blocks = [values[i:i + block] for i in range(0, len(values), max(1, block))]
    stats = sorted(trimmed_mean([v for b in rng.choices(blocks, k=len(blocks)) for v in b])
                   for _ in range(resamples))
    return stats[int(resamples * 0.025)], stats[int(resamples * 0.975) - 1]


def paired_ratio(inst: list[float], bare: list[float], block: int) -> tuple[float, tuple[float, float]]:
    """Instrumented over bare: exp of the trimmed mean of the paired log ratios, and its 95% interval."""
    logs = [math.log(i / b) for i, b in zip(inst, bare, strict=True)]
    lo, hi = block_bootstrap(logs, block)
    return math.exp(trimmed_mean(logs)), (math.exp(lo), math.exp(hi))


def paired_difference(inst: list[float], bare: list[float], block: int) -> tuple[float, tuple[float, float]]:
    """Instrumented minus bare, in the values' unit: trimmed mean of the paired differences and its interval."""
    diffs = [i - b for i, b in zip(inst, bare, strict=True)]
    return trimmed_mean(diffs), block_bootstrap(diffs, block)


@dataclass
class StopRule:
    """Measure at least ``min_rounds``; then stop once the ratio's 95% interval is within ``precision``
    of its estimate on each side (half-width, in ratio units) or ``budget_s`` has passed, whichever is first.
    ``max_rounds`` caps it for tests and for anyone who wants a fixed count (min = max).  ``progress`` hears
    each look (a line for stderr): a case can run for minutes."""

    min_rounds: int = 160
    max_rounds: int = 4000
    precision: float = PRECISION
    budget_s: float = BUDGET_S
    started: float = field(default_factory=time.monotonic)
    half_width: float = math.inf
    progress: Callable[[str], None] | None = None
    progress_every_s: float = 10.0
    _said_at: float = -math.inf

    @classmethod
    def of(cls, rounds: int, min_rounds: int, precision: float = PRECISION, budget_s: float = BUDGET_S,
           progress: Callable[[str], None] | None = None) -> StopRule:
        """The rule a bench's options ask for: ``rounds`` > 0 fixes the count; 0 runs from ``min_rounds``
        until ``precision`` or ``budget_s``."""
        if rounds:
            return cls(rounds, rounds, precision, math.inf)
        return cls(min_rounds, precision=precision, budget_s=budget_s, progress=progress)

    def done(self, inst: list[float], bare: list[float], block: int) -> bool:
        n = len(inst)
        if n >= self.max_rounds:
            return True
        if n < self.min_rounds:
            return False
        ratio, (lo, hi) = paired_ratio(inst, bare, block)
        self.half_width = (hi - lo) / 2
        elapsed = time.monotonic() - self.started
        if self.progress is not None and elapsed - self._said_at >= self.progress_every_s:
            self._said_at = elapsed
            self.progress(f"    {n} rounds, {elapsed:.0f} s: ratio {ratio:.4f} +-{self.half_width:.2%} "
                          f"(stops at +-{self.precision:.2%} or {self.budget_s:.0f} s)")
        return self.half_width <= self.precision or elapsed >= self.budget_s


# Student's t, 97.5th percentile, by degrees of freedom (a few processes give few degrees).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
         29: 2.045, 30: 2.042}


def pooled_ratio(ratios: list[float]) -> tuple[float, tuple[float, float]]:
    """One ratio from several processes' ratios, each a process of its own: the geometric mean and a
    t interval from their spread.  Within a process the interval can be tight while processes disagree
    (the FAR pipeline, 2026-12-05: 0.994 to 1.019 in fresh processes, each +-0.3-1%): memory layout
    differs per process, and how the instrumentation's allocations fall against the pipeline's is part of
    it, so the process is the unit that varies, and the interval has to come from across processes."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), (math.exp(mean), math.exp(mean))
    half = _T975.get(len(logs) - 1, 2.0) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), (math.exp(mean - half), math.exp(mean + half))


def paired_speedup(base: list[float], cand: list[float]) -> tuple[float, tuple[float, float]]:
    """Baseline over candidate seconds, item by item: the geometric mean of the paired ratios and a t interval.

    For the few pairs an evaluation has (4-20 items, not the benches' 160 and more rounds) the block bootstrap
    is far too narrow.  Measured on this VM (2026-12-08, tiny FLUX 64^2 x 8, 6 items in a sweep's rotation): an
    A/A 80 times left 1 outside the block bootstrap's interval 23 times and outside the t interval 4 times (5%
    is the promise); a known 4 ms cost per item (true speedup about 0.91) fell outside the t interval 1 time of
    40."""
    return pooled_ratio([b / c for b, c in zip(base, cand, strict=True)])
