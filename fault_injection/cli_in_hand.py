"""``stepwatch triage in-hand``: the other alerts a recorded drill fired, each a scenario of its own.

For each drill recording given, reads its drill block's ``also`` in runbooks/drills.md (the
fault's true cause for each other alert it raises) and writes ``<scenario>-as-<alert>`` beside
it for each of those alerts that was firing when the drill's alert fired (triage/in_hand.py).
``stepwatch drill --record`` does the same as it records; this is for recordings made before a
block's ``also`` named an alert.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stepwatch.fault_injection.registry import DRILLS
from stepwatch.runbooks.parse import load_drills
from stepwatch.triage.in_hand import write_in_hand
from stepwatch.triage.record import load_scenario


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenarios", nargs="+", metavar="DIR", help="recorded drill scenarios (kind: drill)")


def run(args: argparse.Namespace) -> int:
    rc, blocks = 0, {b.id: b for b in load_drills()}
    for d in map(Path, args.scenarios):
        try:
            sc = load_scenario(d)
        except OSError as e:
            print(f"stepwatch triage in-hand: {d}: {e}", file=sys.stderr)
            return 2
        drill = DRILLS.get(str(sc.get("drill")))
        if sc.get("kind") != "drill" or drill is None or sc.get("samples_from"):
            print(f"stepwatch triage in-hand: {d} is not a drill's own recording", file=sys.stderr)
            rc = 2
            continue
        written, absent = write_in_hand(d, blocks[drill.doc_id].also)
        for p in written:
            print(p)
        if absent:
            print(f"{d.name}: not firing with {sc.get('expected_alert')}: {', '.join(absent)}")
    return rc
