"""Adding a signal is the handful of hand edits docs/adding-a-signal.md lists; a missing piece is named.

Every alert in stepwatch/thresholds.yaml needs: its AlertDef in alerts/defs/<subsystem>.py
(with promtool cases that fire above the threshold, stay quiet below it, and stay quiet
before ``for:`` elapses), its runbook under runbooks/, its panel on the committed overview
dashboard, and its false-alarm control under triage/scenarios/ (generated).  The walk at the
end adds a throw-away counter and alert to a copy of the repository by the doc's list alone.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
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


def false_alarm_alerts(root: Path) -> set[str]:
    """Alerts that a committed false-alarm control presents."""
    out = set()
    for p in (root / "triage" / "scenarios").glob("*/scenario.yaml"):
        sc = yaml.safe_load(p.read_text())
        if sc.get("kind") == "false_alarm":
            out.add(sc.get("expected_alert"))
    return out


def missing_pieces(th: Thresholds, root: Path) -> list[str]:
    """One line per missing piece, naming the alert and what to add where."""
    titles = panel_titles(root)
    controls = false_alarm_alerts(root)
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
        if spec.name not in controls:
            out.append(f"{who}: no false-alarm control under triage/scenarios/ (run `stepwatch triage "
                       "false-alarms --missing`)")
    return out


# ----- the real alerts have every piece --------------------------------------------------------

def test_every_alert_has_its_pieces() -> None:
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
        "StepwatchFakeSignal (alerts.fake_signal): no false-alarm control under triage/scenarios/ (run "
        "`stepwatch triage false-alarms --missing`)",
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


# ----- the doc's list, walked on a copy of the repository ---------------------------------------
#
# A throw-away counter and alert added to a copy of the tree with exactly the hand edits
# docs/adding-a-signal.md lists (the code line that sets the counter is left out: no generator or
# check reads it), then the doc's generators run there.  Everything must pass with all of them, and
# leaving any one out must fail.

FAKE_METRIC = "stepwatch_pipeline_fake_signals_total"
FAKE_PANEL = "Fake signals, by shape"
# Runs a module of the copy: `stepwatch` and its subpackages from the copy, not from the installed tree.
RUNNER = ("import runpy, sys, stepwatch; stepwatch.__path__.append(sys.argv[1]); sys.argv = sys.argv[2:]; "
          "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", ".ci", "__pycache__", "*.egg-info", ".pytest_cache",
                                     ".mypy_cache", ".ruff_cache")
CHECKS = ["tests/test_adding_a_signal.py::test_every_alert_has_its_pieces",
          "tests/test_adding_a_signal.py::test_alert_definitions_match_the_thresholds",
          "tests/test_runbooks.py::test_cause_vocabulary_is_shared_and_documented",
          "tests/test_runbooks.py::test_every_check_query_parses_as_promql",
          "tests/test_dashboards.py::test_every_alert_has_its_panel_with_a_runbook_link",
          "tests/test_triage_replay.py::test_every_alert_has_exactly_one_false_alarm_and_faults_name_known_alerts"]


def _insert(path: Path, anchor: str, text: str, after: bool = False) -> None:
    """Put ``text`` before (or after) the one place ``anchor`` occurs in ``path``."""
    body = path.read_text()
    assert body.count(anchor) == 1, (path, anchor)
    at = body.index(anchor) + (len(anchor) if after else 0)
    path.write_text(body[:at] + text + body[at:])


def _edit_catalog(root: Path) -> None:
    _insert(root / "stepwatch/catalog.py", "\n)\n\nBY_NAME", f'\n    _m("{FAKE_METRIC}", "counter", '
            '"Fake signals, by shape: a throw-away counter.", ("shape",)),')


def _edit_thresholds(root: Path) -> None:
    _insert(root / "stepwatch/thresholds.yaml", "  error_ratio:\n", f"""  fake_signal:
    name: StepwatchFakeSignal
    severity: warning
    threshold: 0
    window: {{production: 15m, drill: 30s}}
    for: {{production: 0s, drill: 0s}}
    for_reason: every fake signal counts
    summary: Fake signals were counted.
    description: >-
      {{{{ $value | printf "%.0f" }}}} fake signal(s) of shape {{{{ $labels.shape }}}} on
      {{{{ $labels.instance }}}} in the last ${{window}}.
    panel: {FAKE_PANEL}
    labels: {{subsystem: pipeline}}
