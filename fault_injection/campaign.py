"""A drill campaign: the chosen drills, one local stack per kind of stack, calibrated baselines, the report.

``stepwatch drill`` (cli_drill) brings stacks up this way, and so does its ``--record`` (the triage
scenarios): drills that need two ranks run on a two-rank stack with compile off, the others on one; each
stack first calibrates per-shape baselines from steady traffic, as a deployment's benchmark run would.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepwatch.fault_injection.criteria import Criteria
from stepwatch.fault_injection.criteria import load as load_criteria
from stepwatch.fault_injection.drill import DrillResult
from stepwatch.fault_injection.phases import Phases
from stepwatch.fault_injection.recording import Recording, StackKey  # (ranks, compile backend or "", stream probe)
from stepwatch.fault_injection.registry import (
    ALL_DRILLS,
    DEMO_DRILLS,
    DRILLS,
    FLEET_DRILL_NAMES,
    RIVAL_DRILLS,
    SEED_DRILLS,
)
from stepwatch.fault_injection.report import write_report
from stepwatch.fault_injection.runner import Runner, Triage, calibrate_baselines
from stepwatch.fault_injection.stack import LocalStack, StackUrls
from stepwatch.thresholds import Thresholds

# Sequence parallelism on CPU: compile off (each rank would compile), warm-up of the traffic shapes only.
MULTI_RANK_OVERRIDES: dict[str, Any] = {"compile": {"enabled": False}, "warmup": ["256x256", "512x512"]}
GROUPS = {"all": ALL_DRILLS, "seeds": SEED_DRILLS, "rivals": RIVAL_DRILLS, "fleet": FLEET_DRILL_NAMES,
          "demo": DEMO_DRILLS}


def expand(names: list[str]) -> list[str]:
    """Drill names with the groups (``all``, ``seeds``, ``rivals``, ``fleet``, ``demo``) expanded, duplicates
    dropped; unknown: ValueError."""
    out: list[str] = []
    for n in names:
        if n in GROUPS:
            out += list(GROUPS[n])
        elif n in DRILLS:
            out.append(n)
        else:
            raise ValueError(f"unknown drill {n!r}; choose from {', '.join(ALL_DRILLS)}, {', '.join(GROUPS)}")
    return list(dict.fromkeys(out))


def by_stack(names: list[str], compile_backend: str | None = None) -> dict[StackKey, list[str]]:
    """The drills grouped by the stack they need (rank count, compile backend, stream probe), in the order given.

    Two-rank stacks run compile off whatever the backend (each rank would compile).  Drills that read the sidecar's
    stream probe get a stack of their own: the probe's sessions count in the service's stream series, and a probe
    session every few seconds beside another drill's CPU fault could stall streams that drill does not expect.
    """
    out: dict[StackKey, list[str]] = {}
    for n in sorted(names, key=lambda n: DRILLS[n].runs_last):  # stable: the given order, runs_last ones after
        ranks = DRILLS[n].needs_ranks
        out.setdefault((ranks, "" if ranks > 1 else compile_backend or "", DRILLS[n].stream_probe), []).append(n)
    return out


def make_stack(workdir: Path, ranks: int, *, compile_backend: str | None = None, attach: StackUrls | None = None,
               progress: Callable[[str], None] | None = None, stream_probe: bool = False) -> LocalStack:
    overrides = dict(MULTI_RANK_OVERRIDES) if ranks > 1 else {}
    return LocalStack(workdir, ranks=ranks, service_overrides=overrides, compile_backend=compile_backend,
                      attach=attach, progress=progress, stream_probe=stream_probe)


def calibrate(stack: LocalStack, th: Thresholds, progress: Callable[[str], None],
              criteria: Criteria | None = None) -> dict[str, Any]:
    """Per-shape baselines published to the service after the calibration time of the caller's steady traffic."""
    time.sleep((criteria or load_criteria()).calibration_s)
    return calibrate_baselines(stack, progress, th)


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
    """Runs drills stack by stack and writes the report after each stack (a later crash keeps the earlier).

    With ``record`` (``stepwatch drill ... --record DIR``), each stack also records its controls after
    calibration, and every drill is recorded as a triage scenario at the moment its alert fired
    (fault_injection/recording.py).
    """

    th: Thresholds
    out: Path
    progress: Callable[[str], None]
    triage: Triage | None = None
    compile_backend: str | None = None
    attach: StackUrls | None = None
    record: Recording | None = None
    snapshots: bool = True
    variant: int = 0  # which values of each fault (runbooks/drills.md variants): recordings vary them
    results: list[DrillResult] = field(default_factory=list)
    stacks: list[dict[str, Any]] = field(default_factory=list)
    phases: Phases | None = None

    def run(self, names: list[str]) -> Path:
        """Every drill in ``names``; the path of the final report."""
        fleet = [n for n in names if DRILLS[n].fleet]
        groups = sorted(by_stack([n for n in names if n not in fleet], self.compile_backend).items())
        self.phases = Phases.for_groups([(key[0], len(g)) for key, g in groups], len(fleet), self.progress)
        for key, group in groups:
            self._run_group(key, group)
        if fleet:
            self._run_fleet(fleet)
        return write_report(self.out, self.results, self.th, stack=None, snapshots=False,
                            progress=self.progress, stacks=self.stacks, keep_snapshots=True)

    def _run_group(self, key: StackKey, group: list[str]) -> None:
        ranks, backend, stream_probe = key
        where = f"stack-{ranks}rank" + ("-stream" if stream_probe else "")
        stack = make_stack(self.out / where, ranks, compile_backend=backend or None, attach=self.attach,
                           progress=self.progress, stream_probe=stream_probe)
        self._phase(f"the local stack ({ranks} rank{'s' if ranks > 1 else ''}{', ' + backend if backend else ''})")
        self.progress(f"bringing up the local stack ({ranks} rank{'s' if ranks > 1 else ''}"
                      f"{', ' + backend if backend else ''}) for {', '.join(group)}")
        try:
            stack.start()
        except Exception as e:
            self.progress(f"the stack did not come up: {e}")
            self.results += not_started(group, self.th, e)
            return
        try:
            runner = Runner(stack, self.th, self.progress, self.triage)
            runner.record = self.record
            runner.before_drill = self._phase
            if self.record is None and not any(DRILLS[n].reads_baselines for n in group):
                self.progress("no drill of this stack reads per-shape baselines: no calibration")
            else:
                self._calibrate(stack, key, runner)
            for n in group:
                self.results.append(runner.run(DRILLS[n](self.th, variant=self.variant)))
            self.stacks.append({"ranks": ranks, "backend": backend or None, "service": stack.service_url,
                                "prometheus": stack.prometheus_url, "alertmanager": stack.alertmanager_url,
                                "workdir": str(stack.workdir)})
            write_report(self.out, self.results, self.th, stack=stack, snapshots=self.snapshots,
                         progress=self.progress, stacks=self.stacks)
        finally:
            stack.stop()

    def _run_fleet(self, group: list[str]) -> None:
        """The fleet drills on one fleet start (its quality probers on from the first drill that reads them); with
        ``record``, a steady control of the fleet first, then each drill recorded from central evaluator a."""
        from stepwatch.fault_injection.fleet import FleetStack
        from stepwatch.fault_injection.fleet_drills import run_fleet_drills

        stack = FleetStack(self.out / "fleet", progress=self.progress)
        self._phase("the practice fleet")
        self.progress(f"bringing up the practice fleet for {', '.join(group)}")
        try:
            stack.start()
        except Exception as e:
            self.progress(f"the fleet did not come up: {e}")
            self.results += not_started(group, self.th, e)
            return
        try:
            if self.record is not None:
                with stack.traffic():
                    self.record.control(stack, self.progress, f"control-fleet-{self.record.suffix}",
                                        "steady traffic through the fleet's balancer")
            self.results += run_fleet_drills(stack, [DRILLS[n](self.th, variant=self.variant) for n in group],
                                             self.progress, self.triage, record=self.record,
                                             before_drill=self._phase)
            self.stacks.append({"fleet": True, "balancer": stack.balancer_url, "evaluators": stack.evaluators,
                                "alertmanagers": stack.alertmanagers, "workdir": str(stack.workdir)})
            write_report(self.out, self.results, self.th, stack=None, snapshots=False, progress=self.progress,
                         stacks=self.stacks)
        finally:
            stack.stop()

    def _phase(self, what: str) -> None:
        if self.phases is not None:
            self.phases.begin(what)

    def _calibrate(self, stack: LocalStack, key: StackKey, runner: Runner) -> None:
        """Per-shape baselines from steady traffic (and, when recording, the controls' windows)."""
        self.progress("baseline traffic to calibrate per-shape baselines (step time, cache hit rate)")
        with stack.traffic(concurrency=2):
            runner.baselines = calibrate(stack, self.th, self.progress)
            if self.record is not None:
                self.record.controls(stack, key, self.progress, runner.baselines)
                # The restarted service has run a control's window: measured again, for the drills (another
                # process of the same deployment may run at another speed on a shared host).
                runner.baselines = calibrate_baselines(stack, self.progress, self.th)
