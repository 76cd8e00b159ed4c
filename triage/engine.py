"""The triage engine: run each firing alert's runbook checks against Prometheus and name the likely cause.

The checks are the numbered items people read in ``runbooks/*.md``; nothing
here knows a query or a threshold of its own.  For every alert the engine
renders each check with the alert's labels and the thresholds source, runs it
(at ``at=`` for a replay), follows the runbook's flow, ranks the causes the
runbook can name by the evidence, and groups alerts that share a cause on one
host into one incident.  It only reads from Prometheus.

What it builds lives beside it: the alerts it reads (triage/alert.py), one
alert's checks and ranked causes (triage/diagnosis.py), and the incidents and
the report (triage/incidents.py).

    report = triage(alerts_from_webhook(payload), Prometheus(url))
    report.incidents[0].cause, report.incidents[0].evidence()
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

from stepwatch.alerts import defs, rulegen
from stepwatch.promapi import PromError, Prometheus
from stepwatch.runbooks.parse import (
    END,
    Check,
    Runbook,
    RunbookError,
    follow,
    load_for_alert,
    load_for_url,
)
from stepwatch.thresholds import AlertSpec, Thresholds, ThresholdsError, load, parse_duration
from stepwatch.triage.alert import Alert, iso_utc
from stepwatch.triage.diagnosis import CheckResult, Diagnosis, Outcome, fmt_number, join_of, rank
from stepwatch.triage.incidents import Report, group


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
        starts = iso_utc(since[0].value) if since and not math.isnan(since[0].value) else ""
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
        d.explained_by = join_of(rb, results, d.path, self.th, profile)
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
            condition = f"{c.healthy.op} {fmt_number(c.healthy.threshold(self.th, profile))}"
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


def triage(alerts: Iterable[Alert | Mapping[str, Any]], prometheus: Prometheus | str, at: float | None = None,
           thresholds: Thresholds | None = None) -> Report:
    """Triage these alerts (Alert objects or alert dicts in any of the three formats) against Prometheus."""
    parsed = [a if isinstance(a, Alert) else Alert.parse(a) for a in alerts]
    if isinstance(prometheus, str):  # a client of our own: closed when done
        with Prometheus(prometheus, timeout=5.0) as prom:
            return Engine(prom, thresholds, at).run(parsed)
    return Engine(prometheus, thresholds, at).run(parsed)
