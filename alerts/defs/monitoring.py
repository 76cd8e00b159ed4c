"""Monitoring alerts: stepwatch watching itself (scrape targets, its own hooks)."""

from __future__ import annotations

from stepwatch.alerts.defs.base import (
    I1,
    SC,
    SIDECAR,
    SVC,
    AlertDef,
    Case,
    Expect,
    Series,
    Timing,
    const,
    events_case,
    need_window,
    pending,
)
from stepwatch.alerts.promql import events, num, sel
from stepwatch.thresholds import AlertSpec, Thresholds, agent_job

SUBSYSTEM = "monitoring"


# ----- target down ----------------------------------------------------------------------------

def _down_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return sel("up", f'job=~"{th.job_regex}"') + " == 0"


def _down_cases(p: Timing) -> list[Case]:
    n = p.n(p.F + p.s)
    series = [Series("up", {"job": SVC, "instance": I1}, const(0, n)),
              Series("up", {"job": SIDECAR, "instance": SC}, const(1, n)),
              Series("up", {"job": "node", "instance": "10.0.0.1:9100"}, const(0, n))]
    return [Case(p.spec.key, "the service target is down; the sidecar is up; a non-stepwatch job is ignored",
                 series, [pending(p), Expect(p.F or p.e, [({"job": SVC, "instance": I1}, 0.0)])])]


# ----- a fleet node silent -------------------------------------------------------------------

def _node_silent_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    """Per node: its agent unreachable.  The agent's own ``up`` is the one series that turns 0 when a node goes:
    the replicas' series it wrote simply stop, and their last values (``up`` 1) stay for Prometheus' lookback."""
    agents = sel("up", f'job="{agent_job(th)}"')
    return f"max by (node) ({agents}) == {num(spec.threshold)}"


def _node_silent_cases(p: Timing) -> list[Case]:
    n = p.n(p.F + p.s)
    agent = agent_job(p.th)
    series = [Series("up", {"job": agent, "instance": "10.0.0.1:9090", "node": "node-0"}, const(0, n)),
              Series("up", {"job": agent, "instance": "10.0.0.2:9090", "node": "node-1"}, const(1, n)),
              Series("up", {"job": SVC, "instance": I1, "node": "node-1"}, const(0, n))]
    return [Case(p.spec.key, "node-0's agent is down; node-1's is up (a target down on it is TargetDown's)",
                 series, [pending(p), Expect(p.F or p.e, [({"node": "node-0"}, 0.0)])])]


# ----- exporter errors ------------------------------------------------------------------------

def _hook_errors_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return events("stepwatch_exporter_errors_total", need_window(spec, profile), spec.threshold)


def _hook_errors_cases(p: Timing) -> list[Case]:
    return [events_case(p, "stepwatch_exporter_errors_total", {"component": "vae.exit"},
                        {"component": "scheduler.step"}, {"component": "transformer.cache_context"})]


ALERTS = (
    AlertDef("target_down", _down_expr, ("instance", "pod"), _down_cases, explains=("target_unreachable",)),
    AlertDef("node_silent", _node_silent_expr, ("node",), _node_silent_cases),
    AlertDef("exporter_errors", _hook_errors_expr, ("instance", "component"), _hook_errors_cases),
)
