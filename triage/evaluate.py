"""Score triage on recorded scenarios: replay each into a real Prometheus and compare with the expected cause.

Every scenario directory (triage/scenarios/<name>/: samples.om.gz and
scenario.yaml, see triage/record.py) is backfilled into a fresh TSDB with
promtool, served by a Prometheus on a free loopback port, and triaged at its
recorded evaluation time with the alerts Alertmanager sent then.  A fault
scenario is correct when the incident holding its expected alert names the
expected cause (no such incident: missed, never another incident's cause); a
control (expected cause: none) is correct when no cause is named.  The strict
scores over these cases (AC@1, AC@3, precision, the lookup baseline) are in
triage/scoring.py.
"""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from stepwatch.triage.engine import triage
from stepwatch.triage.incidents import Incident, Report
from stepwatch.triage.record import load_scenario
from stepwatch.triage.render import terminal
from stepwatch.triage.replay import Replay, ReplayError
from stepwatch.triage.scoring import headline


def default_scenarios() -> Path:
    return Path(__file__).resolve().parent / "scenarios"


def scenario_dirs(root: Path, only: list[str] | None = None) -> list[Path]:
    dirs = sorted(p.parent for p in root.glob("*/scenario.yaml"))
    return [d for d in dirs if not only or d.name in only]


def evaluate(scenario_dir: Path) -> dict[str, Any]:
    """Replay one scenario and triage it at its evaluation time (the fields: triage/scoring.py)."""
    t0 = time.time()
    try:
        with Replay(scenario_dir) as rp:
            sc = rp.scenario
            report = triage(rp.alerts(), rp.prom, at=rp.evaluated_at)
    except (ReplayError, OSError, subprocess.TimeoutExpired) as e:  # this case failed; the others still run
        return _failed(scenario_dir, str(e), round(time.time() - t0, 1))
    expected = sc.get("expected_cause")
    alert = sc.get("expected_alert")
    inc = report.incident_for(alert) if alert else None  # only its incident is scored: no fallback
    got = inc.cause if inc else None
    control = expected is None
    correct = (not report.causes) if control else got == expected
    return {"name": scenario_dir.name, "expected": expected, "alert": alert, "got": got,
            "ranked": ranked_causes(inc), "named": [[i.cause, i.confidence] for i in report.incidents if i.cause],
            "verdict": _verdict(report, inc), "all_causes": report.causes,
            "confidence": inc.confidence if inc else "none", "status": report.status, "correct": correct,
            "control": control, "alerts": [a.get("labels", {}).get("alertname") for a in rp.alerts()],
            "seconds": round(time.time() - t0, 1), "report": terminal(report)}


def ranked_causes(inc: Incident | None) -> list[str]:
    """The incident's causes in the engine's own order: its named cause, then its primary diagnosis's
    other candidates that some check supports (``engine.rank``'s score above 0), best first.

    Candidates with no evidence for them (score 0 or below) are left out: ``rank`` lists every
    cause a runbook can name, and counting those would make AC@3 a measure of runbook size.
    No cause named: [] (the case is missed at every k).
    """
    if inc is None or inc.cause is None:
        return []
    rest = [c.cause for c in inc.primary.candidates if c.score > 0 and c.cause != inc.cause]
    return [inc.cause, *rest]


def _verdict(report: Report, inc: Incident | None) -> str:
    """What triage said about the expected alert: "cause", "could_not_check" or "no_cause" (all clear)."""
    if inc is not None and inc.cause is not None:
        return "cause"
    if report.prometheus_error or (inc is not None and inc.could_not_check):
        return "could_not_check"
    return "no_cause"


def _failed(scenario_dir: Path, error: str, seconds: float) -> dict[str, Any]:
    """A case whose replay failed: it keeps its expected cause (when scenario.yaml reads) so it counts as missed."""
    try:
        sc = load_scenario(scenario_dir)
    except (OSError, yaml.YAMLError, TypeError):  # no readable scenario.yaml: neither fault nor control
        sc = {}
    expected = sc.get("expected_cause")
    return {"name": scenario_dir.name, "error": error, "correct": False, "expected": expected,
            "alert": sc.get("expected_alert"), "got": None, "ranked": [], "named": [], "verdict": "error",
            "status": "error", "seconds": seconds, "control": bool(sc) and expected is None}


def evaluate_all(dirs: list[Path], jobs: int) -> list[dict[str, Any]]:
    """``evaluate`` over ``dirs``, ``jobs`` at once, in the order of ``dirs``."""
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        return list(pool.map(evaluate, dirs))
    finally:  # on SIGTERM or Ctrl-C: start no further replay, let the running ones stop their Prometheus
        pool.shutdown(wait=True, cancel_futures=True)


def table(results: list[dict[str, Any]], verbose_reports: bool = False) -> str:
    """One line per scenario: expected cause, what triage named, confidence, ok/XX, seconds."""
    width = max([30, *(len(r["name"]) + 2 for r in results)])
    lines = [f"{'scenario':<{width}}{'expected':<28}{'triage named':<28}{'conf':<8}{'':<4}s"]
    for r in results:
        exp = r["expected"] or "(none: control)"
        quiet = "(all clear)" if r.get("status") == "all_clear" else "(no cause found)"
        got = r["got"] or {"no_cause": quiet, "could_not_check": "(could not check)"}.get(
            r.get("verdict", ""), f"({r['status']})")
        if r["control"] and r.get("all_causes"):
            got = ",".join(r["all_causes"])
        mark = "ok" if r["correct"] else "XX"
        lines.append(f"{r['name']:<{width}}{exp:<28}{got:<28}{r.get('confidence', ''):<8}{mark:<4}{r['seconds']}"
                     + (f"  <- {r['error']}" if r.get("error") else ""))
        if verbose_reports and r.get("report"):
            lines += ["    " + line for line in r["report"].splitlines()]
    return "\n".join(lines)


def correct_count(results: list[dict[str, Any]]) -> int:
    """Cases triage got right (the exit status: 0 only when every case is)."""
    return sum(bool(r["correct"]) for r in results)


def summary_line(results: list[dict[str, Any]], summary: dict[str, Any], seconds: float) -> str:
    cases, correct = summary["cases"], correct_count(results)
    controls = summary["controls"]
    failed = sum(r["status"] == "error" for r in results)
    return (f"correct {correct}/{cases} ({summary['faults']} faults, {controls} controls"
            + (f"; {failed} could not be replayed" if failed else "") + "); "
            f"false causes on controls: {summary['false_causes_on_controls']}; "
            f"all clear during a fault: {summary['all_clear_during_fault']}; {seconds:.0f}s\n"
            + headline(summary))
