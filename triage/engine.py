"""The triage engine: run each firing alert's runbook checks against Prometheus and name the likely cause.

The checks are the numbered items people read in ``runbooks/*.md``; nothing
here knows a query or a threshold of its own.  For every alert the engine
renders each check with the alert's labels and the thresholds source, runs it
(at ``at=`` for a replay), follows the runbook's flow, ranks the causes the
runbook can name by the evidence, and groups alerts that share a cause on one
host into one incident.  It only reads from Prometheus.

    report = triage(alerts_from_webhook(payload), Prometheus(url))
    report.incidents[0].cause, report.incidents[0].evidence()
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from stepwatch.alerts import defs, rulegen
from stepwatch.alerts.defs import refers_to
from stepwatch.promapi import PromError, Prometheus
from stepwatch.runbooks.parse import (
    CAUSE_SCOPE,
    CAUSES,
    END,
    Check,
    Runbook,
    RunbookError,
    follow,
    load_for_alert,
    load_for_url,
)
from stepwatch.thresholds import AlertSpec, Thresholds, ThresholdsError, load, parse_duration

Outcome = Literal["healthy", "unhealthy", "unknown", "error"]
Confidence = Literal["high", "medium", "low", "none"]
SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}
CONFIDENCE_RANK = {"high": 0, "medium": 1, "low": 2, "none": 3}
# Score of a cause the runbook's flow reached, on top of the checks that point at it: the
# flow is the runbook author's order of questions, so it wins over a stray off-path check.
FLOW_BONUS = 3.0


# ----- alerts -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Alert:
    """A firing alert, from an Alertmanager webhook, Alertmanager's API or Prometheus' API."""

    name: str
    labels: dict[str, str]
    annotations: dict[str, str] = field(default_factory=dict)
    starts_at: str = ""
    status: str = "firing"

    @classmethod
    def parse(cls, d: Mapping[str, Any]) -> Alert:
        labels = {str(k): str(v) for k, v in (d.get("labels") or {}).items()}
        status: Any = d.get("status")
        if isinstance(status, dict):  # Alertmanager API v2: {"state": "active" | "unprocessed" | "suppressed"}
            # "unprocessed": received, not yet through silences and inhibitions: it fires until they say otherwise.
            state = status.get("state")
            status = "firing" if state in ("active", "unprocessed", None) else str(state)
        if status is None:  # Prometheus API: state pending | firing
            status = d.get("state", "firing")
        return cls(name=labels.get("alertname", ""), labels=labels,
                   annotations={str(k): str(v) for k, v in (d.get("annotations") or {}).items()},
                   starts_at=str(d.get("startsAt") or d.get("activeAt") or ""), status=str(status))

    @property
    def key(self) -> str:
        """Identity: name and labels, as Alertmanager fingerprints an alert."""
        return self.name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(self.labels.items())
                                          if k != "alertname") + "}"

    @property
    def severity(self) -> str:
        return self.labels.get("severity", "warning")

    @property
    def host(self) -> str:
        """The instance's host: the sidecar and the service it watches share it (another port)."""
        inst = self.labels.get("instance", "")
        return inst.rsplit(":", 1)[0] if ":" in inst else inst

    @property
    def place(self) -> str:
        """Where the alert is: its pod where targets carry one (a fleet: many pods share a node's address, and a
        replica's service and sidecar share its pod), else its instance's host."""
        return self.labels.get("pod") or self.host

    def short(self) -> str:
        """``Name{the labels that say where}`` for one line of a report."""
        skip = {"alertname", "severity", "subsystem", "profile", "job", "stat"}
        parts = [f"{k}={v}" for k, v in sorted(self.labels.items()) if k not in skip and v]
        return f"{self.name}{{{', '.join(parts)}}}" if parts else self.name

    def to_webhook(self) -> dict[str, Any]:
        """This alert as Alertmanager's webhook sends it."""
        fp = hashlib.sha256(self.key.encode()).hexdigest()[:16]
        return {"status": self.status, "labels": dict(self.labels), "annotations": dict(self.annotations),
                "startsAt": self.starts_at, "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "",
                "fingerprint": fp}


