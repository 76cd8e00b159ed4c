"""Score triage on recorded scenarios: replay each into a real Prometheus and compare with the expected cause.

Every scenario directory (triage/scenarios/<name>/: samples.om.gz and
scenario.yaml, see triage/record.py) is backfilled into a fresh TSDB with
promtool, served by a Prometheus on a free loopback port, and triaged at its
recorded evaluation time with the alerts Alertmanager sent then.  A fault
scenario is correct when the incident holding its alert names the expected
cause; a control (expected cause: none) is correct when no cause is named.

With --json the last line is one JSON object:
{"cases", "correct", "accuracy", "false_causes_on_controls", "all_clear_during_fault"}.
Exit status 0 when every case is correct, 1 otherwise, 2 when nothing could be replayed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def default_scenarios() -> Path:
    return Path(__file__).resolve().parent / "scenarios"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenarios", default=None, metavar="DIR",
                   help="directory of scenario directories (default: the packaged triage/scenarios)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the scores")
    p.add_argument("--only", metavar="NAME", action="append", help="evaluate only these scenarios")
    p.add_argument("--jobs", type=int, default=2, help="scenarios replayed at once (default: %(default)s)")
    p.add_argument("--verbose-reports", action="store_true", help="print each scenario's triage report")


def scenario_dirs(root: Path, only: list[str] | None = None) -> list[Path]:
    dirs = sorted(p.parent for p in root.glob("*/scenario.yaml"))
    return [d for d in dirs if not only or d.name in only]


def evaluate(scenario_dir: Path) -> dict[str, Any]:
    """Replay one scenario and triage it at its evaluation time."""
    from stepwatch.triage.engine import triage
    from stepwatch.triage.render import terminal
    from stepwatch.triage.replay import Replay, ReplayError

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


def run(args: argparse.Namespace) -> int:
    from stepwatch.fault_injection.stack import exit_on_sigterm

    with exit_on_sigterm():  # a SIGTERM still stops the replays' Prometheus servers
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from concurrent.futures import ThreadPoolExecutor

    root = Path(args.scenarios) if args.scenarios else default_scenarios()
    dirs = scenario_dirs(root, args.only)
    if not dirs:
        print(f"stepwatch triage eval: no scenarios (*/scenario.yaml) under {root}", file=sys.stderr)
        return 2
    t0 = time.time()
    pool = ThreadPoolExecutor(max_workers=max(1, args.jobs))
    try:
        results = list(pool.map(evaluate, dirs))
    finally:  # on SIGTERM or Ctrl-C: start no further replay, let the running ones stop their Prometheus
        pool.shutdown(wait=True, cancel_futures=True)
    print(f"{'scenario':<30}{'expected':<28}{'triage named':<28}{'conf':<8}{'':<4}s")
    for r in results:
        exp = r["expected"] or "(none: control)"
        got = r["got"] or ("(all clear)" if r["status"] == "all_clear" else f"({r['status']})")
        if r["control"] and r.get("all_causes"):
            got = ",".join(r["all_causes"])
        mark = "ok" if r["correct"] else "XX"
        print(f"{r['name']:<30}{exp:<28}{got:<28}{r.get('confidence', ''):<8}{mark:<4}{r['seconds']}"
              + (f"  <- {r['error']}" if r.get("error") else ""))
        if args.verbose_reports and r.get("report"):
            print("\n".join("    " + line for line in r["report"].splitlines()))
    cases = len(results)
    failed = [r for r in results if r["status"] == "error"]
    if failed and len(failed) == cases:
        msg = (f"stepwatch triage eval: no scenario could be replayed ({cases} of {cases} failed; first: "
               f"{failed[0]['name']}: {failed[0].get('error')}); nothing was scored")
        print(msg, file=sys.stderr)
        if args.json:
            print(json.dumps({"cases": cases, "replayed": 0, "error": msg}))
        return 2
    correct = sum(r["correct"] for r in results)
    summary = {
        "cases": cases,
        "correct": correct,
        "accuracy": round(correct / cases, 4) if cases else 0.0,
        "false_causes_on_controls": sum(1 for r in results if r["control"] and r.get("all_causes")),
        "all_clear_during_fault": sum(1 for r in results if not r["control"] and r["status"] == "all_clear"),
    }
    controls = sum(r["control"] for r in results)
    print(f"\naccuracy {correct}/{cases} = {summary['accuracy']:.2f} ({cases - controls} faults, {controls} controls"
          + (f"; {len(failed)} could not be replayed" if failed else "") + "); "
          f"false causes on controls: {summary['false_causes_on_controls']}; "
          f"all clear during a fault: {summary['all_clear_during_fault']}; {time.time() - t0:.0f}s")
    if args.json:
        print(json.dumps(summary))
    return 0 if correct == cases else 1
