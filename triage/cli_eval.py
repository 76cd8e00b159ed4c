"""``stepwatch triage eval``: score triage on recorded scenarios (the replay and scoring: triage/evaluate.py).

With --json the last line is one JSON object (the strict scores of issue 13, defined in
triage/scoring.py): {"cases", "faults", "controls", "ac1", "ac3", "strict_precision",
"false_causes_on_controls", "all_clear_during_fault", "lookup_baseline_ac1", "per_alert", "per_cause"}.
Exit status 0 when every case is correct, 1 otherwise, 2 when nothing could be replayed.  The
lookup baseline is reported, never an exit status: on a set where each alert has one cause it is
high by construction, and saying so is the point.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from stepwatch.procs import exit_on_sigterm
from stepwatch.triage.evaluate import correct_count, default_scenarios, evaluate_all, scenario_dirs, summary_line, table
from stepwatch.triage.scoring import alert_table, summarize


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenarios", default=None, metavar="DIR",
                   help="directory of scenario directories (default: the packaged triage/scenarios)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the scores")
    p.add_argument("--only", metavar="NAME", action="append", help="evaluate only these scenarios")
    p.add_argument("--jobs", type=int, default=2, help="scenarios replayed at once (default: %(default)s)")
    p.add_argument("--verbose-reports", action="store_true", help="print each scenario's triage report")


def run(args: argparse.Namespace) -> int:
    with exit_on_sigterm():  # a SIGTERM still stops the replays' Prometheus servers
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    root = Path(args.scenarios) if args.scenarios else default_scenarios()
    dirs = scenario_dirs(root, args.only)
    if not dirs:
        print(f"stepwatch triage eval: no scenarios (*/scenario.yaml) under {root}", file=sys.stderr)
        return 2
    t0 = time.time()
    results = evaluate_all(dirs, args.jobs)
    print(table(results, args.verbose_reports))
    failed = [r for r in results if r["status"] == "error"]
    if failed and len(failed) == len(results):
        msg = (f"stepwatch triage eval: no scenario could be replayed ({len(results)} of {len(results)} failed; "
               f"first: {failed[0]['name']}: {failed[0].get('error')}); nothing was scored")
        print(msg, file=sys.stderr)
        if args.json:
            print(json.dumps({"cases": len(results), "replayed": 0, "error": msg}))
        return 2
    summary = summarize(results)
    print("\n" + alert_table(summary))
    print("\n" + summary_line(results, summary, time.time() - t0))
    if args.json:
        print(json.dumps(summary))
    return 0 if correct_count(results) == len(results) else 1