""")


def _edit_alert_def(root: Path) -> None:
    module = root / "alerts/defs/pipeline.py"
    _insert(module, "\nALERTS = (\n", f'''
def _fake_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return events("{FAKE_METRIC}", need_window(spec, profile), spec.threshold)


def _fake_cases(p: Timing) -> list[Case]:
    return [events_case(p, "{FAKE_METRIC}", {{"shape": "256x256_8s"}}, {{"shape": "512x512_8s"}}, {{"shape": "other"}})]

''')
    _insert(module, "\nALERTS = (\n", '    AlertDef("fake_signal", _fake_expr, ("instance", "shape"), _fake_cases),\n',
            after=True)


def _edit_runbook(root: Path) -> None:
    (root / "runbooks/fake-signal.md").write_text(f"""# StepwatchFakeSignal

## Meaning

A throw-away counter rose.

## Impact

None.

## Diagnosis

1. **Did the counter rise on this instance?** It counts fake signals.

   ```check
   id: fake_rising
   query: |
     sum(increase({FAKE_METRIC}{{instance="{{{{ $labels.instance }}}}"}}[${{window}}]))
   healthy: "<= 0"
   if_unhealthy: fake_cause
   if_healthy: end
   empty: unknown
   ```

## Mitigation

```causes
fake_cause: a throw-away cause
```

- **Fake** (`fake_cause`): nothing to do.
- **Nothing found** (end): escalate with the trail.

## Dashboard

**{FAKE_PANEL}**: one bar per fake signal.
""")


def _edit_panel(root: Path) -> None:
    _insert(root / "dashboards/rows_pipeline.py", '    b.row("Compile")\n', f'''    b.timeseries(
        "{FAKE_PANEL}", """Fake signals per interval, by shape. Healthy: none.""", "short",
        [T(events(sel("{FAKE_METRIC}", INST, F_SHAPE), RATE, by="job, instance, shape"), "{{{{shape}}}}")],
        alerts=["fake_signal"], bars=True, min_=0, decimals=0, no_value="0")
''', after=True)


HAND_EDITS = {"catalog": _edit_catalog, "thresholds": _edit_thresholds, "alert_def": _edit_alert_def,
              "runbook": _edit_runbook, "panel": _edit_panel}


def _run(root: Path, module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", RUNNER, str(root), module, *args], cwd=root, capture_output=True,
                          text=True, timeout=600)


def _walk(tmp: Path, edits: list[str], false_alarm: Path | None = None, generate: bool = True) -> tuple[bool, str]:
    """Copy the tree, make ``edits``, run the doc's generators and the completeness checks: (all passed, output).

    ``false_alarm``: a generated control to copy in instead of running its generator (it starts Prometheus);
    ``generate=False``: neither, as if `stepwatch triage false-alarms --missing` had been forgotten.
    """
    root = tmp / "repo"
    shutil.copytree(ROOT, root, ignore=COPY_IGNORE)
    for name in edits:
        HAND_EDITS[name](root)
    steps: list[tuple[str, ...]] = []
    if false_alarm is None and generate:
        steps.append(("stepwatch.cli", "triage", "false-alarms", "--missing"))
    elif false_alarm is not None:
        shutil.copytree(false_alarm, root / "triage/scenarios" / false_alarm.name)
    steps += [("stepwatch.cli", "rules", "generate"), ("stepwatch.cli", "dashboards", "generate"),
              ("stepwatch.cli", "rules", "generate", "--check"),
              ("pytest", "-q", "-p", "no:cacheprovider", *CHECKS)]
    out = []
    for module, *args in steps:
        r = _run(root, module, *args)
        out.append(f"$ {module} {' '.join(args)} -> {r.returncode}\n{r.stdout}{r.stderr}")
        if r.returncode != 0:
            return False, "\n".join(out)
    return True, "\n".join(out)


@pytest.fixture(scope="module")
def walked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The repository copy with every listed edit made and every generator run."""
    tmp = tmp_path_factory.mktemp("walk")
    ok, out = _walk(tmp, list(HAND_EDITS))
    assert ok, out
    return tmp / "repo", out