def alerts_from_webhook(payload: Mapping[str, Any]) -> list[Alert]:
    """The firing alerts of one Alertmanager webhook notification (resolved ones are dropped)."""
    return [a for a in (Alert.parse(x) for x in payload.get("alerts") or []) if a.status == "firing"]


def webhook_payload(alerts: Sequence[Alert], receiver: str = "stepwatch-triage") -> dict[str, Any]:
    """A version-4 Alertmanager webhook payload carrying ``alerts`` (for recordings and tests)."""
    common = dict(set.intersection(*(set(a.labels.items()) for a in alerts))) if alerts else {}
    return {"version": "4", "groupKey": "{}:{}", "truncatedAlerts": 0, "status": "firing", "receiver": receiver,
            "groupLabels": {}, "commonLabels": common, "commonAnnotations": {}, "externalURL": "",
            "alerts": [a.to_webhook() for a in alerts]}


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def alert_fresh_s(th: Any, profile: str | None = None) -> float:
    """How old an ``ALERTS`` sample may be at the evaluation time and still be a firing alert.

    Two evaluation intervals of the alert's profile (thresholds source): a rule
    evaluation rewrites it every interval while it fires.  For a profile not in the
    source, the slowest profile's (production's), so a live alert is never dropped.
    """
    if profile in th.profiles:
        return 2 * parse_duration(th.profiles[profile].evaluation_interval)
    return 2 * max(parse_duration(p.evaluation_interval) for p in th.profiles.values())


def firing_at(prom: Prometheus, at: float | None = None, thresholds: Any = None) -> list[Alert]:
    """Alerts firing now (Prometheus' alerts API), or at a past time (the ``ALERTS`` series).

    ``ALERTS`` carries labels only; the annotations (runbook_url, panel, summary)
    come from the thresholds source, which is what generated them.
    """
    if at is None:
        return [a for a in (Alert.parse(x) for x in prom.firing()) if a.status == "firing"]
    th = thresholds or _thresholds()
    out = []
    for s in prom.query('timestamp(ALERTS{alertstate="firing"})', at=at):
        # Resolved: no rule evaluation wrote it lately (a backfill has no staleness markers, so the
        # lookback alone would still show it).
        if at - s.value > alert_fresh_s(th, s.labels.get("profile")):
            continue
        labels = {k: v for k, v in s.labels.items() if k not in ("__name__", "alertstate")}
        ann: dict[str, str] = {}
        try:
            spec = th.by_name(labels.get("alertname", ""))
            profile = labels.get("profile", "production")
            ann = rulegen.alert_annotations(th, spec, profile if profile in th.profiles else "production")
            ann.pop("description", None)  # needs the alert's value, which ALERTS does not keep
        except KeyError:
            pass
        since = prom.query(f"ALERTS_FOR_STATE{_selector(labels)}", at=at)
        starts = _iso(since[0].value) if since and not math.isnan(since[0].value) else ""
        out.append(Alert(labels.get("alertname", ""), labels, ann, starts))
    return sorted(out, key=lambda a: a.key)


def _selector(labels: Mapping[str, str]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in sorted(labels.items())) + "}"


def _thresholds() -> Thresholds:
    return load()


SYMPTOM_ID = "symptom"
SYMPTOM_QUERY_PREFIX = "count_over_time(("


def symptom_query(th: Thresholds, spec: AlertSpec, profile: str) -> tuple[str, str]:
    """(PromQL, lookback): the seconds in which the alert's expression held, over ``for:`` + 3 evaluations.

    The expression is the one the rules were generated from (the AlertDef), for the alert's profile.
    The subquery steps by the second: its points are aligned to multiples of the step, and a step of
    one evaluation interval could end just before the scrape that made the alert fire.
    """
    every = int(parse_duration(th.profiles[profile].evaluation_interval))
    lookback = f"{int(spec.for_seconds(profile)) + 3 * every}s"
    expr = rulegen.tidy(defs.alert_def(spec).expr(th, spec, profile))
    return f"{SYMPTOM_QUERY_PREFIX}{expr}\n)[{lookback}:1s])", lookback


