"""StepwatchWorkerStalled's triage with ranks: the frozen rank is named, a hang with no culprit is still one.

The per-rank numbers are the ones a live two-rank service showed with rank 1 frozen by SIGSTOP for 30 s
mid-request (rank 0 waiting in its all-to-all): progress age 29.9 / 30.0 s, collective wait 29.9 s on rank 0,
and 0 on the silent rank 1.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import yaml

from stepwatch.alerts import rulegen
from stepwatch.promapi import Sample
from stepwatch.runbooks import parse
from stepwatch.thresholds import load
from stepwatch.triage.alert import Alert
from stepwatch.triage.engine import SYMPTOM_QUERY_PREFIX, Engine
from tests.conftest import need_tool

TH = load()
SVC = "127.0.0.1:8000"
Answer = list[Sample] | None


class ListProm:
    """Answers a query with the samples of the first rule whose pattern it matches (no match: none)."""

    url = "http://stub:9090"

    def __init__(self, rules: Sequence[tuple[str, Answer]]) -> None:
        self.rules = rules

    def query(self, expr: str, at: float | None = None) -> list[Sample]:
        if expr == "vector(1)" or expr.startswith(SYMPTOM_QUERY_PREFIX):  # the alert's own condition holds
            return [Sample({}, 1.0)]
        for pattern, value in self.rules:
            if re.search(pattern, expr, re.S):
                return list(value or [])
        return []


def _stall() -> Alert:
    spec = TH.alert("worker_stalled")
    return Alert(spec.name, {"alertname": spec.name, "job": "stepwatch-service", "instance": SVC, "pool": "small",
                             **rulegen.alert_labels(spec, "drill")},
                 rulegen.alert_annotations(TH, spec, "drill"), "2026-01-01T00:00:00Z")


def _world(ranks: int, stuck: dict[str, float], waiting: float) -> list[tuple[str, Answer]]:
    per_rank = [Sample({"rank": r}, v) for r, v in stuck.items()]
    return [(r"stepwatch_worker_up", [Sample({}, 1.0)]),
            (r"stepwatch_exporter_build_info", [Sample({}, 1.0)]),
            (r"count\(stepwatch_rank_steps_total", [Sample({}, float(ranks))] if ranks else None),
            (r"max by \(rank\)", per_rank),
            (r"min\(stepwatch_rank_collective_wait_seconds", [Sample({}, waiting)])]


def _diagnose(world: list[tuple[str, Answer]]) -> tuple[str | None, list[str], str]:
    report = Engine(ListProm(world), TH).run([_stall()])  # type: ignore[arg-type]
    d = report.incidents[0].primary
    evidence = {c.id: c.value_text() for c in d.checks}
    return report.incidents[0].cause, list(d.path), evidence.get("stuck_rank", "")


def test_the_frozen_rank_is_the_collective_hang_and_the_evidence_names_it() -> None:
    cause, path, stuck = _diagnose(_world(2, {"0": 0.0, "1": 30.0}, waiting=0.0))
    assert cause == "collective_hang" and path == ["alive", "answers", "ranks", "stuck_rank"]
    assert stuck.startswith("30 (rank=1)"), stuck


def test_every_rank_waiting_is_a_hang_with_no_single_culprit() -> None:
    cause, path, _ = _diagnose(_world(2, {"0": 0.2, "1": 0.3}, waiting=29.9))
    assert cause == "collective_hang" and path[-1] == "all_waiting"


def test_ranks_that_neither_wait_nor_fall_behind_leave_the_worker_itself() -> None:
    """Control: two ranks, both moving and none waiting: the worker's own plumbing, not a collective."""
    cause, path, _ = _diagnose(_world(2, {"0": 0.1, "1": 0.2}, waiting=0.0))
    assert cause == "worker_hung" and path[-1] == "all_waiting"


def test_ranks_all_slow_outside_collectives_blame_no_rank() -> None:
    """Both ranks 30 s from progress and neither waiting: the check's query returns nothing (no rank holds up
    another; see the promtool test below), so no rank is blamed and the walk ends at the worker itself."""
    report = Engine(ListProm(_world(2, {}, waiting=0.0)), TH).run([_stall()])
    d = report.incidents[0].primary
    assert report.incidents[0].cause == "worker_hung" and list(d.path)[-2:] == ["stuck_rank", "all_waiting"]
    assert {c.id: c.outcome for c in d.checks}["stuck_rank"] == "healthy"


def _series(age: Mapping[str, float], wait: Mapping[str, float]) -> list[dict[str, str]]:
    return [{"series": f'{name}{{instance="{SVC}",rank="{r}"}}', "values": str(v)}
            for name, vals in (("stepwatch_rank_progress_age_seconds", age),
                               ("stepwatch_rank_collective_wait_seconds", wait)) for r, v in vals.items()]


@pytest.mark.needs_tool("promtool")
def test_stuck_rank_query_blames_a_rank_only_while_another_waits(tmp_path: Path) -> None:
    """worker-stalled.md #4 as Prometheus evaluates it: the frozen rank when the other waits for it; nothing
    when every rank is slow outside collectives; under the line when every rank waits (check #5's case)."""
    check = parse.load_for_alert("StepwatchWorkerStalled").check("stuck_rank")
    expr = check.render({"instance": SVC}, TH, "drill")
    age = {"0": 30.0, "1": 30.0}
    worlds: list[tuple[dict[str, float], list[dict[str, object]]]] = [  # (wait per rank, expected samples)
        ({"0": 30.0, "1": 0.0}, [{"labels": '{rank="1"}', "value": 30}]),
        ({"0": 0.0, "1": 0.0}, []),
        ({"0": 29.5, "1": 29.5}, [{"labels": f'{{rank="{r}"}}', "value": 0.5} for r in "01"]),
    ]
    tests = [{"interval": "5s", "input_series": _series(age, wait),
              "promql_expr_test": [{"expr": expr, "eval_time": "0s", "exp_samples": want}]}
             for wait, want in worlds]
    (tmp_path / "t.yml").write_text(yaml.safe_dump({"rule_files": [], "tests": tests}))
    r = subprocess.run([need_tool("promtool"), "test", "rules", "t.yml"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_one_rank_is_the_worker_itself() -> None:
    cause, path, _ = _diagnose(_world(0, {}, waiting=0.0))
    assert cause == "worker_hung" and path == ["alive", "answers", "ranks", "cpu_starved"]
