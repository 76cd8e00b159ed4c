"""Triage whatever fires now: run each firing alert's runbook checks against Prometheus and name the cause.

Alerts come from Alertmanager when --alertmanager is given (what would page),
else from Prometheus' alerts API; with --at, from the ALERTS series at that time
(a replay of a past moment).  Read-only: nothing is changed anywhere.

Exit status: 0 nothing fires (all clear), 1 incidents reported, 3 could not
check (Prometheus or Alertmanager did not answer), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone

from stepwatch.promapi import Alertmanager, PromError, Prometheus
from stepwatch.thresholds import ThresholdsError, parse_duration
from stepwatch.triage.alert import Alert
from stepwatch.triage.engine import Engine, firing_at
from stepwatch.triage.render import render, use_color

EXIT_CLEAR, EXIT_INCIDENTS, EXIT_USAGE, EXIT_COULD_NOT_CHECK = 0, 1, 2, 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prometheus", required=True, metavar="URL", help="Prometheus base URL")
    p.add_argument("--alertmanager", metavar="URL", help="take the firing alerts from Alertmanager")
    p.add_argument("--format", choices=("terminal", "markdown", "json"), default="terminal")
    p.add_argument("--at", metavar="TIME",
                   help="evaluate at a past time: unix seconds, ISO 8601 (2026-01-02T03:04:05Z) or -10m")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="terminal colors (auto: only on a TTY)")


def parse_time(text: str, now: float | None = None) -> float:
    """Unix seconds, ISO 8601, or a negative duration relative to now (-90s, -10m, -2h)."""
    t = text.strip()
    if t.startswith("-"):
        try:
            return (now if now is not None else datetime.now(timezone.utc).timestamp()) - parse_duration(t[1:])
        except ThresholdsError:
            raise ValueError(f"--at {text!r}: not a duration like -10m") from None
    try:
        return float(t)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--at {text!r}: not unix seconds, ISO 8601 or -<duration>") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def run(args: argparse.Namespace) -> int:
    try:
        at = parse_time(args.at) if args.at else None
    except ValueError as e:
        print(f"stepwatch triage run: {e}", file=sys.stderr)
        return EXIT_USAGE
    with Prometheus(args.prometheus, timeout=5.0) as prom:
        return _triage_now(args, prom, at)


def _triage_now(args: argparse.Namespace, prom: Prometheus, at: float | None) -> int:
    engine = Engine(prom, at=at)
    try:
        if args.alertmanager and at is None:
            # Every state: the engine triages the firing ones and counts the suppressed (silenced, inhibited).
            with Alertmanager(args.alertmanager, timeout=5.0) as am:
                alerts = [Alert.parse(x) for x in am.alerts()]
        else:
            alerts = firing_at(prom, at)
    except PromError as e:
        source = "Alertmanager" if args.alertmanager and at is None else "Prometheus"
        msg = f"COULD NOT CHECK: {source} did not answer ({e}); nothing was triaged."
        if args.format == "json":
            print(json.dumps({"status": "could_not_check", "error": msg, "incidents": []}))
        else:
            print(msg)
        return EXIT_COULD_NOT_CHECK
    report = engine.run(alerts)
    color = args.color == "always" or (args.color == "auto" and use_color(sys.stdout))
    sys.stdout.write(render(report, args.format, color=color and args.format == "terminal"))
    return {"all_clear": EXIT_CLEAR, "incidents": EXIT_INCIDENTS}.get(report.status, EXIT_COULD_NOT_CHECK)
