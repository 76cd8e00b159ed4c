"""``stepwatch triage false-alarms``: every alert presented as firing on quiet recordings (triage/false_alarms.py).

Writes one scenario per alert, ``false-alarm-<alert>-<control>``, that replays the control's samples
with that alert in the notification; ``stepwatch triage eval`` scores them as controls (correct: no
cause named).  Rank skew and the stall alert are presented on the two-rank control when one is given.
``--missing`` writes only the alerts that have none under --out yet; without --control it presents
them on the quiet recordings the committed false alarms replay most.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stepwatch.alerts.defs import ALERTS
from stepwatch.procs import exit_on_sigterm
from stepwatch.thresholds import load
from stepwatch.triage.false_alarms import TWO_RANK_ALERTS, missing_keys, usual_controls, write_false_alarms
from stepwatch.triage.record import load_scenario


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--control", action="append", metavar="DIR",
                   help="a recorded control scenario (repeat: one-rank and two-rank); with --missing, default: "
                        "the ones the false alarms under --out replay most")
    p.add_argument("--out", default="triage/scenarios", help="where to write them (default: %(default)s)")
    p.add_argument("--missing", action="store_true",
                   help="only the alerts that have no false-alarm scenario under --out yet")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    keys = missing_keys(out, load()) if args.missing else list(ALERTS)
    controls = [Path(c) for c in args.control or []] or (usual_controls(out) if args.missing else [])
    if not controls:
        print("stepwatch triage false-alarms: give --control (or --missing beside committed false alarms)",
              file=sys.stderr)
        return 2
    for c in controls:
        try:
            if load_scenario(c).get("expected_cause") is not None:
                print(f"stepwatch triage false-alarms: {c} is not a control (it expects a cause)", file=sys.stderr)
                return 2
        except OSError as e:
            print(f"stepwatch triage false-alarms: {c}: {e}", file=sys.stderr)
            return 2
    two = [c for c in controls if "2rank" in c.name]
    one = [c for c in controls if c not in two] or two
    on_two = [k for k in keys if k in TWO_RANK_ALERTS] if two else []
    with exit_on_sigterm():
        paths = write_false_alarms(one[0], out, [k for k in keys if k not in on_two])
        if on_two:
            paths += write_false_alarms(two[0], out, on_two)
    for p in paths:
        print(p)
    return 0
