"""Adding a signal is a four-file change; when one piece is missing, this test names it.

Every alert in stepwatch/thresholds.yaml needs: its AlertDef in alerts/defs/<subsystem>.py
(with promtool cases that fire above the threshold, stay quiet below it, and stay quiet
before ``for:`` elapses), its runbook under runbooks/, and its panel on the committed
overview dashboard.  docs/adding-a-signal.md is the guide this test enforces.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from stepwatch.alerts import defs, rulegen
from stepwatch.alerts.defs import AlertDef, Case, Expect, Series, Timing
from stepwatch.runbooks.parse import CAUSES
from stepwatch.thresholds import PROFILES, AlertSpec, Thresholds, ThresholdsError, load, parse

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = "dashboards/stepwatch-overview.json"


def panel_titles(root: Path) -> set[str]:
    """Titles of every panel on the committed overview dashboard, rows' nested panels included."""
    def walk(panels: list[dict[str, Any]]) -> set[str]:
        return {t for p in panels for t in {p.get("title", ""), *walk(p.get("panels", []))}}

    return walk(json.loads((root / DASHBOARD).read_text()).get("panels", []))


def case_gaps(spec: AlertSpec, cases: list[Case], profile: str) -> list[str]:
    """The promtool scenarios an alert lacks in a profile.

    "Quiet below" is read from the scenario itself: some input series that carries the
    alert's labels never appears among the firing alerts (promtool asserts the firing
    list exactly, so such a series is checked to stay quiet).
    """
    alert_labels = {"job", *defs.ALERTS[spec.key].labels}
    expects = [ex for c in cases for ex in c.expects]
    firing = [lab for ex in expects for lab, _ in ex.firing]
    gaps = []
    if not firing:
        return [f"promtool case that fires above the threshold ({profile})",
                f"promtool case that stays quiet below the threshold ({profile})"] + (
            [f"promtool case that stays quiet before `for:` elapses ({profile})"]
            if spec.for_seconds(profile) > 0 else [])
    projected = [{k: v for k, v in s.labels.items() if k in alert_labels} for c in cases for s in c.series]
    if not any(p and not any(p.items() <= f.items() for f in firing) for p in projected):
        gaps.append(f"promtool case that stays quiet below the threshold ({profile})")
    first = min(ex.at for ex in expects if ex.firing)
    if spec.for_seconds(profile) > 0 and not any(not ex.firing and ex.at < first for ex in expects):
        gaps.append(f"promtool case that stays quiet before `for:` elapses ({profile})")
    return gaps


def missing_pieces(th: Thresholds, root: Path) -> list[str]:
    """One line per missing piece, naming the alert and what to add where."""
    titles = panel_titles(root)
    out = []
    for spec in th.alerts.values():
        who = f"{spec.name} (alerts.{spec.key})"
        sub = spec.labels.get("subsystem", "")
        if spec.key not in defs.ALERTS:
            out.append(f"{who}: no AlertDef in {defs.module_file(sub)}")
        elif defs.SUBSYSTEM_OF[spec.key] != sub:
            out.append(f"{who}: its AlertDef is in {defs.module_file(defs.SUBSYSTEM_OF[spec.key])}, "
                       f"not {defs.module_file(sub)}")
        else:
            d = defs.ALERTS[spec.key]
            for profile in PROFILES:
                out += [f"{who}: its AlertDef has no {gap}"
                        for gap in case_gaps(spec, d.cases(Timing(th, spec, profile)), profile)]
        if not (root / "runbooks" / spec.runbook_file).is_file():
            out.append(f"{who}: no runbook runbooks/{spec.runbook_file}")
        if spec.panel not in titles:
            out.append(f"{who}: no panel titled {spec.panel!r} on {DASHBOARD} (add it to its row in "
                       "dashboards/rows_<subsystem>.py)")
    return out


# ----- the real alerts have every piece --------------------------------------------------------

def test_every_alert_has_its_four_pieces() -> None:
    missing = missing_pieces(load(), ROOT)
    assert not missing, "\n".join(missing)


def test_alert_definitions_match_the_thresholds() -> None:
    th = load()
    assert defs.problems(th) == []
    for key, d in defs.ALERTS.items():
        assert set(d.explains) <= set(CAUSES), (key, set(d.explains) - set(CAUSES))


