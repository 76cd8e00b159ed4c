"""Drill reports: markdown for people, JSON for machines, PNG panels from the dashboards."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stepwatch.alerts.thresholds import Thresholds
from stepwatch.fault_injection.drills import GOAL_S, SEEDS_BAR_S, DrillResult

DASHBOARD = "stepwatch-overview.json"


def _snapshots(out: Path, r: DrillResult, th: Thresholds, prometheus_url: str,
               progress: Callable[[str], None]) -> list[str]:
    try:
        from importlib import resources

        from stepwatch.dashboards.snapshot import render_panels
    except ImportError:
        return []
    dash = Path(str(resources.files("stepwatch.dashboards") / DASHBOARD))
    if not dash.is_file():
        return []
    spec = th.by_name(r.expected_alert)
    titles = [t for t in (spec.panel,) if t]
    start = r.injected_at - 120
    end = max(r.ended_at, r.injected_at + 60) + 10
    try:
        paths = render_panels(dash, titles, prometheus_url, start, end, out / r.name)
    except Exception as e:
        progress(f"[{r.name}] snapshot failed: {type(e).__name__}: {e}")
        return []
    return [str(p.relative_to(out)) for p in paths]


def write_report(out: Path, results: list[DrillResult], th: Thresholds, *, stack: Any = None,
                 snapshots: bool = True, progress: Callable[[str], None] | None = None,
                 stacks: list[dict[str, Any]] | None = None, keep_snapshots: bool = False) -> Path:
    progress = progress or (lambda m: None)
    if stack is not None and snapshots:
        for r in results:
            if not r.snapshots and r.injected_at:
                r.snapshots = _snapshots(out, r, th, stack.prometheus_url, progress)
    data = {
        "generated_unix": time.time(),
        "goal_seconds": GOAL_S,
        "seeds_bar_seconds": SEEDS_BAR_S,
        "passed": all(r.passed for r in results),
        "stacks": stacks or [],
        "drills": [r.to_json() for r in results],
    }
    (out / "report.json").write_text(json.dumps(data, indent=2, default=str))
    md = out / "report.md"
    md.write_text(render_markdown(results, th))
    return md


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} s"


def render_markdown(results: list[DrillResult], th: Thresholds) -> str:
    lines = [
        "# stepwatch fault drills",
        "",
        f"Goal: the expected alert fires within {GOAL_S:.0f} s of the fault (the seeds' bar: located within "
        f"{SEEDS_BAR_S / 60:.0f} minutes). Overall: **{'PASS' if all(r.passed for r in results) else 'FAIL'}**.",
        "",
        "| drill | result | expected alert | time to detect | to webhook | vs 60 s goal | vs 600 s bar | "
        "service survived | triage |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        goal = "met" if r.time_to_detect_s is not None and r.time_to_detect_s <= GOAL_S else "missed"
        bar = "met" if r.time_to_detect_s is not None and r.time_to_detect_s <= SEEDS_BAR_S else "missed"
        lines.append(f"| {r.name} | {'PASS' if r.passed else '**FAIL**'} | {r.expected_alert} | "
                     f"{_fmt(r.time_to_detect_s)} | {_fmt(r.time_to_webhook_s)} | {goal} | {bar} | "
                     f"{'yes' if r.service_survived else '**no**'} | {r.triage_cause or '-'} |")
    for r in results:
        spec = th.by_name(r.expected_alert)
        lines += ["", f"## {r.name}", ""]
        lines.append(f"Expected **{r.expected_alert}** ({spec.severity}); runbook `runbooks/{spec.runbook_file}`; "
                     f"panel *{spec.panel}*; triage must name `{r.expected_cause}`.")
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
    return "\n".join(lines) + "\n"
