"""Drill reports: markdown for people, JSON for machines, PNG panels from the dashboards."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from stepwatch.dashboards.snapshot import render_panels
from stepwatch.fault_injection.criteria import Criteria
from stepwatch.fault_injection.criteria import load as load_criteria
from stepwatch.fault_injection.drill import DrillResult
from stepwatch.fault_injection.stack import LocalStack
from stepwatch.thresholds import Thresholds

DASHBOARD = "stepwatch-overview.json"
SNAPSHOT_BEFORE_S = 120.0  # a panel snapshot starts this long before the injection: the steady baseline
SNAPSHOT_AFTER_S = 10.0  # ... and ends this long after the drill (or the goal, whichever is later)


def _snapshots(out: Path, r: DrillResult, th: Thresholds, prometheus_url: str,
               progress: Callable[[str], None], goal_s: float) -> list[str]:
    dash = Path(str(resources.files("stepwatch.dashboards") / DASHBOARD))
    if not dash.is_file():
        return []
    spec = th.by_name(r.expected_alert)
    titles = [t for t in (spec.panel,) if t]
    start = r.injected_at - SNAPSHOT_BEFORE_S
    end = max(r.ended_at, r.injected_at + goal_s) + SNAPSHOT_AFTER_S
    try:
        paths = render_panels(dash, titles, prometheus_url, start, end, out / r.name)
    except Exception as e:
        progress(f"[{r.name}] snapshot failed: {type(e).__name__}: {e}")
        return []
    return [str(p.relative_to(out)) for p in paths]


def write_report(out: Path, results: list[DrillResult], th: Thresholds, *, stack: LocalStack | None = None,
                 snapshots: bool = True, progress: Callable[[str], None] | None = None,
                 stacks: list[dict[str, Any]] | None = None, keep_snapshots: bool = False,
                 criteria: Criteria | None = None) -> Path:
    progress = progress or (lambda m: None)
    criteria = criteria or load_criteria()
    if stack is not None and snapshots:
        for r in results:
            if not r.snapshots and r.injected_at:
                r.snapshots = _snapshots(out, r, th, stack.prometheus_url, progress, criteria.goal_s)
    data = {
        "generated_unix": time.time(),
        "goal_seconds": criteria.goal_s,
        "seeds_bar_seconds": criteria.seeds_bar_s,
        "passed": all(r.passed for r in results),
        "stacks": stacks or [],
        "drills": [r.to_json() for r in results],
    }
    (out / "report.json").write_text(json.dumps(data, indent=2, default=str))
    md = out / "report.md"
    md.write_text(render_markdown(results, th, criteria))
    return md


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} s"


def render_markdown(results: list[DrillResult], th: Thresholds, criteria: Criteria | None = None) -> str:
    c = criteria or load_criteria()
    lines = [
        "# stepwatch fault drills",
        "",
        f"Goal: the expected alert fires within {c.goal_s:.0f} s of the fault (the seeds' bar: located within "
        f"{c.seeds_bar_s / 60:.0f} minutes). Overall: **{'PASS' if all(r.passed for r in results) else 'FAIL'}**.",
        "",
        f"| drill | result | expected alert | time to detect | to webhook | vs {c.goal_s:.0f} s goal | "
        f"vs {c.seeds_bar_s:.0f} s bar | service survived | triage |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(_table_row(r, c))
    for r in results:
        lines += _drill_section(r, th)
    return "\n".join(lines) + "\n"


def _met(r: DrillResult, limit_s: float) -> str:
    if not r.expected_alert:
        return "-"  # a quiet drill detects nothing
    return "met" if r.time_to_detect_s is not None and r.time_to_detect_s <= limit_s else "missed"


def _table_row(r: DrillResult, c: Criteria) -> str:
    return (f"| {r.name} | {'PASS' if r.passed else '**FAIL**'} | {r.expected_alert or '(none: quiet)'} | "
            f"{_fmt(r.time_to_detect_s)} | {_fmt(r.time_to_webhook_s)} | {_met(r, c.goal_s)} | "
            f"{_met(r, c.seeds_bar_s)} | {'yes' if r.service_survived else '**no**'} | {r.triage_cause or '-'} |")


def _drill_section(r: DrillResult, th: Thresholds) -> list[str]:
    """One drill's section: what had to fire, what did, its checks, failures, triage verdict and panels."""
    lines: list[str] = ["", f"## {r.name}", ""]
    if r.expected_alert:
        spec = th.by_name(r.expected_alert)
        lines.append(f"Expected **{r.expected_alert}** ({spec.severity}); runbook `runbooks/{spec.runbook_file}`; "
                     f"panel *{spec.panel}*; triage must name `{r.expected_cause}`.")
    else:
        lines.append("A quiet drill: an ordinary operation, where nothing may page.")
    if r.expected_labels:
        shown = {k: v for k, v in r.expected_labels.items() if k not in ("alertname",)}
        lines.append(f"Fired with labels `{json.dumps(shown, sort_keys=True)}`.")
    lines.append("")
    lines.append(f"- time to detect (Prometheus firing): {_fmt(r.time_to_detect_s)}; webhook: "
                 f"{_fmt(r.time_to_webhook_s)}; resolved {_fmt(r.time_to_resolve_s)} after restore")
    lines.append(f"- alerts seen firing: {', '.join(r.alerts_fired) or 'none'}")
    lines.append(f"- service survived: {'yes' if r.service_survived else 'no'}")
    for n in r.notes:
        lines.append(f"- {n}")
    lines += ["", "| check | result |", "|---|---|"]
    for k, ok in r.checks.items():
        lines.append(f"| {k.replace('_', ' ')} | {'ok' if ok else '**FAILED**'} |")
    if r.failures:
        lines += ["", "Failures:", *[f"- {f}" for f in r.failures]]
    if r.triage:
        lines += ["", "Triage verdict:", "", "```", str(r.triage.get("text") or json.dumps(r.triage, indent=2)),
                  "```"]
    interesting = {k: v for k, v in r.details.items() if k not in ("serving_knobs",)}
    if interesting:
        lines += ["", "<details><summary>measurements</summary>", "", "```json",
                  json.dumps(interesting, indent=2, default=str, sort_keys=True), "```", "", "</details>"]
    for p in r.snapshots:
        lines += ["", f"![{Path(p).stem}]({p})"]
    return lines


def summary_table(results: list[DrillResult], report_path: Path) -> str:
    """The terminal summary `stepwatch drill` ends with: one line per drill (with the cause triage named), then
    where to look: the report (each drill's triage report is in it), its JSON twin and the dashboard panels."""
    lines = ["", f"{'drill':<22}{'result':<8}{'detect s':>9}{'webhook s':>11}  {'expected alert':<28}triage cause"]
    for r in results:
        d = f"{r.time_to_detect_s:.1f}" if r.time_to_detect_s is not None else "-"
        w = f"{r.time_to_webhook_s:.1f}" if r.time_to_webhook_s is not None else "-"
        lines.append(f"{r.name:<22}{'PASS' if r.passed else 'FAIL':<8}{d:>9}{w:>11}  "
                     f"{r.expected_alert or '(none: quiet)':<28}"
                     f"{r.triage_cause or '-'}" + (f"   <- {'; '.join(r.failures)}" if r.failures else ""))
    panels = sorted(report_path.parent.glob("*/*.png"))
    lines += ["", f"report: {report_path} (with each drill's triage report)",
              f"json:   {report_path.with_suffix('.json')}"]
    if panels:
        lines.append(f"panels: {len(panels)} PNG under {report_path.parent}/<drill>/")
    return "\n".join(lines)
