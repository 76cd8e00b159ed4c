"""Triage reports for people (terminal, markdown) and machines (JSON).

The terminal form is for 3 a.m.: the cause first, then the two to four checks
that prove it, then what to do next and where to look.  Colors only on a TTY.
"""

from __future__ import annotations

import json
import os
import sys
from typing import IO

from stepwatch.runbooks.parse import CAUSES
from stepwatch.triage.diagnosis import CheckResult, Diagnosis
from stepwatch.triage.incidents import Incident, Report

MARK = {"unhealthy": "✗", "healthy": "✓", "unknown": "?", "error": "!"}
_COLORS = {"red": "31", "yellow": "33", "green": "32", "bold": "1", "dim": "2", "cyan": "36"}
SEVERITY_COLOR = {"critical": "red", "warning": "yellow", "info": "cyan"}


def use_color(stream: IO[str] | None = None) -> bool:
    stream = stream or sys.stdout
    return bool(getattr(stream, "isatty", lambda: False)()) and "NO_COLOR" not in os.environ


class _Paint:
    def __init__(self, on: bool) -> None:
        self.on = on

    def __call__(self, text: str, *styles: str) -> str:
        if not self.on or not styles:
            return text
        return "".join(f"\033[{_COLORS[s]}m" for s in styles) + text + "\033[0m"


def _check_line(c: CheckResult, paint: _Paint) -> str:
    color = {"unhealthy": "red", "healthy": "green"}.get(c.outcome, "yellow")
    where = f"{c.runbook} #{c.number}"
    return (f"    {paint(MARK[c.outcome], color)} {c.title}  {paint(c.value_text(), 'bold')}"
            f"  (healthy when {c.condition})  {paint(where, 'dim')}")


def _follower(d: Diagnosis) -> str:
    """A follower for one line: its alert and cause, and the alert it is explained by when a check found one."""
    why = f"{d.cause}; {d.explained_by.text()}" if d.explained_by else f"{d.cause}"
    return f"{d.alert.short()} ({why})"


def joins(inc: Incident) -> list[str]:
    """``<alert> is explained by <other alert> (...)`` for each of the incident's alerts whose runbook found one.

    The join is the point of the check (a failing probe is the stall's symptom): said in words,
    not left to the reader to infer from two alerts sharing a cause.
    """
    return [f"{d.alert.short()} is {d.explained_by.text()}" for d in inc.diagnoses + inc.followers
            if d.explained_by is not None]


def incident_terminal(inc: Incident, color: bool = False, index: int | None = None) -> str:
    paint = _Paint(color)
    p = inc.primary
    sev = inc.severity.upper()
    num = f"#{index} " if index is not None else ""
    lines = []
    if inc.could_not_check:
        lines.append(paint(f"{num}COULD NOT CHECK", "bold", "yellow") + f"  {p.alert.short()}  [{sev}]")
        lines.append(f"  {p.error or 'no check could run'}")
    elif inc.cause is None:
        lines.append(paint(f"{num}NO CAUSE FOUND", "bold", SEVERITY_COLOR.get(inc.severity, "bold"))
                     + f"  {p.alert.short()}  [{sev}]")
        if p.error:
            lines.append(f"  {p.error}")
    else:
        lines.append(paint(f"{num}LIKELY CAUSE: {inc.cause}", "bold", SEVERITY_COLOR.get(inc.severity, "bold"))
                     + f"  ({inc.confidence} confidence)  [{sev}]")
        lines.append(f"  {CAUSES.get(inc.cause, '')}")
    names = [d.alert.short() for d in inc.diagnoses]
    lines.append(f"  alerts: {', '.join(names)}")
    if inc.followers:
        lines.append("  follows from it: " + ", ".join(_follower(d) for d in inc.followers))
    lines += [f"  {d.alert.short()} is {d.explained_by.text()}" for d in inc.diagnoses if d.explained_by]
    if inc.related:
        lines.append(f"  also firing (no cause of their own): {', '.join(d.alert.short() for d in inc.related)}")
    ev = inc.evidence(4) if inc.cause else [c for c in p.checks if c.on_path][-4:]
    if ev and not inc.could_not_check:
        lines.append("  evidence:" if inc.cause else "  checks on the runbook's path:")
        lines += [_check_line(c, paint) for c in ev]
    ruled = inc.ruled_out()
    if ruled and not inc.could_not_check:
        lines.append("  ruled out: " + "; ".join(f"{cause} ({by.id} = {by.value_text(1)})" for cause, by in ruled))
    nodata = [c for c in p.no_data() if c.on_path] if not inc.could_not_check else []
    if nodata:
        lines.append("  no data: " + "; ".join(f"{c.id} ({c.runbook} #{c.number})" for c in nodata))
    lines.append(f"  {paint('next:', 'bold')} {p.next_step()}")
    if p.runbook_url:
        lines.append(f"  runbook: {p.runbook_url}")
    if p.panel:
        lines.append(f"  panel:   \"{p.panel}\"")
    return "\n".join(lines)


