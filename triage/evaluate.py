"""Score triage on recorded scenarios: replay each into a real Prometheus and compare with the expected cause.

Every scenario directory (triage/scenarios/<name>/: samples.om.gz and
scenario.yaml, see triage/record.py) is backfilled into a fresh TSDB with
promtool, served by a Prometheus on a free loopback port, and triaged at its
recorded evaluation time with the alerts Alertmanager sent then.  A fault
scenario is correct when the incident holding its alert names the expected
cause; a control (expected cause: none) is correct when no cause is named.
"""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from stepwatch.triage.engine import triage
from stepwatch.triage.render import terminal
from stepwatch.triage.replay import Replay, ReplayError


def default_scenarios() -> Path:
    return Path(__file__).resolve().parent / "scenarios"


def scenario_dirs(root: Path, only: list[str] | None = None) -> list[Path]:
    dirs = sorted(p.parent for p in root.glob("*/scenario.yaml"))
    return [d for d in dirs if not only or d.name in only]


def evaluate(scenario_dir: Path) -> dict[str, Any]:
    """Replay one scenario and triage it at its evaluation time."""
    t0 = time.time()
    try:
        with Replay(scenario_dir) as rp:
            sc = rp.scenario
            report = triage(rp.alerts(), rp.prom, at=rp.evaluated_at)
    except (ReplayError, OSError, subprocess.TimeoutExpired) as e:  # this case failed; the others still run
        return {"name": scenario_dir.name, "error": str(e), "correct": False, "expected": None, "got": None,
                "status": "error", "seconds": round(time.time() - t0, 1), "control": False}
    expected = sc.get("expected_cause")
    alert = sc.get("expected_alert")
    inc = report.incident_for(alert) if alert else None
    if inc is None and report.incidents:
        inc = report.incidents[0]
    got = inc.cause if inc else None
    control = expected is None
    correct = (not report.causes) if control else got == expected
    return {"name": scenario_dir.name, "expected": expected, "got": got, "all_causes": report.causes,
            "confidence": inc.confidence if inc else "none", "status": report.status, "correct": correct,
            "control": control, "alerts": [a.get("labels", {}).get("alertname") for a in rp.alerts()],
            "seconds": round(time.time() - t0, 1), "report": terminal(report)}


def evaluate_all(dirs: list[Path], jobs: int) -> list[dict[str, Any]]:
    """``evaluate`` over ``dirs``, ``jobs`` at once, in the order of ``dirs``."""
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        return list(pool.map(evaluate, dirs))
    finally:  # on SIGTERM or Ctrl-C: start no further replay, let the running ones stop their Prometheus
        pool.shutdown(wait=True, cancel_futures=True)


def table(results: list[dict[str, Any]], verbose_reports: bool = False) -> str:
    """One line per scenario: expected cause, what triage named, confidence, ok/XX, seconds."""
    lines = [f"{'scenario':<30}{'expected':<28}{'triage named':<28}{'conf':<8}{'':<4}s"]
    for r in results:
        exp = r["expected"] or "(none: control)"
        got = r["got"] or ("(all clear)" if r["status"] == "all_clear" else f"({r['status']})")
        if r["control"] and r.get("all_causes"):
            got = ",".join(r["all_causes"])
        mark = "ok" if r["correct"] else "XX"
        lines.append(f"{r['name']:<30}{exp:<28}{got:<28}{r.get('confidence', ''):<8}{mark:<4}{r['seconds']}"
                     + (f"  <- {r['error']}" if r.get("error") else ""))
        if verbose_reports and r.get("report"):
            lines += ["    " + line for line in r["report"].splitlines()]
    return "\n".join(lines)


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """{"cases", "correct", "accuracy", "false_causes_on_controls", "all_clear_during_fault"}."""
    cases = len(results)
    correct = sum(r["correct"] for r in results)
    return {
        "cases": cases,
        "correct": correct,
        "accuracy": round(correct / cases, 4) if cases else 0.0,
        "false_causes_on_controls": sum(1 for r in results if r["control"] and r.get("all_causes")),
        "all_clear_during_fault": sum(1 for r in results if not r["control"] and r["status"] == "all_clear"),
    }


def summary_line(results: list[dict[str, Any]], summary: dict[str, Any], seconds: float) -> str:
    cases, correct = summary["cases"], summary["correct"]
    controls = sum(r["control"] for r in results)
    failed = sum(r["status"] == "error" for r in results)
    return (f"accuracy {correct}/{cases} = {summary['accuracy']:.2f} ({cases - controls} faults, {controls} controls"
            + (f"; {failed} could not be replayed" if failed else "") + "); "
            f"false causes on controls: {summary['false_causes_on_controls']}; "
            f"all clear during a fault: {summary['all_clear_during_fault']}; {seconds:.0f}s")
