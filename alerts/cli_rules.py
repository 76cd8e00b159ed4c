"""``stepwatch rules generate``: write every file that follows from stepwatch/thresholds.yaml, or check them.

The files and how they are made: alerts/generate.py.  --check writes nothing and exits 1
naming every file that differs; a bad thresholds file exits 2 with the key at fault.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stepwatch.alerts.generate import default_root, stale_files, write_all
from stepwatch.thresholds import ThresholdsError, load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 and name the files that differ from the generator")
    parser.add_argument("--thresholds", help="thresholds YAML (default: the packaged stepwatch/thresholds.yaml)")
    parser.add_argument("--root", help="directory holding alerts/ and runbooks/ (default: where stepwatch is)")


def run(args: argparse.Namespace) -> int:
    try:
        th = load(args.thresholds)
        root = Path(args.root) if args.root else default_root()
        if args.check:
            bad = stale_files(th, root)
            for rel in bad:
                print(f"{rel}: differs from the generator; run `stepwatch rules generate`", file=sys.stderr)
            if not bad:
                print(f"all generated files under {root} are current")
            return 1 if bad else 0
        written = write_all(th, root)
        for rel in written:
            print(f"wrote {rel}")
        print(f"{len(written)} file(s) written, the rest were current")
        return 0
    except ThresholdsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
