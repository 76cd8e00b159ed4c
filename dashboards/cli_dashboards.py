"""``stepwatch dashboards generate``: write the Grafana dashboards JSON, or check it is current.

The dashboards are code (``dashboards/overview.py``); this command renders them, runs the lint,
and writes ``dashboards/*.json`` (``--check``: writes nothing, exits 1 naming every file that
differs, for CI).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stepwatch.dashboards.generate import lint_problems, render, stale, write
from stepwatch.dashboards.model import package_dir
from stepwatch.thresholds import load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming every file that differs from the generator")
    parser.add_argument("--out", type=Path, default=None, help="directory (default: the dashboards package)")
    parser.add_argument("--thresholds", type=Path, default=None, help="thresholds file (default: packaged)")


def run(args: argparse.Namespace) -> int:
    th = load(args.thresholds)
    out_dir: Path = args.out or package_dir()
    texts = render(th)
    problems = lint_problems(texts, th)
    if problems:
        print("the generated dashboards fail the lint:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    if not args.check:
        for path in write(texts, out_dir):
            print(f"wrote {path}")
        return 0
    differ = stale(texts, out_dir)
    if differ:
        print("dashboards are not current; run `stepwatch dashboards generate`:\n  " + "\n  ".join(differ),
              file=sys.stderr)
        return 1
    print(f"{len(texts)} dashboard file(s) current")
    return 0
