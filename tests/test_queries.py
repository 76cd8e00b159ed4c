"""Every query the drills and the triage checks run names only series and labels the catalog has.

The rules and the dashboards are checked the same way (tests/test_alerts.py,
tests/test_dashboards.py); these are the other two places stepwatch sends PromQL.
The drills' queries are collected from ``fault_injection/queries.py``, and a scan of
the drill modules proves they run no other; the triage checks are the runbooks'
rendered for every alert and profile, plus the literal queries of the triage modules.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from stepwatch.alerts import promql, rulegen
from stepwatch.alerts.promql import agg, sel
from stepwatch.catalog import readable_names
from stepwatch.fault_injection import queries
from stepwatch.runbooks import parse
from stepwatch.thresholds import PROFILES, Thresholds, load
from tests.test_runbooks import EXAMPLE_LABELS  # one set of example label values

ROOT = Path(__file__).resolve().parent.parent
QUERY_METHODS = {"query", "value", "query_range"}  # the Prometheus client's methods that take PromQL


@pytest.fixture(scope="module")
def th() -> Thresholds:
    return load()


def _known(th: Thresholds) -> set[str]:
    return readable_names() | rulegen.recorded_names(th)


def problems(where: str, query: str, known: set[str]) -> list[str]:
    """What is wrong with one query: unknown series, labels a series cannot carry, or no series at all."""
    names = promql.metric_names(query)
    out = [f"{where}: selects no series: {query}"] if not names else []
    out += [f"{where}: unknown series {n}" for n in sorted(names - known)]
    for name, labels in promql.selector_labels(query).items():
        can = promql.known_labels(name)
        if can is not None and not labels <= can:
            out.append(f"{where}: {name} has no label {sorted(labels - can)}")
    return out


def _all_problems(named: Iterable[tuple[str, str]], known: set[str]) -> list[str]:
    return [p for where, q in named for p in problems(where, q, known)]


# ----- the drills ---------------------------------------------------------------------------------

def drill_queries(th: Thresholds) -> list[tuple[str, str]]:
    """(where, PromQL) for every query the drills run, in every profile's rate window."""
    return [(f"drill {name} ({p})", q) for p in PROFILES
            for name, q in queries.drill_queries(th.profiles[p].rate_window).items()]


def test_drill_queries_name_only_series_that_exist(th: Thresholds) -> None:
    collected = drill_queries(th)
    assert len(collected) >= 2 * 9
    assert _all_problems(collected, _known(th)) == []


def _prom_calls(path: Path) -> list[ast.Call]:
    """Calls of ``<something>.query/value/query_range(...)`` in a module (the PromQL they send is args[0])."""
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in QUERY_METHODS and n.args]


def _sample_args(fn: Callable[..., str], window: str) -> list[tuple[object, ...]]:
    """Argument tuples to call a query function with: the window, each latency quantile for ``q``, an alert."""
    params = list(inspect.signature(fn).parameters)
    choices = {"window": [window], "q": list(queries.LATENCY_QUANTILES.values()), "alertname": ["StepwatchTargetDown"]}
    combos: list[tuple[object, ...]] = [()]
    for p in params:
        combos = [(*c, v) for c in combos for v in choices[p]]
    return combos


def _queries_function(arg: ast.expr) -> str | None:
    """``x`` when the argument is a call ``queries.x(...)``, else None."""
    if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and isinstance(arg.func.value, ast.Name):
        return arg.func.attr if arg.func.value.id == "queries" else None
    return None


def test_the_drills_run_no_query_outside_queries_py(th: Thresholds) -> None:
    """Each PromQL argument in fault_injection is a call of a query function whose output is collected."""
    window = th.profiles["drill"].rate_window
    collected = set(queries.drill_queries(window).values()) | set(queries.cardinality_queries().values())
    used = 0
    for path in sorted((ROOT / "fault_injection").glob("*.py")):
        if path.name == "queries.py":
            continue
        for call in _prom_calls(path):
            name = _queries_function(call.args[0])
            assert name, f"{path.name}:{call.lineno}: a query not built by fault_injection/queries.py"
            fn = getattr(queries, name)
            for args in _sample_args(fn, window):
                assert fn(*args) in collected, f"{path.name}:{call.lineno}: queries.{name} not collected"
            used += 1
    assert used >= 8  # the scan sees the drills' queries (a renamed client method would hide them)


def test_a_misspelled_drill_query_is_caught(th: Thresholds, monkeypatch: pytest.MonkeyPatch) -> None:
    known = _known(th)
    assert problems("x", promql.mean_step_time("1m").replace("step_duration", "stepp_duration"), known) == [
        "x: unknown series stepwatch_pipeline_stepp_duration_seconds_count",
        "x: unknown series stepwatch_pipeline_stepp_duration_seconds_sum"]
    assert problems("x", agg("min", sel("stepwatch_quality_psnr_decibels", 'quantil="p10"')), known) == [
        "x: stepwatch_quality_psnr_decibels has no label ['quantil']"]
    monkeypatch.setattr(queries, "estimated_wait", lambda: agg("max", "stepwatch_queue_estimated_wait_second"))
    found = _all_problems(drill_queries(th), known)
    assert found and all("stepwatch_queue_estimated_wait_second" in p for p in found)


# ----- the triage checks --------------------------------------------------------------------------

def triage_queries(th: Thresholds) -> list[tuple[str, str]]:
    """(where, PromQL) for every runbook check in every profile, and each literal query of the triage modules."""
    out = [(f"{spec.name} check {c.id} ({p})", c.render(EXAMPLE_LABELS, th, p))
           for spec in th.alerts.values() for c in parse.load_for_alert(spec.name).checks for p in PROFILES]
    for path in sorted((ROOT / "triage").glob("*.py")):
        for call in _prom_calls(path):
            text = _literal(call.args[0])
            if text is not None:
                out.append((f"{path.name}:{call.lineno}", text))
    return out


def _literal(arg: ast.expr) -> str | None:
    """A string or f-string argument as text (f-string fields left empty), else None (a variable)."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr):
        return "".join(v.value for v in arg.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return None


def test_triage_queries_name_only_series_that_exist(th: Thresholds) -> None:
    collected = triage_queries(th)
    checks = sum(len(parse.load_for_alert(a.name).checks) for a in th.alerts.values())
    assert len(collected) > checks * len(PROFILES)  # the engine's own queries are in too
    found = [p for p in _all_problems(collected, _known(th)) if "selects no series: vector(1)" not in p]
    assert found == []


def test_a_misspelled_triage_query_is_caught(th: Thresholds) -> None:
    rb = parse.load_for_alert(th.alert("rank_skew").name)
    q = rb.checks[0].render(EXAMPLE_LABELS, th, "drill")
    names = promql.metric_names(q)
    assert names
    wrong = q.replace(sorted(names)[0], sorted(names)[0] + "x")
    assert f"x: unknown series {sorted(names)[0]}x" in problems("x", wrong, _known(th))
