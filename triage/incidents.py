"""Incidents: the diagnoses of one triage grouped by cause and place, and the report that lists them.

Alerts that share a cause in one place are one incident; an alert whose cause
points at another alert, or whose runbook found the alert it is explained by,
follows that alert's incident.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from stepwatch.alerts.defs import refers_to
from stepwatch.runbooks.parse import CAUSE_SCOPE, CAUSES
from stepwatch.thresholds import Thresholds, load
from stepwatch.triage.alert import Alert, iso_utc
from stepwatch.triage.diagnosis import CheckResult, Confidence, Diagnosis, evidence_rank

SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}
CONFIDENCE_RANK = {"high": 0, "medium": 1, "low": 2, "none": 3}


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
    refers = refers_to(thresholds or load())
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
        return {"status": self.status, "evaluated_at": iso_utc(self.at) if self.at is not None else None,
                "evaluated_at_unix": self.at, "generated_at": iso_utc(self.generated), "prometheus": self.prometheus,
                "prometheus_error": self.prometheus_error, "duration_s": round(self.duration_s, 3),
                "suppressed": [a.short() for a in self.suppressed],
                "incidents": [i.to_json() for i in self.incidents]}
