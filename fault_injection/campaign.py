"""A drill campaign: the chosen drills, one local stack per rank count, calibrated baselines, the report.

``stepwatch drill`` (cli_drill) and the scenario recorder (triage/record_drills) both
bring stacks up this way: drills that need two ranks run on a two-rank stack with
compile off, the others on one; each stack first calibrates per-shape baselines from
steady traffic, as a deployment's benchmark run would.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepwatch.alerts.thresholds import Thresholds
from stepwatch.fault_injection.criteria import Criteria
from stepwatch.fault_injection.criteria import load as load_criteria
from stepwatch.fault_injection.drills import (
    ALL_DRILLS,
    DRILLS,
    SEED_DRILLS,
    DrillResult,
    Runner,
    Triage,
    calibrate_baselines,
)
from stepwatch.fault_injection.report import write_report
from stepwatch.fault_injection.stack import LocalStack, StackUrls

# Sequence parallelism on CPU: compile off (each rank would compile), warm-up of the traffic shapes only.
MULTI_RANK_OVERRIDES: dict[str, Any] = {"compile": {"enabled": False}, "warmup": ["256x256", "512x512"]}


def expand(names: list[str]) -> list[str]:
    """Drill names with ``all`` and ``seeds`` expanded, duplicates dropped; an unknown name is a ValueError."""
    out: list[str] = []
    for n in names:
        if n == "all":
            out += list(ALL_DRILLS)
        elif n == "seeds":
            out += list(SEED_DRILLS)
        elif n in DRILLS:
            out.append(n)
        else:
            raise ValueError(f"unknown drill {n!r}; choose from {', '.join(ALL_DRILLS)}, seeds, all")
    return list(dict.fromkeys(out))


def by_ranks(names: list[str]) -> dict[int, list[str]]:
    """The drills grouped by the rank count their stack needs, in the order given."""
    out: dict[int, list[str]] = {}
    for n in names:
        out.setdefault(DRILLS[n].needs_ranks, []).append(n)
    return out


def make_stack(workdir: Path, ranks: int, *, compile_backend: str | None = None, attach: StackUrls | None = None,
               progress: Callable[[str], None] | None = None) -> LocalStack:
    overrides = dict(MULTI_RANK_OVERRIDES) if ranks > 1 else {}
    return LocalStack(workdir, ranks=ranks, service_overrides=overrides, compile_backend=compile_backend,
                      attach=attach, progress=progress)


def calibrate(stack: LocalStack, th: Thresholds, progress: Callable[[str], None],
              criteria: Criteria | None = None) -> None:
    """Per-shape baselines published to the service after the calibration time of the caller's steady traffic."""
    time.sleep((criteria or load_criteria()).calibration_s)
    calibrate_baselines(stack, progress, th)


def not_started(names: list[str], th: Thresholds, error: Exception) -> list[DrillResult]:
    """Failed results for drills whose stack did not come up."""
    out = []
    for n in names:
        d = DRILLS[n](th)
        r = DrillResult(n, d.expected, expected_cause=d.cause, service_survived=False)
        r.failures.append(f"stack did not come up: {error}")
        out.append(r)
    return out


@dataclass
class Campaign:
    """Runs drills stack by stack and writes the report after each stack (a later crash keeps the earlier)."""

    th: Thresholds
    out: Path
    progress: Callable[[str], None]
    triage: Triage | None = None
    compile_backend: str | None = None
    attach: StackUrls | None = None
    record_dir: Path | None = None
    snapshots: bool = True
    results: list[DrillResult] = field(default_factory=list)
    stacks: list[dict[str, Any]] = field(default_factory=list)

    def run(self, names: list[str]) -> Path:
        """Every drill in ``names``; the path of the final report."""
        for ranks, group in sorted(by_ranks(names).items()):
            self._run_group(ranks, group)
        return write_report(self.out, self.results, self.th, stack=None, snapshots=False,
                            progress=self.progress, stacks=self.stacks, keep_snapshots=True)

    def _run_group(self, ranks: int, group: list[str]) -> None:
        stack = make_stack(self.out / f"stack-{ranks}rank", ranks, compile_backend=self.compile_backend,
                           attach=self.attach, progress=self.progress)
        self.progress(f"bringing up the local stack ({ranks} rank{'s' if ranks > 1 else ''}) for {', '.join(group)}")
        try:
            stack.start()
        except Exception as e:
            self.progress(f"the stack did not come up: {e}")
            self.results += not_started(group, self.th, e)
            return
        try:
            runner = Runner(stack, self.th, self.progress, self.triage)
            runner.record_dir = self.record_dir
            self.progress("baseline traffic to calibrate per-shape baselines (step time, cache hit rate)")
            with stack.traffic(concurrency=2):
                calibrate(stack, self.th, self.progress)
            for n in group:
                self.results.append(runner.run(DRILLS[n](self.th)))
            self.stacks.append({"ranks": ranks, "service": stack.service_url, "prometheus": stack.prometheus_url,
                                "alertmanager": stack.alertmanager_url, "workdir": str(stack.workdir)})
            write_report(self.out, self.results, self.th, stack=stack, snapshots=self.snapshots,
                         progress=self.progress, stacks=self.stacks)
        finally:
            stack.stop()
