"""Every alert a fault raised is a question: one scenario per alert in hand, on the drill's own samples.

A drill names the alert it is about, but the fault pages with others too (an OOM with the
memory alert, the probes timing out behind a recompile), and the on-call triages whichever
arrives first.  Each of them must get the fault's true cause for that alert, which the
drill block's ``also`` names (runbooks/drills.md).  A derived scenario holds no samples of
its own: ``samples_from`` names the drill's recording, and it is evaluated at the same
moment, so only an alert that was firing then is a case.

Found this way on the recordings of one run, before any runbook knew of it: a cache kind
switch read by the step-time runbook as a cache turned off, and the probes timing out
behind serving recompiles named a queue backlog.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from stepwatch.thresholds import kebab
from stepwatch.triage.record import SCENARIO_FILE, load_scenario


def firing_names(scenario: Mapping[str, Any]) -> set[str]:
    return {str(a.get("labels", {}).get("alertname")) for a in scenario.get("alerts") or []
            if a.get("status", "firing") == "firing"}


def write_in_hand(drill_scenario: Path, also: Mapping[str, str]) -> tuple[list[Path], list[str]]:
    """Beside ``drill_scenario``, ``<name>-as-<alert>`` for each alert of ``also`` that fired with it.

    Returns the scenarios written and the alerts of ``also`` that were not firing (no case)."""
    sc = load_scenario(drill_scenario)
    firing = firing_names(sc)
    written, absent = [], []
    for alert, cause in also.items():
        if alert not in firing:
            absent.append(alert)
            continue
        name = f"{drill_scenario.name}-as-{kebab(alert.removeprefix('Stepwatch'))}"
        data: dict[str, Any] = {k: v for k, v in sc.items() if k not in ("samples", "name", "live")}
        data.update({
            "name": name, "expected_alert": alert, "expected_cause": cause, "kind": "drill",
            "samples_from": drill_scenario.name,
            "recorded": f"{sc.get('recorded', '')}; {alert} in hand (it fired with {sc.get('expected_alert')})"})
        d = drill_scenario.parent / name
        d.mkdir(exist_ok=True)
        (d / SCENARIO_FILE).write_text(yaml.safe_dump(data, sort_keys=False, width=110))
        written.append(d)
    return written, absent