# ----- and a missing piece is named -------------------------------------------------------------

@pytest.fixture()
def raw() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "stepwatch/thresholds.yaml").read_text())


def _with_fake(raw: dict[str, Any], subsystem: str = "service") -> Thresholds:
    """The thresholds plus one new alert (a copy of the OOM block under a new name and panel)."""
    data = copy.deepcopy(raw)
    block = copy.deepcopy(data["alerts"]["oom"])
    block.update({"name": "StepwatchFakeSignal", "panel": "Fake signals, by pool", "labels": {"subsystem": subsystem},
                  "for": {"production": "5m", "drill": "10s"}})
    data["alerts"]["fake_signal"] = block
    return parse(data)


def _fake_def(cases: Any) -> AlertDef:
    return AlertDef("fake_signal", defs.ALERTS["oom"].expr, ("instance", "pool"), cases)


def test_a_new_alert_without_its_pieces_names_each(raw: dict[str, Any]) -> None:
    missing = missing_pieces(_with_fake(raw), ROOT)
    assert missing == [
        "StepwatchFakeSignal (alerts.fake_signal): no AlertDef in alerts/defs/service.py",
        "StepwatchFakeSignal (alerts.fake_signal): no runbook runbooks/fake-signal.md",
        "StepwatchFakeSignal (alerts.fake_signal): no panel titled 'Fake signals, by pool' on "
        "dashboards/stepwatch-overview.json (add it to its row in dashboards/rows_<subsystem>.py)",
    ]


def test_the_generator_refuses_an_alert_without_its_definition(raw: dict[str, Any]) -> None:
    th = _with_fake(raw)
    message = "alerts.fake_signal: no AlertDef; add one to alerts/defs/service.py"
    with pytest.raises(ThresholdsError, match=re.escape(message)):
        defs.validate(th)
    with pytest.raises(ThresholdsError, match=re.escape(message)):
        rulegen.rule_groups(th, "production")


def _only_firing(p: Timing) -> list[Case]:
    lab = {"job": "stepwatch-service", "instance": "10.0.0.1:8000", "pool": "large"}
    return [Case("fake_signal", "fires", [Series("stepwatch_oom_total", lab, "0+1x20")],
                 [Expect(p.F + p.s, [(lab, 1.0)])])]


@pytest.mark.parametrize("cases, gaps", [
    (lambda p: [], ["fires above the threshold", "stays quiet below the threshold", "stays quiet before `for:`"]),
    (_only_firing, ["stays quiet below the threshold", "stays quiet before `for:`"]),
])
def test_a_missing_promtool_case_is_named(raw: dict[str, Any], monkeypatch: pytest.MonkeyPatch, cases: Any,
                                          gaps: list[str]) -> None:
    monkeypatch.setitem(defs.ALERTS, "fake_signal", _fake_def(cases))
    monkeypatch.setitem(defs.SUBSYSTEM_OF, "fake_signal", "service")
    missing = [m for m in missing_pieces(_with_fake(raw), ROOT) if "AlertDef" in m]
    for profile in PROFILES:
        for gap in gaps:
            assert any(m.startswith("StepwatchFakeSignal (alerts.fake_signal): its AlertDef has no promtool case "
                                    "that " + gap)
                       and f"({profile})" in m for m in missing), (gap, profile, missing)
    assert len(missing) == len(gaps) * len(PROFILES), missing


def test_a_definition_in_the_wrong_module_or_without_its_block_is_named(raw: dict[str, Any],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(defs.ALERTS, "fake_signal", _fake_def(_only_firing))
    monkeypatch.setitem(defs.SUBSYSTEM_OF, "fake_signal", "service")
    assert defs.problems(load()) == [
        f"alerts/defs/service.py: AlertDef 'fake_signal' has no block alerts.fake_signal in {load().source}"]
    assert defs.problems(_with_fake(raw, subsystem="quality")) == [
        "alerts.fake_signal.labels.subsystem: 'quality', but its AlertDef is in alerts/defs/service.py; move it "
        "to alerts/defs/quality.py or fix the label"]
