"""False-alarm controls: every alert presented as firing on a quiet recording.

A control with no alert in it asks triage nothing.  These ask it the hard question: an
alert arrives (a rule elsewhere, a flapping exporter, a test notification) but the data
shows nothing wrong.  Triage must say it found no cause rather than invent one; before
the symptom check (triage/engine.py) it named a cause for 11 of 14 alert names on one rank.

For each alert definition, the alert's labels are taken from the recording itself: the
first series of the first metric its expression reads that carries the labels its
AlertDef names (its instance, shape, pool, rank, ...), so the alert looks exactly as a
real one from that service would.  A scenario here holds no samples of its own:
``samples_from`` names the control whose samples it replays.

    stepwatch triage false-alarms --control triage/scenarios/control-1rank-aot_eager-1 \\
        --control triage/scenarios/control-2rank-1 --out triage/scenarios

A new alert gets its control with ``stepwatch triage false-alarms --missing``: only the alerts
without one are written, on the quiet recordings the committed false alarms replay most.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from stepwatch.alerts import defs, promql, rulegen
from stepwatch.promapi import Prometheus
from stepwatch.thresholds import Thresholds, parse_duration
from stepwatch.thresholds import load as load_thresholds
from stepwatch.triage.alert import Alert, iso_utc
from stepwatch.triage.record import SCENARIO_FILE, load_scenario
from stepwatch.triage.replay import Replay

_METRIC = re.compile(r"\b((?:stepwatch_|[a-z_]+:)[a-zA-Z0-9_:]+|up)\b(?!\s*\()(\{[^}]*\})?")
TWO_RANK_ALERTS = ("rank_skew", "worker_stalled")  # presented on a two-rank control, where ranks exist


def metrics_of(expr: str) -> list[str]:
    """The selectors (metric name and matchers) an alert's expression reads, in order."""
    return list(dict.fromkeys(name + sel for name, sel in _METRIC.findall(expr)))


def labels_from(prom: Prometheus, at: float, expr: str, wanted: tuple[str, ...],
                prefer: Mapping[str, str] | None = None) -> dict[str, str]:
    """Label values for an alert from the recording: the series of its metrics carrying most of ``wanted``
    (those with the labels of ``prefer`` first: the replica a drill restarted)."""
    best: dict[str, str] = {}
    for name in metrics_of(expr):
        series = prom.query(promql.latest(name, "10m"), at=at)
        for s in sorted(series, key=lambda s: any(s.labels.get(k) != v for k, v in (prefer or {}).items())):
            have = {k: v for k, v in s.labels.items() if k in wanted or k == "job"}
            if len(have) > len(best):
                best = have
            if all(k in have for k in wanted):
                return have
    return best


def false_alarm(th: Thresholds, key: str, labels: dict[str, str], at: float, profile: str) -> Alert:
    """The alert as Alertmanager would send it, active for its ``for:`` plus one evaluation."""
    spec = th.alert(key)
    since = at - spec.for_seconds(profile) - parse_duration(th.profiles[profile].evaluation_interval)
    return Alert(spec.name, {"alertname": spec.name, **labels, **rulegen.alert_labels(spec, profile)},
                 rulegen.alert_annotations(th, spec, profile), iso_utc(since))


def committed_scenarios(scenarios: Path) -> list[dict[str, Any]]:
    """Every scenario.yaml under ``scenarios``, in name order."""
    return [load_scenario(p.parent) for p in sorted(scenarios.glob(f"*/{SCENARIO_FILE}"))]


def missing_keys(scenarios: Path, th: Thresholds) -> list[str]:
    """Alert keys that have no false-alarm scenario under ``scenarios``."""
    have = {sc.get("expected_alert") for sc in committed_scenarios(scenarios) if sc.get("kind") == "false_alarm"}
    return [key for key, spec in th.alerts.items() if spec.name not in have]


def usual_controls(scenarios: Path) -> list[Path]:
    """The quiet recordings the committed false alarms replay most: a one-rank one, then a two-rank one.

    A new alert's false alarm is presented on the same samples as its neighbours', so the set
    grows by one case and no recording.
    """
    used = Counter(str(sc["samples_from"]) for sc in committed_scenarios(scenarios)
                   if sc.get("kind") == "false_alarm" and sc.get("samples_from"))
    ranked = [name for name, _ in used.most_common() if (scenarios / name / SCENARIO_FILE).is_file()]
    one = [n for n in ranked if "2rank" not in n][:1]
    two = [n for n in ranked if "2rank" in n][:1]
    return [scenarios / n for n in one + two]


def write_false_alarms(control: Path, out: Path, keys: list[str], th: Thresholds | None = None,
                       in_hand: bool = False, prefer: Mapping[str, str] | None = None) -> list[Path]:
    """One ``false-alarm-<alert>-<control>`` scenario per alert key, replaying ``control``'s samples.

    ``in_hand``: ``<control>-as-<alert>`` instead, of kind control: the alerts a quiet drill (a restart) must not
    fire, each a question on its recording, beside the set's one false alarm per alert."""
    th = th or load_thresholds()
    sc = load_scenario(control)
    at, profile = float(sc["evaluated_at"]), str(sc.get("profile") or "drill")
    written = []
    with Replay(control) as rp:
        for key in keys:
            spec = th.alert(key)
            expr = defs.alert_def(spec).expr(th, spec, profile)
            labels = labels_from(rp.prom, at, expr, defs.ALERTS[key].labels, prefer)
            alert = false_alarm(th, key, labels, at, profile)
            name = (f"{control.name}-as-{key.replace('_', '-')}" if in_hand
                    else f"false-alarm-{key.replace('_', '-')}-{control.name}")
            d = out / name
            d.mkdir(parents=True, exist_ok=True)
            data: dict[str, Any] = {
                "name": name, "expected_cause": None, "kind": "control" if in_hand else "false_alarm",
                "expected_alert": spec.name,
                "description": f"{spec.name} presented as firing on {control.name}, where nothing was wrong: "
                               "triage must find no cause",
                "evaluated_at": at, "evaluated_at_iso": sc.get("evaluated_at_iso"),
                "recorded": f"stepwatch triage false-alarms from {control.name} (its samples, its evaluation time)",
                "samples_from": control.name, "profile": profile,
                "scrape_interval_s": sc.get("scrape_interval_s"), "runbooks_revision": sc.get("runbooks_revision"),
                "alerts": [alert.to_webhook()]}
            (d / SCENARIO_FILE).write_text(yaml.safe_dump(data, sort_keys=False, width=110))
            written.append(d)
    return written