# ----- one check, one alert -----------------------------------------------------------------------

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
            parts.append(f"{_fmt(x)}" + (f" ({lab})" if lab else ""))
        more = f" +{len(vals) - limit} more" if len(vals) > limit else ""
        return ", ".join(parts) + more

    def to_json(self) -> dict[str, Any]:
        return {"runbook": self.runbook, "number": self.number, "id": self.id, "title": self.title,
                "query": self.query, "healthy_when": self.condition, "outcome": self.outcome,
                "goes_to": self.goes_to, "on_path": self.on_path, "error": self.error,
                "values": [{"labels": lab, "value": _jnum(v)} for lab, v in self.values]}


def _fmt(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.4g}"


def _jnum(x: float) -> float | str:
    return x if math.isfinite(x) else _fmt(x)


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


def _join_of(rb: Runbook, results: Mapping[str, CheckResult], path: Sequence[str], th: Thresholds,
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


# ----- the engine ---------------------------------------------------------------------------------

class Engine:
    """Runs runbook checks for alerts against one Prometheus, optionally at a fixed past time."""

    def __init__(self, prom: Prometheus | str, thresholds: Thresholds | None = None, at: float | None = None) -> None:
        self.prom = Prometheus(prom, timeout=5.0) if isinstance(prom, str) else prom
        self.th = thresholds or _thresholds()
        self.at = at
        self._reachable: bool | None = None
        self._unreachable_reason = ""
        self._cache: dict[str, tuple[list[tuple[dict[str, str], float]], str | None]] = {}

    def reachable(self) -> bool:
        if self._reachable is None:
            try:
                self.prom.query("vector(1)", at=self.at)
                self._reachable = True
            except PromError as e:
                self._reachable = False
                self._unreachable_reason = str(e)
        return self._reachable

    def _run(self, query: str) -> tuple[list[tuple[dict[str, str], float]], str | None]:
        if query in self._cache:
            return self._cache[query]
        if not self.reachable():
            res: tuple[list[tuple[dict[str, str], float]], str | None] = ([], self._unreachable_reason
                                                                         or "Prometheus unreachable")
        else:
            try:
                res = ([(s.labels, s.value) for s in self.prom.query(query, at=self.at)], None)
            except PromError as e:
                res = ([], str(e))
            except Exception as e:  # a malformed answer must not take the report down
                res = ([], f"{type(e).__name__}: {e}")
        self._cache[query] = res
        return res

    def runbook_of(self, alert: Alert) -> Runbook | None:
        url = alert.annotations.get("runbook_url", "")
        if url:
            try:
                return load_for_url(url)
            except (RunbookError, OSError):
                pass
        try:
            return load_for_alert(alert.name, self.th)
        except (KeyError, RunbookError, OSError):
            return None

    def diagnose(self, alert: Alert) -> Diagnosis:
        rb = self.runbook_of(alert)
        spec = None
        try:
            spec = self.th.by_name(alert.name)
        except KeyError:
            pass
        url = alert.annotations.get("runbook_url") or (self.th.runbook_url(spec.key) if spec else "")
        panel = alert.annotations.get("panel") or (spec.panel if spec else "")
        d = Diagnosis(alert, rb, url, panel)
        if rb is None:
            d.error = f"no runbook for {alert.name}"
            return d
        profile = alert.labels.get("profile", "production")
        if profile not in self.th.profiles:
            profile = "production"
        d.symptom = self._symptom(rb, alert, spec, profile)
        if d.symptom_not_seen:
            assert d.symptom is not None
            d.checks, d.path, d.flow_end = [d.symptom], [d.symptom.id], END
            d.error = (f"the alert's own condition held at no evaluation in the last {d.symptom.condition.split()[-1]} "
                       "of this data: no cause named (a false alarm, or the data is gone)")
            return d
        results: dict[str, CheckResult] = {}
        for c in rb.checks:
            results[c.id] = self._check(rb, c, alert.labels, profile)
        d.checks = [results[c.id] for c in rb.checks]
        if d.could_not_check:
            d.error = f"could not check: {d.checks[0].error}"
            d.flow_end = END
            d.candidates = rank(rb, d.checks, None, False)
            return d

        def outcome_of(c: Check) -> Any:
            o = results[c.id].outcome
            return o if o in ("healthy", "unhealthy") else "unknown"

        cause, trail = follow(rb, outcome_of)
        for step in trail:
            results[step.check.id].on_path = True
        d.path = [s.check.id for s in trail]
        d.flow_end = cause or END
        d.explained_by = _join_of(rb, results, d.path, self.th, profile)
        reached_definitely = bool(trail) and results[trail[-1].check.id].definite
        d.candidates = rank(rb, d.checks, cause, reached_definitely)
        if cause is not None:
            d.cause = cause
            best = next(c for c in d.candidates if c.cause == cause)
            if not reached_definitely:
                d.confidence = "low"  # reached only because a check had no data
            elif any(r.outcome == "unhealthy" for r in best.support) and len(best.support) > len(best.against):
                d.confidence = "high"
            else:
                d.confidence = "medium"  # by elimination, or contested by another check
        return d

    def _symptom(self, rb: Runbook, alert: Alert, spec: AlertSpec | None, profile: str) -> CheckResult | None:
        """Look for the alert's own condition in the data before asking its runbook why it holds.

        A runbook's checks explain a symptom; run on data without it (an alert replayed onto a
        quiet window, a rule that is not this source's) they still find *something* (a 0/0, a
        ratio that wanders), so a cause would be invented.  Seen: some series of the alert's
        expression, over its ``for:`` plus three evaluations, carries the alert's labels.
        None: no definition here to look with (an alert of another source), so the runbook runs.
        """
        if spec is None or spec.key not in defs.ALERTS:
            return None
        try:
            query, lookback = symptom_query(self.th, spec, profile)
        except (ThresholdsError, KeyError, ValueError):
            return None
        values, err = self._run(query)
        keys = (set(defs.ALERTS[spec.key].labels) | {"job"}) & set(alert.labels)
        mine = [(lab, v) for lab, v in values if all(lab.get(k, alert.labels[k]) == alert.labels[k] for k in keys)]
        outcome: Outcome = "error" if err is not None else "unhealthy" if mine else "healthy"
        return CheckResult(rb.file, 0, SYMPTOM_ID, "Does the alert's own condition hold in the data?", query,
                           f"no series over {lookback}", outcome, "next" if mine else END, "next", END, mine, err,
                           on_path=True)

    def _check(self, rb: Runbook, c: Check, labels: Mapping[str, str], profile: str) -> CheckResult:
        try:
            query = c.render(labels, self.th, profile)
            condition = f"{c.healthy.op} {_fmt(c.healthy.threshold(self.th, profile))}"
        except RunbookError as e:
            return CheckResult(rb.file, c.number, c.id, c.title, c.query, str(c.healthy), "error", c.if_healthy,
                               c.if_unhealthy, c.if_healthy, error=str(e))
        values, err = self._run(query)
        if err is not None:
            outcome: Outcome = "error"
        else:
            outcome = c.judge([v for _, v in values], self.th, profile)
        goes_to = c.next_step("unknown" if outcome == "error" else outcome)
        return CheckResult(rb.file, c.number, c.id, c.title, query, condition, outcome, goes_to, c.if_unhealthy,
                           c.if_healthy, values, err)

    def run(self, alerts: Iterable[Alert]) -> Report:
        """Triage the firing alerts; suppressed ones (silenced or inhibited) are only counted."""
        t0 = time.time()
        given = list(alerts)
        firing = [a for a in given if a.status == "firing"]
        keys = {a.key for a in firing}
        suppressed = sorted({a.key: a for a in given if a.status == "suppressed" and a.key not in keys}.values(),
                            key=lambda a: a.key)
        seen: set[str] = set()
        uniq = []
        for a in firing:
            if a.key not in seen:
                seen.add(a.key)
                uniq.append(a)
        diags = [self.diagnose(a) for a in uniq]
        return Report(at=self.at, generated=time.time(), prometheus=self.prom.url, incidents=group(diags, self.th),
                      duration_s=time.time() - t0,
                      prometheus_error=None if not uniq or self.reachable() else self._unreachable_reason,
                      suppressed=suppressed)


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


# ----- incidents ---------------------------------------------------------------------------------

@dataclass
class Incident:
    """Alerts that one cause explains (on one host), or one alert the runbooks could not explain."""

    diagnoses: list[Diagnosis]  # alerts whose runbook named the incident's cause
    followers: list[Diagnosis] = field(default_factory=list)  # their cause points at one of this incident's alerts
    related: list[Diagnosis] = field(default_factory=list)  # firing on the same host with no cause of their own

    @property
    def primary(self) -> Diagnosis:
        """The alert to read first: the most severe, then the most certain diagnosis."""
        return min(self.diagnoses, key=lambda d: (SEVERITY_RANK.get(d.alert.severity, 3),
                                                   CONFIDENCE_RANK[d.confidence], d.alert.key))

    @property
    def cause(self) -> str | None:
        return self.primary.cause

    @property
    def confidence(self) -> Confidence:
        return min((d.confidence for d in self.diagnoses if d.cause == self.cause),
                   key=lambda c: CONFIDENCE_RANK[c], default="none")

    @property
    def severity(self) -> str:
        return self.primary.alert.severity

    @property
    def alerts(self) -> list[Alert]:
        return [d.alert for d in self.diagnoses + self.followers + self.related]

    @property
    def could_not_check(self) -> bool:
        return all(d.could_not_check for d in self.diagnoses)

    @property
    def id(self) -> str:
        keys = ",".join(sorted(a.key for a in self.alerts))
        return hashlib.sha256(keys.encode()).hexdigest()[:8]

    def evidence(self, limit: int | None = None) -> list[CheckResult]:
        """Checks that prove the cause across the incident's alerts: anomalies first, the primary alert's first."""
        out: list[CheckResult] = []
        seen: set[str] = set()
        order = sorted(self.diagnoses, key=lambda d: d is not self.primary)
        ranked = sorted(((evidence_rank(c), i, k, c) for i, d in enumerate(order) for k, c in enumerate(d.evidence())),
                        key=lambda x: x[:3])
        for *_, c in ranked:
            if c.query not in seen:
                seen.add(c.query)
                out.append(c)
        return out[:limit] if limit else out

    def ruled_out(self) -> list[tuple[str, CheckResult]]:
        out: dict[str, CheckResult] = {}
        for d in self.diagnoses:
            for cause, by in d.ruled_out():
                if cause != self.cause:
                    out.setdefault(cause, by)
        return sorted(out.items())

    def to_json(self) -> dict[str, Any]:
        p = self.primary
        return {"id": self.id, "cause": self.cause, "cause_text": CAUSES.get(self.cause or "", ""),
                "confidence": self.confidence, "severity": self.severity,
                "could_not_check": self.could_not_check,
                "alerts": [a.short() for a in self.alerts],
                "evidence": [c.to_json() for c in self.evidence(4)],
                "next_step": p.next_step(), "runbook_url": p.runbook_url, "panel": p.panel,
                "ruled_out": [{"cause": c, "by": r.id, "runbook": r.runbook, "value": r.value_text(),
                               "healthy_when": r.condition} for c, r in self.ruled_out()],
                "explained_by": [{"symptom": d.alert.short(), **d.explained_by.to_json()}
                                 for d in self.diagnoses + self.followers if d.explained_by],
                "diagnoses": [d.to_json() for d in self.diagnoses],
                "followers": [d.to_json() for d in self.followers],
                "related": [d.to_json() for d in self.related]}


def evidence_rank(c: CheckResult) -> int:
    """0 an anomaly on the flow's path, 1 an anomaly off it, 2 an elimination on the path, 3 one off it."""
    return (0 if c.outcome == "unhealthy" else 2) + (0 if c.on_path else 1)


def group(diags: Sequence[Diagnosis], thresholds: Thresholds | None = None) -> list[Incident]:
    """Alerts sharing a cause in one place become one incident; causes that point at another alert join it.

    The place is the alert's pod (else its host), and wider for causes that span places: one pool short of
    instances is one incident however many instances' queues show it, one node gone one incident however many
    of its pods' alerts fire (``incident_scope``).

    A cause like ``out_of_memory`` ("most errors are OOMs") points at the OOM alert:
    that alert's incident takes it as a follower and keeps its own, deeper cause.  Which
    alert a cause points at is the ``explains`` of the alert definitions (alerts/defs/).
    Alerts whose runbook found no cause join a caused incident on the same host as
    related symptoms (a recompile also lifts the queue); alone, each is its own incident.
    An alert whose runbook found the alert it is explained by (a check's ``explained_by``:
    the probe failing behind a stalled worker) follows that alert's incident when it fires
    on the same host, whatever either cause.
    """
    refers = refers_to(thresholds or _thresholds())
    by_key: dict[tuple[str, str], Incident] = {}
    unexplained: list[Diagnosis] = []
    joined = [(d, t) for d in diags if (t := _explaining(d, diags)) is not None]
    for d in diags:
        if any(d is j for j, _ in joined):
            continue
        if d.cause is None:
            unexplained.append(d)
            continue
        key = (d.cause, incident_scope(d))
        if key in by_key:
            by_key[key].diagnoses.append(d)
        else:
            by_key[key] = Incident([d])
    for (cause, host), inc in list(by_key.items()):
        targets = refers.get(cause, ())
        # A pool-level alert (no instance) joins the incident wherever it is, and a pool-wide incident takes
        # the alerts pointing at it from any place.
        if any(d.alert.name in targets for d in inc.diagnoses):
            continue  # the alert named its own kind (a queue backlog on the queue alert): it is the home
        home = next((other for (c2, h2), other in by_key.items() if other is not inc and (h2 in (host, "") or not host)
                     and any(d.alert.name in targets for d in other.diagnoses)), None)
        if home is not None:
            home.followers.extend(inc.diagnoses + inc.followers)
            del by_key[(cause, host)]
    _merge_hostless(by_key)
    incidents = list(by_key.values())
    for d in unexplained:
        home = None
        if not d.could_not_check and d.runbook is not None:
            same_host = [i for i in incidents if i.primary.alert.place == d.alert.place]
            home = min(same_host, key=lambda i: (SEVERITY_RANK.get(i.severity, 3), CONFIDENCE_RANK[i.confidence]),
                       default=None)
        if home is not None:
            home.related.append(d)
        else:
            incidents.append(Incident([d]))
    for d, target in joined:
        _follow_explaining(d, target, incidents)
    return sorted(incidents, key=lambda i: (i.cause is None and not i.could_not_check,
                                            SEVERITY_RANK.get(i.severity, 3), CONFIDENCE_RANK[i.confidence], i.id))


def incident_scope(d: Diagnosis) -> str:
    """Where one incident of ``d``'s cause ends (runbooks/parse.CAUSE_SCOPE): a pool-wide cause is one incident
    for the pool, whatever instances show it ("" like a pool-level alert); a node-wide cause one per node
    (its ``node`` label); any other cause one per place (pod, else host)."""
    scope = CAUSE_SCOPE.get(d.cause or "", "place")
    if scope == "pool":
        return ""
    if scope == "node" and d.alert.labels.get("node"):
        return "node:" + d.alert.labels["node"]
    return d.alert.place


def _merge_hostless(by_key: dict[tuple[str, str], Incident]) -> None:
    """A pool-level alert (no instance) naming the cause one host's incident names joins that incident.

    The error ratio is per pool; the worker that crashed is on one host.  With the same cause on two or
    more hosts, which one the pool's alert belongs to is not known: it stays an incident of its own.
    """
    for (cause, host), inc in list(by_key.items()):
        if host:
            continue
        homes = [other for (c2, h2), other in by_key.items() if c2 == cause and h2]
        if len(homes) == 1:
            homes[0].diagnoses.extend(inc.diagnoses)
            homes[0].followers.extend(inc.followers)
            del by_key[(cause, host)]


def _explaining(d: Diagnosis, diags: Sequence[Diagnosis]) -> Diagnosis | None:
    """The firing alert ``d``'s runbook found it is explained by, on d's host and with a cause of its own.

    The instance the check found comes first (one host may run more than one service), then
    the most severe; an alert that is itself explained by another is no home (no chains).
    """
    j = d.explained_by
    if j is None:
        return None
    found = [t for t in diags if t is not d and t.alert.name == j.alert and t.alert.place == d.alert.place
             and t.cause is not None and t.explained_by is None]
    found.sort(key=lambda t: (t.alert.labels.get("instance") != j.labels.get("instance"),
                              SEVERITY_RANK.get(t.alert.severity, 3), t.alert.key))
    return found[0] if found else None


def _follow_explaining(d: Diagnosis, target: Diagnosis, incidents: list[Incident]) -> None:
    """``d`` becomes a follower of the incident holding ``target``, its join marked as firing."""
    home = next((i for i in incidents if any(x is target for x in i.diagnoses + i.followers)), None)
    if home is None:  # cannot happen (a target has a cause, so an incident holds it); never lose an alert
        incidents.append(Incident([d]))
        return
    if d.explained_by is not None:
        d.explained_by.firing = target.alert.short()
    home.followers.append(d)


@dataclass
class Report:
    at: float | None
    generated: float
    prometheus: str
    incidents: list[Incident]
    duration_s: float = 0.0
    prometheus_error: str | None = None
    suppressed: list[Alert] = field(default_factory=list)  # silenced or inhibited in Alertmanager: not triaged

    @property
    def status(self) -> Literal["all_clear", "incidents", "could_not_check"]:
        if not self.incidents:
            return "all_clear"
        if self.prometheus_error or all(i.could_not_check for i in self.incidents):
            return "could_not_check"
        return "incidents"

    def incident_for(self, alertname: str) -> Incident | None:
        """The incident that holds an alert of this name (its own diagnoses first, then followers, then related)."""
        for attr in ("diagnoses", "followers", "related"):
            for inc in self.incidents:
                if any(d.alert.name == alertname for d in getattr(inc, attr)):
                    return inc
        return None

    @property
    def causes(self) -> list[str]:
        return [i.cause for i in self.incidents if i.cause]

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "evaluated_at": _iso(self.at) if self.at is not None else None,
                "evaluated_at_unix": self.at, "generated_at": _iso(self.generated), "prometheus": self.prometheus,
                "prometheus_error": self.prometheus_error, "duration_s": round(self.duration_s, 3),
                "suppressed": [a.short() for a in self.suppressed],
                "incidents": [i.to_json() for i in self.incidents]}


def triage(alerts: Iterable[Alert | Mapping[str, Any]], prometheus: Prometheus | str, at: float | None = None,
           thresholds: Thresholds | None = None) -> Report:
    """Triage these alerts (Alert objects or alert dicts in any of the three formats) against Prometheus."""
    parsed = [a if isinstance(a, Alert) else Alert.parse(a) for a in alerts]
    if isinstance(prometheus, str):  # a client of our own: closed when done
        with Prometheus(prometheus, timeout=5.0) as prom:
            return Engine(prom, thresholds, at).run(parsed)
    return Engine(prometheus, thresholds, at).run(parsed)

