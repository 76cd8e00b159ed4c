"""One alert's diagnosis: its runbook's checks as run, the causes they point at, ranked, and what to do next.

The engine (triage/engine.py) fills these in; the incidents (triage/incidents.py)
group them.  Nothing here queries Prometheus.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from stepwatch.runbooks.parse import Runbook
from stepwatch.thresholds import Thresholds
from stepwatch.triage.alert import Alert

Outcome = Literal["healthy", "unhealthy", "unknown", "error"]
Confidence = Literal["high", "medium", "low", "none"]
# Score of a cause the runbook's flow reached, on top of the checks that point at it: the
# flow is the runbook author's order of questions, so it wins over a stray off-path check.
FLOW_BONUS = 3.0


@dataclass
class CheckResult:
    """One runbook check as run: the rendered query, what came back, and where it leads."""

    runbook: str  # file name
    number: int
    id: str
    title: str
    query: str
    condition: str  # the healthy condition with its threshold filled in, e.g. "<= 0.1"
    outcome: Outcome
    goes_to: str  # where the outcome leads (cause, check id, next, end)
    if_unhealthy: str
    if_healthy: str
    values: list[tuple[dict[str, str], float]] = field(default_factory=list)
    error: str | None = None
    on_path: bool = False  # the runbook's flow passed through it

    @property
    def definite(self) -> bool:
        return self.outcome in ("healthy", "unhealthy")

    def value_text(self, limit: int = 3) -> str:
        """The values for a person: the worst first, with the labels that tell series apart."""
        if self.outcome == "error":
            return "could not check"
        if not self.values:
            return "none" if self.definite else "no data"  # the runbook said what an empty answer means
        vals = sorted(self.values, key=lambda v: -v[1] if not math.isnan(v[1]) else -math.inf)
        varying = {k for k in set().union(*(v[0] for v in vals)) if len({v[0].get(k) for v in vals}) > 1}
        parts = []
        for labels, x in vals[:limit]:
            lab = ",".join(f"{k}={labels[k]}" for k in sorted(varying) if k in labels)
            parts.append(f"{fmt_number(x)}" + (f" ({lab})" if lab else ""))
        more = f" +{len(vals) - limit} more" if len(vals) > limit else ""
        return ", ".join(parts) + more

    def to_json(self) -> dict[str, Any]:
        return {"runbook": self.runbook, "number": self.number, "id": self.id, "title": self.title,
                "query": self.query, "healthy_when": self.condition, "outcome": self.outcome,
                "goes_to": self.goes_to, "on_path": self.on_path, "error": self.error,
                "values": [{"labels": lab, "value": _jnum(v)} for lab, v in self.values]}


def fmt_number(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.4g}"


def _jnum(x: float) -> float | str:
    return x if math.isfinite(x) else fmt_number(x)


@dataclass
class Candidate:
    cause: str
    score: float
    reached: bool  # the flow ended on it
    support: list[CheckResult] = field(default_factory=list)  # definite outcomes pointing at it
    against: list[CheckResult] = field(default_factory=list)  # definite outcomes pointing away from it
    unconfirmed: list[CheckResult] = field(default_factory=list)  # no data / could not check

    def to_json(self) -> dict[str, Any]:
        return {"cause": self.cause, "score": self.score, "reached_by_flow": self.reached,
                "supported_by": [c.id for c in self.support], "against": [c.id for c in self.against],
                "no_data": [c.id for c in self.unconfirmed]}


@dataclass
class Join:
    """The alert whose incident explains this one, found by a runbook check with ``explained_by``.

    A probe that fails because the worker stalled is the stall's symptom, not a queue of its
    own; the report has to say so whether or not the stall alert still fires (the service
    restarts a stalled worker long before the probe alert's ``for:`` has passed).
    """

    alert: str  # the explaining alert's name
    labels: dict[str, str]  # where the check found it: the first series that broke it (instance, pool)
    check: CheckResult  # the check that found it
    firing: str = ""  # that alert as it fires in this triage (Alert.short()); "" when it does not fire now

    def short(self) -> str:
        parts = [f"{k}={v}" for k, v in sorted(self.labels.items()) if v]
        return f"{self.alert}{{{', '.join(parts)}}}" if parts else self.alert

    def text(self) -> str:
        """``explained by StepwatchWorkerStalled{instance=..., pool=...} (firing: the same incident)``."""
        state = "firing: the same incident" if self.firing else "not firing at the evaluation time"
        return (f"explained by {self.firing or self.short()} ({state}; {self.check.runbook} #{self.check.number} "
                f"{self.check.id} = {self.check.value_text(1)})")

    def to_json(self) -> dict[str, Any]:
        return {"alert": self.alert, "labels": self.labels, "firing": self.firing or None,
                "check": {"runbook": self.check.runbook, "number": self.check.number, "id": self.check.id},
                "text": self.text()}


def join_of(rb: Runbook, results: Mapping[str, CheckResult], path: Sequence[str], th: Thresholds,
             profile: str) -> Join | None:
    """The first check on the flow's path that went unhealthy and names the alert it is explained by.

    Where: the first series that broke the check's condition (the stalled worker's instance and pool).
    """
    for cid in path:
        c, r = rb.check(cid), results[cid]
        if c.explained_by and r.outcome == "unhealthy":
            bad = [lab for lab, x in r.values if not math.isnan(x) and not c.healthy.holds(x, th, profile)]
            labels = {k: v for k, v in (bad[0] if bad else {}).items() if k not in ("__name__", "job")}
            return Join(c.explained_by, labels, r)
    return None


@dataclass
class Diagnosis:
    """One alert: its runbook's checks as run, the flow's path, and the ranked causes."""

    alert: Alert
    runbook: Runbook | None
    runbook_url: str
    panel: str
    checks: list[CheckResult] = field(default_factory=list)
    path: list[str] = field(default_factory=list)  # check ids the flow visited
    flow_end: str = ""  # the cause, or "end"
    candidates: list[Candidate] = field(default_factory=list)
    cause: str | None = None
    confidence: Confidence = "none"
    error: str | None = None  # no runbook, or nothing could be checked
    explained_by: Join | None = None  # the alert whose incident this one is a symptom of (runbook's explained_by)
    symptom: CheckResult | None = None  # the alert's own condition, looked for in the data before any check

    @property
    def symptom_not_seen(self) -> bool:
        """The alert's own condition never held over its lookback: a false alarm (or data that is gone)."""
        return self.symptom is not None and self.symptom.outcome == "healthy"

    @property
    def could_not_check(self) -> bool:
        return bool(self.checks) and all(c.outcome == "error" for c in self.checks)

    def evidence(self) -> list[CheckResult]:
        """The checks that prove the cause: anomalies on the flow's path, other checks pointing at the
        cause, then the eliminations on the path (each in runbook order)."""
        if self.cause is None:
            return [c for c in self.checks if c.on_path]
        best = next((c for c in self.candidates if c.cause == self.cause), None)
        support = {id(c) for c in (best.support if best else [])}
        picked = [c for c in self.checks if c.definite and (c.on_path or id(c) in support)]
        return sorted(picked, key=lambda c: (evidence_rank(c), c.number))

    def ruled_out(self) -> list[tuple[str, CheckResult]]:
        out = []
        for cand in self.candidates:
            if cand.cause != self.cause and cand.against and not cand.support:
                out.append((cand.cause, cand.against[0]))
        return out

    def no_data(self) -> list[CheckResult]:
        """Checks that returned nothing or failed: the part a person has to look at by hand."""
        return [c for c in self.checks if not c.definite]

    def next_step(self) -> str:
        """What a person should do or look at next, from the runbook's Mitigation section."""
        if self.runbook is None:
            return "no runbook for this alert: read its description and escalate"
        if self.symptom_not_seen:
            return ("the alert's condition does not hold in Prometheus' data, so no runbook check was run: "
                    "if it still fires, compare the rule Prometheus evaluates with `stepwatch rules generate "
                    "--check` and look at its series by hand (a relabelled or dropped metric, another rule source)")
        if self.could_not_check:
            first = next((c.error for c in self.checks if c.error), None) or "unknown error"
            return (f"no check of {self.runbook.file} could run (first error: {first}): run its checks by hand "
                    "and open the dashboard panel")
        mit = self.runbook.sections.get("Mitigation", "")
        if self.cause is not None:
            line = mitigation_for(mit, self.cause)
            if line:
                return line
            return f"see the runbook's Mitigation section for {self.cause}"
        last = next((c for c in reversed(self.checks) if c.on_path), None)
        end_line = mitigation_for(mit, "end")
        where = f"the runbook found no cause after check {last.number} ({last.title})" if last else "no cause found"
        return f"{where}; escalate with this trail" + (f". {end_line}" if end_line else "")

    def to_json(self) -> dict[str, Any]:
        return {"alert": {"name": self.alert.name, "labels": self.alert.labels, "startsAt": self.alert.starts_at,
                          "annotations": self.alert.annotations},
                "runbook": self.runbook.file if self.runbook else None, "runbook_url": self.runbook_url,
                "panel": self.panel, "cause": self.cause, "confidence": self.confidence, "error": self.error,
                "path": self.path, "flow_end": self.flow_end, "next_step": self.next_step(),
                "explained_by": self.explained_by.to_json() if self.explained_by else None,
                "symptom": self.symptom.to_json() if self.symptom else None,
                "candidates": [c.to_json() for c in self.candidates],
                "ruled_out": [{"cause": c, "by": r.id} for c, r in self.ruled_out()],
                "checks": [c.to_json() for c in self.checks]}