def suppressed_text(report: Report, limit: int = 5) -> str:
    """``3 alerts suppressed (silenced or inhibited in Alertmanager): A, B, C``, or "" when none are."""
    n = len(report.suppressed)
    if not n:
        return ""
    names = ", ".join(a.short() for a in report.suppressed[:limit]) + (f" +{n - limit} more" if n > limit else "")
    return f"{n} alert{'s' if n != 1 else ''} suppressed (silenced or inhibited in Alertmanager, not triaged): {names}"


def terminal(report: Report, color: bool = False) -> str:
    paint = _Paint(color)
    when = f" at {report.to_json()['evaluated_at']}" if report.at is not None else ""
    quiet = suppressed_text(report)
    if report.status == "all_clear":
        what = "nothing unsuppressed is firing" if quiet else "nothing is firing"
        return (paint("ALL CLEAR", "bold", "green") + f": {what} ({report.prometheus}{when})"
                + (f"; {quiet}" if quiet else "") + "\n")
    head = []
    if report.prometheus_error:
        head.append(paint("COULD NOT CHECK", "bold", "yellow")
                    + f": Prometheus at {report.prometheus} did not answer ({report.prometheus_error}); "
                      "the runbook checks below were not run.")
    n = len(report.incidents)
    head.append(paint(f"{n} incident{'s' if n != 1 else ''}", "bold")
                + f" from {sum(len(i.alerts) for i in report.incidents)} firing alert(s){when}"
                + (f"; {quiet}" if quiet else ""))
    body = [incident_terminal(i, color, k + 1 if n > 1 else None) for k, i in enumerate(report.incidents)]
    return "\n".join(head) + "\n\n" + "\n\n".join(body) + "\n"


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def markdown(report: Report) -> str:
    j = report.to_json()
    when = j["evaluated_at"] or j["generated_at"]
    out = [f"# stepwatch triage: {report.status.replace('_', ' ')}", "",
           f"Prometheus `{report.prometheus}`, evaluated at {when}.", ""]
    if report.prometheus_error:
        out += [f"**Could not check:** Prometheus did not answer ({_md_escape(report.prometheus_error)}).", ""]
    quiet = suppressed_text(report)
    if quiet:
        out += [_md_escape(quiet) + ".", ""]
    if report.status == "all_clear":
        out.append("Nothing unsuppressed is firing." if quiet else "Nothing is firing.")
        return "\n".join(out) + "\n"
    for k, inc in enumerate(report.incidents, 1):
        out += _md_incident(k, inc) + _md_every_check(inc)
    return "\n".join(out) + "\n"


def _md_incident(k: int, inc: Incident) -> list[str]:
    """The incident's heading, cause, evidence table, what is ruled out, next step and links."""
    p = inc.primary
    title = (f"likely cause `{inc.cause}` ({inc.confidence} confidence)" if inc.cause
             else "could not check" if inc.could_not_check else "no cause found")
    out = [f"## {k}. {title}", "", f"**{inc.severity}**: {', '.join(f'`{a.short()}`' for a in inc.alerts)}", ""]
    if inc.cause:
        out += [CAUSES.get(inc.cause, ""), ""]
    elif p.error:
        out += [p.error, ""]
    out += [_md_escape(line) + "." for line in joins(inc)] + ([""] if joins(inc) else [])
    ev = inc.evidence(4) if inc.cause else [c for c in p.checks if c.on_path]
    if ev and not inc.could_not_check:
        out += ["| | check | value | healthy when |", "|---|---|---|---|"]
        out += [f"| {MARK[c.outcome]} | {_md_escape(c.title)} ({c.runbook} #{c.number}) | "
                f"{_md_escape(c.value_text())} | `{c.condition}` |" for c in ev]
        out.append("")
    ruled = inc.ruled_out()
    if ruled:
        out += ["Ruled out: " + "; ".join(f"`{c}` (check `{by.id}` = {by.value_text(1)}, healthy when "
                                           f"`{by.condition}`)" for c, by in ruled), ""]
    out += [f"**Next:** {p.next_step()}", ""]
    links = []
    if p.runbook_url:
        links.append(f"[runbook]({p.runbook_url})")
    if p.panel:
        links.append(f"dashboard panel **{p.panel}**")
    if links:
        out += [" · ".join(links), ""]
    return out


def _md_every_check(inc: Incident) -> list[str]:
    """A folded table per diagnosis of every check that ran, with its query."""
    out = ["<details><summary>Every check that ran</summary>", ""]
    for d in inc.diagnoses + inc.followers + inc.related:
        out += [f"**{d.alert.short()}** ({d.runbook.file if d.runbook else 'no runbook'}; path: "
                f"{' → '.join(d.path) or '-'} → {d.flow_end or '-'})", "",
                "| # | check | outcome | value | healthy when | query |", "|---|---|---|---|---|---|"]
        for c in d.checks:
            out.append(f"| {c.number} | `{c.id}` | {c.outcome}{' (on path)' if c.on_path else ''} | "
                       f"{_md_escape(c.value_text())} | `{c.condition}` | `{_md_escape(c.query)}` |")
        out.append("")
    return [*out, "</details>", ""]


def as_json(report: Report) -> str:
    return json.dumps(report.to_json(), indent=2, sort_keys=False)


def render(report: Report, fmt: str, color: bool = False) -> str:
    if fmt == "markdown":
        return markdown(report)
    if fmt == "json":
        return as_json(report) + "\n"
    return terminal(report, color)

