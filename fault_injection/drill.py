"""A fault drill: inject a runbook fault into the practice service and prove the alerting sees it.

A drill passes only if the expected alert fires within the goal (60 s; the
seeds' bar is 600 s), no unexpected critical alert fires, the service stays
healthy before, during and after, the alert resolves after the fault is
removed, and the drill's own checks hold (the clear OOM error, p99 up with p50
flat, 429s with Retry-After, ...).  Alert names and thresholds come from the
thresholds source, the goal, deadlines and check ratios from runbooks/drills.md
(``criteria``), the queries from ``queries``: never from literals here.

Each drill: health check (abort if unhealthy) -> baseline traffic until
steady (nothing firing) -> inject -> watch Prometheus and the webhook ->
restore -> wait for the alert to resolve -> judge.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from stepwatch import httpclient
from stepwatch.fault_injection import queries
from stepwatch.fault_injection.criteria import Criteria
from stepwatch.fault_injection.criteria import load as load_criteria
from stepwatch.fault_injection.stack import LocalStack
from stepwatch.runbooks.parse import Drill as DrillSpec
from stepwatch.runbooks.parse import load_drills
from stepwatch.thresholds import Thresholds, parse_duration

RECOVER_DEADLINE_S = 300.0  # a restarted two-rank worker warms up again before it is ready


@dataclass
class DrillResult:
    name: str
    expected_alert: str
    expected_cause: str | None = None
    passed: bool = False
    time_to_detect_s: float | None = None
    time_to_webhook_s: float | None = None
    alerts_fired: list[str] = field(default_factory=list)
    expected_labels: dict[str, str] = field(default_factory=dict)
    service_survived: bool = True
    resolved: bool = False
    time_to_resolve_s: float | None = None
    checks: dict[str, bool] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    triage_cause: str | None = None
    triage: dict[str, Any] | None = None
    injected_at: float = 0.0  # when the fault was in place (the injection call returned)
    injection_s: float = 0.0  # how long putting it in took (a knob that re-warms: many seconds)
    restored_at: float = 0.0
    ended_at: float = 0.0
    snapshots: list[str] = field(default_factory=list)

    def summary_json(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "expected_alert": self.expected_alert,
                "time_to_detect_s": _r(self.time_to_detect_s), "alerts_fired": sorted(self.alerts_fired),
                "service_survived": self.service_survived, "triage_cause": self.triage_cause}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


class Drill:
    """One drill; subclasses say how to break the service and what must hold.

    What must fire, the cause triage must name, the time limit and the knob values
    come from the drill's block in runbooks/drills.md (the text people follow by hand).
    """

    name = ""
    doc_id = ""  # the id of the drill block in runbooks/drills.md
    # True where the injection call returns once the fault is in place (a knob that re-warms first): detection
    # counts from then.  False where the injection is the fault itself (its own requests): from its start.
    in_place_when_injected = False
    companions: tuple[str, ...] = ()  # thresholds keys of alerts that may fire with it
    silent: tuple[str, ...] = ()  # thresholds keys that must NOT fire
    needs_ranks = 1
    # Whether its alerts or its triage read the calibrated per-shape baselines: a stack whose drills all say no
    # skips the calibration (70 s of steady traffic; each drill still waits for its own steady traffic).
    reads_baselines = True
    runs_last = False  # it leaves something behind that a later drill on its stack would read (campaign.by_stack)
    stream_probe = False  # its alert reads the sidecar's drift probe: the stack runs it (LocalStack.stream_probe)
    fleet = False  # it runs on the practice fleet (fault_injection/fleet.py), not on a one-instance stack
    health_turns_red = False  # the fault itself makes /readyz (or /healthz) fail: checked, not a failure
    # It restarts a process as an ordinary rollout does: a critical that held for less than production's ``for:``
    # (the restarted target's TargetDown) pages nobody, judged as in a quiet drill.
    restarts_a_target = False
    # Answers the baseline traffic may get while the fault is in (runbooks/drills.md: every request that is not
    # the fault's own answers 200); a drill whose fault is the whole service widens it and says why.
    baseline_accepts: frozenset[int] = frozenset({200})
    description = ""

    def __init__(self, th: Thresholds, spec: DrillSpec | None = None, criteria: Criteria | None = None,
                 variant: int = 0) -> None:
        self.th = th
        self.spec = (spec or next(d for d in load_drills() if d.id == self.doc_id)).variant(variant)
        self.criteria = criteria or load_criteria()
        known = {a.name for a in th.alerts.values()}
        for name in self.spec.alerts:
            if name not in known:
                raise ValueError(f"runbooks/drills.md {self.doc_id}: {name} is not an alert in the thresholds")

    @property
    def quiet(self) -> bool:
        """An ordinary operation, not a fault: no alert may fire (none of ``silent``, no critical) and
        ``within`` is how long the runner watches after it (its block: ``alerts: []``, ``cause: null``)."""
        return not self.spec.alerts

    @property
    def expected(self) -> str:
        return str(self.spec.alerts[0]) if self.spec.alerts else ""

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(self.spec.alerts)

    @property
    def cause(self) -> str:
        return str(self.spec.cause)

    @property
    def within_s(self) -> float:
        return float(parse_duration(self.spec.within, f"runbooks/drills.md {self.doc_id}: within"))

    def inject_knobs(self) -> dict[str, Any]:
        return dict(self.spec.inject.get("knobs") or {})

    def restore_knobs(self, previous: dict[str, Any]) -> dict[str, Any]:
        knobs = self.spec.restore.get("knobs")
        if knobs == "previous":
            return {k: previous[k] for k in self.inject_knobs() if previous.get(k) is not None}
        return dict(knobs or {})

    def baseline_traffic(self) -> list[dict[str, Any]] | None:
        return None  # the stack's default mix

    def settle(self, stack: LocalStack, r: DrillResult) -> None:
        """Before the fault: wait for what its detection needs beyond quiet alerts (none by default)."""

    def inject(self, stack: LocalStack, r: DrillResult) -> None:
        raise NotImplementedError

    def restore(self, stack: LocalStack, r: DrillResult) -> None:
        raise NotImplementedError

    def while_firing(self, stack: LocalStack, r: DrillResult) -> None:
        """Checks to run once the alert fired, with the fault still in place."""

    def after(self, stack: LocalStack, r: DrillResult) -> None:
        """Checks after the fault is removed."""

    def check_same_worker_memory_back(self, stack: LocalStack, r: DrillResult) -> None:
        """After an out-of-memory fault: the same worker serves (no restart) and its resident memory is back
        within ``criteria.rss_back_within`` of what it was before the fault."""
        info = stack.info()
        before, now = r.details.get("worker_rss_before"), info["worker"]["rss_bytes"]
        r.details["worker_rss_after"] = now
        r.checks["same_worker_no_restart"] = info["worker"]["pid"] == r.details.get("worker_pid_before")
        within = self.criteria.rss_back_within
        r.checks["memory_back_near_baseline"] = bool(before and now and abs(now - before) <= within * before)

    def expected_alert_matches(self, alert: dict[str, Any]) -> bool:
        return bool(alert["labels"].get("alertname") == self.expected)

    def target_labels(self) -> dict[str, str]:
        """The labels of what the drill acts on, where a stack has several (a fleet's replica); {}: the one."""
        return {}


def _http_json(url: str) -> tuple[int, Any]:
    try:
        resp = httpclient.request("GET", url, timeout=10)
        return resp.status_code, resp.json()
    except Exception as e:
        return 0, {"error": f"{type(e).__name__}: {e}"}


def _scrape_s(th: Thresholds) -> float:
    return parse_duration(th.profiles["drill"].scrape_interval)


def _rate_window(th: Thresholds, stack: LocalStack | None = None) -> str:
    """The rate window of the stack's rules profile (the drill profile's when it has none)."""
    profile = getattr(stack, "profile", "drill")
    return th.profiles[profile if profile in th.profiles else "drill"].rate_window


def _mean_step(stack: LocalStack, th: Thresholds) -> float | None:
    return stack.prom.value(queries.mean_step(_rate_window(th, stack)))


def _quantiles(stack: LocalStack, th: Thresholds) -> dict[str, float | None]:
    w = _rate_window(th, stack)
    out: dict[str, float | None] = {}
    for name, q in queries.LATENCY_QUANTILES.items():
        v = stack.prom.value(queries.request_quantile(q, w))
        out[name] = None if v is None or math.isnan(v) else v
    return out


def _service_requests(stack: LocalStack) -> float:
    return stack.prom.value(queries.service_requests()) or 0.0