_BULLET = re.compile(r"^- (.*?)(?=^- |\Z)", re.M | re.S)
_BOLD = re.compile(r"^\*\*(.+?)\*\*")


def mitigation_for(section: str, cause: str) -> str:
    """The Mitigation bullet for a cause: the one tagged with it in backticks (``end``: "Nothing found").

    Runbooks tag each bullet with the causes it fixes: ``- **Cache off** (`cache_disabled`): ...``.
    """
    bullets = [" ".join(b.split()) for b in _BULLET.findall(section)]
    for b in bullets:
        m = _BOLD.match(b)
        if cause != "end" and f"`{cause}`" in b:
            return b.replace("**", "")
        if cause == "end" and m and re.search(r"\bnothing\b|\bno cause\b|\(end\)", m.group(1).lower()):
            return b.replace("**", "")
    return ""


def rank(rb: Runbook, checks: Sequence[CheckResult], flow_cause: str | None, reached_definitely: bool,
         ) -> list[Candidate]:
    """Every cause the runbook can name, scored: the flow's cause, plus checks for, minus checks against.

    A definite outcome supports the cause its branch leads to and counts against the
    cause of the other branch; a check with no data (or one that could not run)
    counts for nothing and is listed as unconfirmed.
    """
    cands: dict[str, Candidate] = {}
    for cause in sorted(rb.causes(), key=lambda x: min(c.number for c in rb.checks
                                                        if x in (c.if_healthy, c.if_unhealthy))):
        cands[cause] = Candidate(cause, 0.0, cause == flow_cause)
    for r in checks:
        if r.definite:
            other = r.if_healthy if r.outcome == "unhealthy" else r.if_unhealthy
            if r.goes_to in cands:
                cands[r.goes_to].support.append(r)
            if other in cands and other != r.goes_to:
                cands[other].against.append(r)
        else:
            for t in {r.if_healthy, r.if_unhealthy}:
                if t in cands:
                    cands[t].unconfirmed.append(r)
    for c in cands.values():
        c.score = ((FLOW_BONUS if reached_definitely else 1.0) if c.reached else 0.0) + len(c.support) - len(c.against)
    order = list(cands)
    return sorted(cands.values(), key=lambda c: (-c.score, order.index(c.cause)))


def evidence_rank(c: CheckResult) -> int:
    """0 an anomaly on the flow's path, 1 an anomaly off it, 2 an elimination on the path, 3 one off it."""
    return (0 if c.outcome == "unhealthy" else 2) + (0 if c.on_path else 1)