@pytest.mark.needs_tool("prometheus")
@pytest.mark.needs_tool("promtool")
def test_the_docs_edits_add_a_complete_signal(walked: tuple[Path, str]) -> None:
    root, out = walked
    assert "passed" in out and "failed" not in out.rsplit("$ pytest", 1)[-1]
    [control] = (root / "triage/scenarios").glob("false-alarm-fake-signal-*")
    assert yaml.safe_load((control / "scenario.yaml").read_text())["expected_alert"] == "StepwatchFakeSignal"
    assert "| `fake_cause` | a throw-away cause | [fake-signal.md](fake-signal.md) |" in (
        root / "runbooks/README.md").read_text()
    assert f"| StepwatchFakeSignal | `{FAKE_METRIC}`, `up` | `instance`, `shape` |" in (
        root / "docs/contracts.md").read_text()
    assert f"| `{FAKE_METRIC}{{shape}}` | counter |" in (root / "README.md").read_text()
    alerts = len(load().alerts) + 1  # the committed ones and the walk's
    assert f"({alerts} of them false alarms, one per alert)" in (root / "triage/README.md").read_text()
    doc = (ROOT / "docs/adding-a-signal.md").read_text()
    listed = re.findall(r"^\| (\d) \| `([^`]+)`", doc, re.M)
    assert [n for n, _ in listed] == ["1", "3", "4", "5", "6"] and "| 2 | the code that sets it |" in doc
    assert [f for _, f in listed] == ["stepwatch/catalog.py", "stepwatch/thresholds.yaml", "alerts/defs/<subsystem>.py",
                                      "runbooks/<kebab-name>.md", "dashboards/rows_<subsystem>.py"]


# What fails, and says so, when one edit is left out.
LEFT_OUT = {
    "catalog": f"{FAKE_METRIC} is neither in the catalog nor a recording rule",
    "thresholds": "AlertDef 'fake_signal' has no block alerts.fake_signal",
    "alert_def": "alerts.fake_signal: no AlertDef; add one to alerts/defs/pipeline.py",
    "runbook": "runbook runbooks/fake-signal.md is missing",
    "panel": f"panel {FAKE_PANEL!r} found 0 times",
}


@pytest.mark.needs_tool("prometheus")
@pytest.mark.needs_tool("promtool")
@pytest.mark.parametrize("left_out", list(HAND_EDITS))
def test_leaving_out_one_listed_edit_fails(walked: tuple[Path, str], left_out: str, tmp_path: Path) -> None:
    [control] = (walked[0] / "triage/scenarios").glob("false-alarm-fake-signal-*")
    ok, out = _walk(tmp_path, [e for e in HAND_EDITS if e != left_out], false_alarm=control)
    assert not ok and LEFT_OUT[left_out] in out, f"without the {left_out} edit:\n{out}"


@pytest.mark.needs_tool("prometheus")
@pytest.mark.needs_tool("promtool")
def test_forgetting_the_false_alarm_generator_fails(walked: tuple[Path, str], tmp_path: Path) -> None:
    ok, out = _walk(tmp_path, list(HAND_EDITS), generate=False)
    assert not ok and "no false-alarm control under triage/scenarios/" in out, out
