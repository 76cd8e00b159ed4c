"""``stepwatch triage false-alarms``: every alert presented as firing on quiet recordings (triage/false_alarms.py).

Writes one scenario per alert, ``false-alarm-<alert>-<control>``, that replays the control's samples
with that alert in the notification; ``stepwatch triage eval`` scores them as controls (correct: no
cause named).  Rank skew and the stall alert are presented on the two-rank control when one is given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stepwatch.alerts.defs import ALERTS
from stepwatch.procs import exit_on_sigterm
from stepwatch.triage.false_alarms import TWO_RANK_ALERTS, write_false_alarms
from stepwatch.triage.record import load_scenario


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--control", action="append", required=True, metavar="DIR",
                   help="a recorded control scenario (repeat: one-rank and two-rank)")
    p.add_argument("--out", default="triage/scenarios", help="where to write them (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    controls = [Path(c) for c in args.control]
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
    with exit_on_sigterm():
        paths = write_false_alarms(one[0], Path(args.out), [k for k in ALERTS if k not in TWO_RANK_ALERTS or not two])
        if two:
            paths += write_false_alarms(two[0], Path(args.out), list(TWO_RANK_ALERTS))
    for p in paths:
        print(p)
    return 0
