"""The drill runner: a drill on a stack from steady traffic through the fault and its alert to the verdict,
and the per-shape baselines the drills' alerts read, calibrated on steady traffic.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepwatch.fault_injection import notifications, queries
from stepwatch.fault_injection.criteria import Criteria
from stepwatch.fault_injection.criteria import load as load_criteria
from stepwatch.fault_injection.drill import Drill, DrillResult, _rate_window, _scrape_s
from stepwatch.fault_injection.recording import Recording
from stepwatch.fault_injection.stack import LocalStack
from stepwatch.fault_injection.traffic import Traffic
from stepwatch.fault_injection.webhook import Notification
from stepwatch.promapi import PromError
from stepwatch.thresholds import Thresholds, parse_duration
from stepwatch.thresholds import load as load_thresholds
from stepwatch.triage.engine import Alert
from stepwatch.triage.in_hand import write_in_hand


def _evidence_trail(verdict: dict[str, Any] | None) -> str:
    """The checks behind a wrong verdict, on one line: what a CI log must say for the miss to be understood."""
    if not verdict:
        return " (no triage verdict)"
    steps = verdict.get("path") or verdict.get("evidence") or []
    trail = [f"{e.get('check')}={e.get('value')}:{e.get('outcome')}" for e in steps]
    status = verdict.get("status", "")
    return f" (triage {status}: {', '.join(trail) or 'no checks ran'})"


def _attempt(r: DrillResult, what: str, fn: Callable[[], object]) -> None:
    """Run one phase of a drill; a failure is recorded on the report, never raised (later phases still run)."""
    try:
        fn()
    except Exception as e:
        r.failures.append(f"{what} failed: {type(e).__name__}: {e}")


@dataclass
class _Watch:
    """What a drill run saw across its phases: alert names, health, alerts left over from before."""

    seen: set[str] = field(default_factory=set)
    healthy: bool = True
    went_red: bool = False
    leftover: set[str] = field(default_factory=set)


Triage = Callable[[LocalStack, DrillResult], dict[str, Any] | None]


class Runner:
    """Runs drills on a stack and watches Prometheus, Alertmanager's webhook and the service.

    One drill runs in four phases, each a method: ``_steady`` (baseline traffic until the
    drill's alert and every critical are quiet), ``_inject_and_watch`` (fault in, watch for
    the alert and its webhook, triage, the drill's checks while firing, fault out),
    ``_resolve`` (wait for the alert to clear) and ``_judge`` (the pass/fail checks).
    """

    def __init__(self, stack: LocalStack, th: Thresholds | None = None,
                 progress: Callable[[str], None] | None = None, triage: Triage | None = None,
                 criteria: Criteria | None = None) -> None:
        self.stack = stack
        self.th = th or load_thresholds()
        self.criteria = criteria or load_criteria()
        self.progress = progress or (lambda m: None)
        self.triage = triage
        self.critical = {a.name for a in self.th.alerts.values() if a.severity == "critical"}
        self.record: Recording | None = None  # record each drill as a triage scenario (stepwatch drill --record)
        # The calibrated per-shape baselines, published again before each drill: a drill that restarted the
        # worker (killed, frozen past the restart) took them with it, and the next drill's alerts need them.
        self.baselines: dict[str, Any] = {}
        self.before_drill: Callable[[str], None] = lambda name: None  # a campaign's phase line (phases.py)

    def _record(self, drill: Drill, r: DrillResult, record: Recording) -> None:
        if drill.quiet:
            try:
                paths = record.quiet_drill(self.stack, self.progress, drill.name, drill.description,
                                           list(drill.silent), drill.target_labels())
                r.notes.append(f"recorded as a control with {len(paths) - 1} false alarms on it: {paths[0]}")
            except Exception as e:
                r.notes.append(f"recording the control failed: {type(e).__name__}: {e}")
            return
        if r.time_to_detect_s is None:
            r.notes.append("not recorded as a triage scenario: the alert never fired")
            return
        live = {"cause": r.triage_cause, "confidence": (r.triage or {}).get("confidence"),
                "firing": (r.triage or {}).get("firing", [])}
        try:
            firing = [Alert.parse(a).to_webhook() for a in r.details.get("firing_at_detection", [])]
            path = record.drill(self.stack, drill.name, drill.cause, drill.expected, r.injected_at,
                                r.injected_at + r.time_to_detect_s, r.ended_at, live, drill.description,
                                {"inject": drill.spec.inject, "traffic": drill.spec.traffic}, firing)
            r.notes.append(f"recorded as a triage scenario: {path}")
            self._record_in_hand(drill, r, path)
        except Exception as e:
            r.notes.append(f"recording the scenario failed: {type(e).__name__}: {e}")

    @staticmethod
    def _record_in_hand(drill: Drill, r: DrillResult, path: Path) -> None:
        """The drill block's other alerts in hand, each a scenario of its own on this recording."""
        written, absent = write_in_hand(path, drill.spec.also)
        r.notes += [f"recorded with {p.name.split('-as-')[-1]} in hand: {p}" for p in written]
        if absent:
            r.notes.append(f"not firing when the drill's alert fired, so no case: {', '.join(absent)}")

    def _try_firing(self, r: DrillResult | None = None) -> set[str] | None:
        """The names firing now, or None (with a note on the report) when Prometheus did not answer."""
        try:
            return {a["labels"].get("alertname", "") for a in self.stack.prom.firing()}
        except PromError as e:
            if r is not None:
                note = f"prometheus query failed: {e}"
                if note not in r.notes:
                    r.notes.append(note)
            return None

    def _firing_names(self, r: DrillResult | None = None) -> set[str]:
        """The names firing now; empty (and a note on the report) when Prometheus did not answer."""
        return self._try_firing(r) or set()

    def wait_quiet(self, watch: set[str], timeout: float | None = None, r: DrillResult | None = None) -> set[str]:
        """Wait until none of ``watch`` fires (e.g. a previous drill's alert still resolving)."""
        deadline = time.time() + (self.criteria.quiet_deadline_s if timeout is None else timeout)
        firing = self._firing_names(r) & watch
        while firing and time.time() < deadline:
            time.sleep(2)
            firing = self._firing_names(r) & watch
        return firing

    def run(self, drill: Drill, steady_s: float | None = None) -> DrillResult:
        r = DrillResult(drill.name, drill.expected, expected_cause=drill.cause)
        self.before_drill(drill.name)
        self.progress(f"[{drill.name}] {drill.description}")
        if not self.stack.healthy():
            r.service_survived = False
            r.failures.append("service unhealthy before the drill: aborted")
            return r
        w = _Watch()
        if self.baselines:
            self.stack.baselines = self.baselines
            _attempt(r, "publishing the baselines", lambda: self.stack.knobs(baselines={"shapes": self.baselines}))
        with self.stack.traffic(drill.baseline_traffic(), concurrency=2) as traffic:
            if not self._steady(drill, r, w, self.criteria.steady_s if steady_s is None else steady_s):
                return r
            self._inject_and_watch(drill, r, w)
            self._resolve(drill, r, w)
            _attempt(r, "check after restore", lambda: drill.after(self.stack, r))
            if drill.fleet and self.stack.webhook is not None:
                self._count_notifications(r, self.stack.webhook.snapshot)
        self._judge_baseline_traffic(drill, r, traffic)
        self._judge(drill, r, w)
        if self.record is not None:
            self._record(drill, r, self.record)
        self.progress(f"[{drill.name}] {'PASS' if r.passed else 'FAIL'}"
                      + (f" detect {r.time_to_detect_s:.1f}s" if r.time_to_detect_s is not None else "")
                      + (f"; {'; '.join(r.failures)}" if r.failures else ""))
        return r

    # ----- the phases -------------------------------------------------------------------------
    def _steady(self, drill: Drill, r: DrillResult, w: _Watch, steady_s: float) -> bool:
        """Baseline traffic until the drill's alert and every critical are quiet; False: aborted.

        The drill's own alert must be neither firing nor pending when the fault goes in: an alert
        already on its way would be "detected" without the fault having anything to do with it.
        """
        self.progress(f"[{drill.name}] baseline traffic; waiting until nothing fires")
        time.sleep(steady_s)
        drill.settle(self.stack, r)
        self._remeasure_step_baselines(r, steady_s)
        watched = self._watched(drill)
        w.leftover = self.wait_quiet(set(watched) | self.critical, r=r)
        if w.leftover:
            r.notes.append(f"still firing before injection: {sorted(w.leftover)}")
        # Any other alert still firing from the drill before would join this drill's incident: a CPU-contention
        # step-time alert was grouped under the frozen worker's lingering probe failures and named worker_hung.
        self.wait_quiet(self._firing_names(r), timeout=self.criteria.leftover_deadline_s, r=r)
        already = self._firing_names(r)
        if already:
            r.notes.append(f"firing before injection (not counted against the drill): {sorted(already)}")
        states = set().union(*(self._states_of(name, r) for name in watched))
        r.checks["quiet_before_injection"] = not states
        if states:
            r.failures.append(f"{'/'.join(watched)} was already {'/'.join(sorted(states))} when the fault was due "
                              "to go in: aborted (it cannot be detected)")
            return False
        r.checks["healthy_before"] = self.stack.healthy()
        if not r.checks["healthy_before"]:
            r.service_survived = False
            r.failures.append("service unhealthy before injection: aborted")
        return r.checks["healthy_before"]

    def _watched(self, drill: Drill) -> list[str]:
        """The alerts that must be quiet before the drill: its own, or a quiet drill's silent ones."""
        return [self.th.alert(k).name for k in drill.silent] if drill.quiet else [drill.expected]

    def _remeasure_step_baselines(self, r: DrillResult, window_s: float) -> None:
        """The per-shape step-time baselines measured again on this drill's steady traffic, and published.

        A shared 2-core host drifts: on a quiet practice stack the step time wandered between 0.83x and
        1.27x of its calibration within ten minutes (measured during the seeds' drills), which is past the
        1.2x step-time alert with no fault at all, and a cache turned off then rose from 0.85x to only
        1.2x in 100 s.  A deployment's baseline comes from a benchmark of the same build on the same kind
        of host; the minutes before the fault are that here.  Hit-rate baselines stay as calibrated (the
        model's own behaviour, not the host's speed).
        """
        if not self.baselines or window_s < 2 * _scrape_s(self.th):
            return
        try:
            rows = self.stack.prom.query(queries.step_by_shape(f"{int(window_s)}s"))
        except PromError as e:
            r.notes.append(f"step baselines not re-measured: {e}")
            return
        moved: dict[str, list[float]] = {}
        new: list[str] = []
        for s in rows:
            shape, base = s.label("shape"), self.baselines.get(s.label("shape"))
            if shape == "other" or not (math.isfinite(s.value) and s.value > 0):
                continue
            if base is None:  # a shape only this drill's clients send (cache-off's 50 steps)
                self.baselines[shape] = {"step_seconds": round(s.value, 6)}
                new.append(shape)
            elif "step_seconds" in base:
                moved[shape] = [base["step_seconds"], round(s.value, 6)]
                base["step_seconds"] = round(s.value, 6)
        if new:
            self._measure_new_hit_ratios(r, new, f"{int(window_s)}s")
        if moved or new:
            _attempt(r, "publishing the re-measured baselines",
                     lambda: self.stack.knobs(baselines={"shapes": self.baselines}))
            r.details["step_baselines_remeasured"] = moved

    def _measure_new_hit_ratios(self, r: DrillResult, shapes: list[str], window: str) -> None:
        """A shape calibration never saw gets its hit-rate baseline from the same steady window as its step time
        (as a deployment's benchmark run measures both for every shape it serves)."""
        try:
            for s in self.stack.prom.query(queries.hit_ratio_by_shape(window)):
                if s.label("shape") in shapes and math.isfinite(s.value) and s.value > 0:
                    self.baselines[s.label("shape")]["cache_hit_ratio"] = round(s.value, 4)
        except PromError as e:
            r.notes.append(f"hit-rate baselines of {shapes} not measured: {e}")
        r.details["baselines_measured_for_new_shapes"] = {k: dict(self.baselines[k]) for k in shapes}

    def _states_of(self, name: str, r: DrillResult, timeout: float | None = None) -> set[str]:
        """The states (pending, firing) ``name`` is in, after waiting up to the quiet deadline for none."""
        deadline = time.time() + (self.criteria.quiet_deadline_s if timeout is None else timeout)
        while True:
            try:
                states = {str(a.get("state")) for a in self.stack.prom.alerts()
                          if a.get("labels", {}).get("alertname") == name}
            except PromError as e:
                states = {f"unknown (Prometheus: {e})"}
            if not states or time.time() >= deadline:
                return states
            time.sleep(2)

    def _judge_baseline_traffic(self, drill: Drill, r: DrillResult, traffic: Traffic) -> None:
        """Every baseline request answered 200 (or what the drill's fault makes of the whole service)."""
        codes = dict(traffic.codes)
        r.details["baseline_traffic_codes"] = {str(k): v for k, v in sorted(codes.items())}
        bad = {c: n for c, n in codes.items() if c not in drill.baseline_accepts}
        r.checks["baseline_traffic_answered"] = bool(codes.get(200)) and not bad
        if bad:
            r.failures.append(f"baseline traffic got {sum(bad.values())} answer(s) other than "
                              f"{'/'.join(map(str, sorted(drill.baseline_accepts)))}: {bad}"
                              + (f" ({traffic.errors[0]})" if traffic.errors else ""))

    def _inject_and_watch(self, drill: Drill, r: DrillResult, w: _Watch) -> None:
        """Fault in; watch for the alert and its webhook; triage and the drill's checks while firing; fault out.

        Once the fault may be in, it comes out whatever happens next (a Prometheus error, a
        failed check, Ctrl-C or SIGTERM): restore runs exactly once, in the finally.
        """
        st = self.stack
        started = time.time()
        self.progress(f"[{drill.name}] injecting the fault")
        try:
            _attempt(r, "injection", lambda: drill.inject(st, r))
            r.injected_at = time.time() if drill.in_place_when_injected else started
            r.injection_s = time.time() - started
            if r.injection_s >= 1.0:
                self.progress(f"[{drill.name}] fault in place after {r.injection_s:.1f}s")
            # A quiet drill is watched for its ``within`` after the operation: nothing may fire meanwhile.
            deadline = r.injected_at + (drill.within_s if drill.quiet else self.criteria.detect_deadline_s)
            while time.time() < deadline and not self._poll_alert(drill, r, w):
                self._look_at_health(w)
                time.sleep(1.0)
            if r.time_to_detect_s is not None:
                self._triage(r)
                _attempt(r, "check while firing", lambda: drill.while_firing(st, r))
            w.seen |= self._firing_names(r)
            self._look_at_health(w)
        finally:
            r.restored_at = time.time()
            self.progress(f"[{drill.name}] restoring")
            _attempt(r, "restore", lambda: drill.restore(st, r))

    def _look_at_health(self, w: _Watch) -> None:
        ok = self.stack.healthy()
        w.healthy, w.went_red = w.healthy and ok, w.went_red or not ok

    def _poll_alert(self, drill: Drill, r: DrillResult, w: _Watch) -> bool:
        """One look at Prometheus and the webhook; True once the alert fired and its webhook (if any) came."""
        st = self.stack
        try:
            alerts = st.prom.firing()
        except Exception as e:
            r.notes.append(f"prometheus query failed: {e}")
            alerts = []
        w.seen |= {a["labels"].get("alertname", "") for a in alerts}
        hit = [a for a in alerts if drill.expected_alert_matches(a)]
        if hit and r.time_to_detect_s is None:
            r.time_to_detect_s = time.time() - r.injected_at
            r.expected_labels = dict(hit[0]["labels"].items())
            r.details["firing_at_detection"] = [a for a in alerts if a.get("state") == "firing"]
            self.progress(f"[{drill.name}] {drill.expected} firing after {r.time_to_detect_s:.1f}s")
        if r.time_to_detect_s is None:
            return False
        if st.webhook is None:
            return True
        if r.time_to_webhook_s is None:
            note = st.webhook.first_firing(drill.expected, r.injected_at - r.injection_s)
            if note is not None:
                r.time_to_webhook_s = note.received - r.injected_at
        return r.time_to_webhook_s is not None

    def _triage(self, r: DrillResult) -> None:
        """Triage at the moment the alert fires, as `stepwatch triage serve` would on the webhook."""
        if self.triage is None:
            return
        try:
            verdict = self.triage(self.stack, r)
            if verdict:
                r.triage = verdict
                r.triage_cause = verdict.get("cause")
        except Exception as e:
            r.notes.append(f"triage failed: {type(e).__name__}: {e}")

    def _resolve(self, drill: Drill, r: DrillResult, w: _Watch) -> None:
        """Wait for the drill's alert to clear after the restore; no answer from Prometheus is not 'resolved'."""
        if drill.quiet:  # nothing was meant to fire, so nothing resolves: what did fire fails _judge_alerts
            r.resolved = True
            return
        deadline = r.restored_at + self.criteria.resolve_deadline_s
        while time.time() < deadline:
            firing = self._try_firing(r)
            if firing is not None:
                w.seen |= firing
                if drill.expected not in firing:
                    r.resolved = True
                    r.time_to_resolve_s = time.time() - r.restored_at
                    return
            time.sleep(2.0)

    def _count_notifications(self, r: DrillResult, received: Callable[[], list[Notification]]) -> None:
        """Every alert that started in the drill got one firing and one resolved notification (the Alertmanager
        pair deduplicated, no repeat, no stale copy): counted once all are resolved and the receiver is quiet."""
        p = self.th.profiles[getattr(self.stack, "profile", "drill")]
        tail = parse_duration(p.group_interval) + parse_duration(p.peer_timeout) + 2.0  # a stale copy's lag
        found = notifications.settled(received, r.injected_at - r.injection_s, tail,
                                      time.time() + self.criteria.resolve_deadline_s)
        r.details["notifications"] = [e.describe() for e in found]
        wrong = [e.describe() for e in found if not e.once_each]
        r.checks["notified_once_each"] = not wrong
        if wrong:
            r.failures.append(f"notified other than once firing, once resolved: {wrong}")

    def _judge(self, drill: Drill, r: DrillResult, w: _Watch) -> None:
        """The pass/fail checks every drill shares, then the verdict over them and the drill's own."""
        st = self.stack
        if drill.health_turns_red:  # the orchestrator must see it: red during the fault is the check
            r.checks["health_red_during"] = w.went_red
        else:
            r.checks["healthy_during"] = w.healthy
        r.checks["healthy_after"] = st.healthy()
        r.service_survived = (w.healthy or drill.health_turns_red) and r.checks["healthy_after"]
        r.alerts_fired = sorted(w.seen)
        r.ended_at = time.time()
        if drill.quiet:
            self._judge_quiet(drill, r)
        else:
            self._judge_detection(drill, r, w)
        self._judge_alerts(drill, r, w)
        for k, ok in r.checks.items():
            if not ok and not any(k in f for f in r.failures):
                r.failures.append(f"check failed: {k}")
        r.details = {k: v for k, v in r.details.items() if not k.startswith("_")}
        r.passed = not r.failures and all(r.checks.values())

    def _judge_quiet(self, drill: Drill, r: DrillResult) -> None:
        """An ordinary operation pages nobody: from its start on, nothing it must not fire was notified (the
        webhook also sees an alert whose whole life fell within the operation), nor a critical that production
        would have paged for."""
        if self.stack.webhook is None:
            return
        since = r.injected_at - r.injection_s
        silent = set(self._watched(drill))
        notified = sorted(n for n in silent | self.critical if self.stack.webhook.first_firing(n, since) is not None)
        pages = [n for n in notified if n in silent or not self._no_page_in_production(n, since, r)]
        r.checks["nothing_paged"] = not pages
        if pages:
            r.failures.append(f"paged during an ordinary operation: {pages}")

    def _no_page_in_production(self, name: str, since: float, r: DrillResult) -> bool:
        """A critical the drill profile notified: its ``for:`` there is a fraction of production's, a restart's
        length is not.  No page when its condition held for less than production's ``for:`` (a pod restart's
        TargetDown); no answer from Prometheus counts as a page."""
        profile = getattr(self.stack, "profile", "drill")
        step = parse_duration(self.th.profiles[profile].evaluation_interval)
        known = r.details.get("held_s", {}).get(name)
        if known is not None:  # asked once already (notified, then seen firing in the watch)
            return bool(known < self.th.by_name(name).for_seconds("production"))
        try:
            evaluations = self.stack.prom.value(queries.alert_evaluations(name, f"{time.time() - since + step:.0f}s"))
        except PromError as e:
            r.notes.append(f"{name}: how long it held is unknown (Prometheus: {e}): counted as a page")
            return False
        held, limit = (evaluations or 0.0) * step, self.th.by_name(name).for_seconds("production")
        r.details.setdefault("held_s", {})[name] = held
        r.notes.append(f"{name} fired in the {profile} profile; its condition held {held:.0f} s, "
                       + (f"under production's for: of {limit:.0f} s" if held < limit else "a page in production too"))
        return held < limit

    def _judge_detection(self, drill: Drill, r: DrillResult, w: _Watch) -> None:
        """A fault's alert fired within the goal, with its companions required, its webhook and triage's cause."""
        r.checks["detected"] = r.time_to_detect_s is not None
        goal = min(self.criteria.goal_s, drill.within_s)
        r.checks["within_goal"] = r.time_to_detect_s is not None and r.time_to_detect_s <= goal
        missing = [a for a in drill.required if a not in w.seen]
        r.checks["all_required_alerts_fired"] = not missing
        if missing:
            r.failures.append(f"required alerts did not fire: {missing}")
        if self.triage is not None:
            r.checks["triage_names_the_cause"] = r.triage_cause == drill.cause
            if r.triage_cause != drill.cause:
                r.failures.append(f"triage named {r.triage_cause!r}, expected {drill.cause!r}"
                                  + _evidence_trail(r.triage))
        r.checks["webhook_delivered"] = self.stack.webhook is None or r.time_to_webhook_s is not None

    def _judge_alerts(self, drill: Drill, r: DrillResult, w: _Watch) -> None:
        """No critical beyond the drill's own and its companions; the silent ones stayed silent; resolved."""
        names = {k: self.th.alert(k).name for k in (*drill.companions, *drill.silent)}
        allowed = {*drill.required, *(names[k] for k in drill.companions)}
        unexpected_critical = sorted((w.seen & self.critical) - allowed - w.leftover)
        if drill.quiet or drill.restarts_a_target:  # a restart's TargetDown: judged as when notified
            since = r.injected_at - r.injection_s
            unexpected_critical = [n for n in unexpected_critical if not self._no_page_in_production(n, since, r)]
        silent_fired = sorted({names[k] for k in drill.silent} & w.seen)
        r.checks["no_unexpected_critical"] = not unexpected_critical
        r.checks["resolved_after_restore"] = r.resolved
        if drill.silent:
            r.checks["silent_alerts_stayed_silent"] = not silent_fired
        if unexpected_critical:
            r.failures.append(f"unexpected critical alerts: {unexpected_critical}")
        if silent_fired:
            r.failures.append(f"alerts that must stay silent fired: {silent_fired}")


def calibrate_baselines(stack: LocalStack, progress: Callable[[str], None] | None = None,
                        th: Thresholds | None = None) -> dict[str, Any]:
    """Per-shape step-time and hit-rate baselines from steady traffic, published through the admin knob.

    In production the baseline file comes from the deployment's benchmark run;
    for the drills it is measured on the practice service itself.
    """
    progress = progress or (lambda m: None)
    w = _rate_window(th or load_thresholds(), stack)
    step = stack.prom.query(queries.step_by_shape(w))
    hits = stack.prom.query(queries.hit_ratio_by_shape(w))
    shapes: dict[str, dict[str, float]] = {}
    for s in step:
        if s.label("shape") != "other" and s.value == s.value and s.value > 0:
            shapes.setdefault(s.label("shape"), {})["step_seconds"] = round(s.value, 6)
    for s in hits:
        if s.label("shape") in shapes and s.value == s.value and s.value > 0:
            shapes[s.label("shape")]["cache_hit_ratio"] = round(s.value, 4)
    if shapes:
        stack.knobs(baselines={"shapes": shapes})
    progress(f"baselines from steady traffic: {shapes}")
    return shapes
