"""``stepwatch snapshot``: render dashboard panels to PNG from Prometheus range queries.

The panel's queries with the variables substituted, its threshold lines, and the spans where
the alerts it links to were firing, shaded (``stepwatch.dashboards.snapshot.render_panels``).
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from stepwatch.dashboards.model import package_dir
from stepwatch.dashboards.snapshot import DEFAULT_DASHBOARD, parse_time, render_panels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Let `--from -10m` parse like a negative number rather than an unknown option (`--from=-10m` always works).
    if hasattr(parser, "_negative_number_matcher"):
        parser._negative_number_matcher = re.compile(r"^-\d+(?:\.\d+)?(?:ms|s|m|h|d|w)?$")
    parser.add_argument("--dashboard", type=Path, default=package_dir() / DEFAULT_DASHBOARD,
                        help="dashboard JSON (default: the packaged overview)")
    parser.add_argument("--panels", nargs="+", metavar="TITLE", default=None,
                        help="panel titles (default: every panel)")
    parser.add_argument("--from", dest="start", default="-1h", help="unix seconds, now-10m, -10m, ISO 8601")
    parser.add_argument("--to", dest="end", default="now", help="unix seconds, now, ISO 8601")
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    parser.add_argument("--out", type=Path, required=True, help="directory for the PNGs")
    parser.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                        help="a template variable's value (regex), e.g. pool=small (default .*)")
    parser.add_argument("--step", type=float, default=None, help="query step in seconds (default: auto)")


def _variables(items: list[str]) -> dict[str, str]:
    variables = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--var {item!r}: expected NAME=VALUE")
        variables[name] = value
    return variables


def run(args: argparse.Namespace) -> int:
    variables = _variables(args.var)
    now = time.time()
    paths = render_panels(args.dashboard, args.panels, args.prometheus, parse_time(args.start, now),
                          parse_time(args.end, now), args.out, variables=variables, step=args.step)
    for p in paths:
        print(p)
    return 0
