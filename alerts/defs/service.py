"""Service alerts: what users of the inference service see (queue wait, errors, bad images)."""

from __future__ import annotations

from stepwatch.alerts.defs.base import (
    I1,
    I2,
    SVC,
    AlertDef,
    Case,
    Expect,
    Series,
    Timing,
    const,
    events_case,
    jump,
    need_window,
    pending,
    ramp,
    rate_window,
)
from stepwatch.alerts.promql import events, num, past_limit, sel, sum_increase
from stepwatch.thresholds import AlertSpec, Thresholds, capacity_headroom, probe_job, stall_floor

SUBSYSTEM = "service"


# ----- queue wait -----------------------------------------------------------------------------

def _queue_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return f"instance_pool:stepwatch_queue_estimated_wait_seconds:slo_ratio > {num(spec.threshold)}"


def _queue_cases(p: Timing) -> list[Case]:
    n = p.n(p.F + p.s)
    series = []
    for pool, slo, ratio in (("large", 60, p.T * 1.05), ("small", 10, p.T * 0.95)):
        lab = {"job": SVC, "instance": I1, "pool": pool}
        series += [Series("stepwatch_queue_slo_seconds", lab, const(slo, n)),
                   Series("stepwatch_queue_estimated_wait_seconds", lab, const(slo * ratio, n))]
    return [Case(p.spec.key, "pool large just over, pool small just under", series,
                 [pending(p), Expect(p.F or p.e, [({"job": SVC, "instance": I1, "pool": "large"}, p.T * 1.05)])])]


# ----- request error ratio --------------------------------------------------------------------

def _errors_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    w = rate_window(th, profile)
    floor = spec.extra.get("min_requests", 0)
    ratio = f"pool:stepwatch_service_requests:error_ratio_rate{w} > {num(spec.threshold)}"
    if not floor:
        return ratio
    requests = sum_increase(sel("stepwatch_service_requests_total"), w, "job, pool")
    return f"  {ratio}\nand on (job, pool)\n  {requests} >= {num(float(floor))}"


def _errors_cases(p: Timing) -> list[Case]:
    fire = p.s + p.F
    n = p.n(fire + p.s)
    codes: dict[str, dict[str, float]] = {
        "large": {"200": 100 - 100 * p.T * 1.1, "500": 60 * p.T * 1.1, "507": 40 * p.T * 1.1},
        "small": {"200": 100 - 100 * p.T * 0.9, "503": 100 * p.T * 0.9, "429": 10},
        "other": {"200": 10},
        # every request fails, but a handful in the window: below min_requests, silent
        "idle": {"507": 0.05}}
    series = [Series("stepwatch_service_requests_total", {"job": SVC, "instance": I1, "pool": pool, "code": c},
                     ramp(round(v, 9), n)) for pool, cs in codes.items() for c, v in cs.items()]
    return [Case(p.spec.key, "pool large just over (500 + 507), pool small just under (429 is not an error), "
                 "pool other without errors, pool idle all failing but under min_requests", series,
                 [Expect(fire - p.e, [], "for: not elapsed"),
                  Expect(fire, [({"job": SVC, "pool": "large"}, p.T * 1.1)])])]


# ----- worker stalled -------------------------------------------------------------------------

def _stalled_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return past_limit("stepwatch_worker_busy_seconds", "stepwatch_worker_expected_seconds", spec.threshold,
                      stall_floor(spec, profile))


def _stalled_cases(p: Timing) -> list[Case]:
    """Idle at the first scrape, then each pool busy at its value (so nothing fires at 0 even with no ``for:``)."""
    fire = p.s + p.F
    n = p.n(fire + p.s)
    floor = stall_floor(p.spec, p.profile)
    # (pool, expected, busy): over the factor; under it (both above the floor); under the floor though over the
    # factor; over the floor; idle.
    long = 2 * floor / p.T  # a prediction whose factor x lies above the floor
    pools = (("large", long, long * p.T * 1.1), ("small", long, long * p.T * 0.9),
             ("cold", floor / p.T / 2, floor * 0.9), ("idle", 0.0, 0.0), ("tiny", floor / p.T / 2, floor * 1.1))
    series = []
    for pool, expected, busy in pools:
        lab = {"job": SVC, "instance": I1, "pool": pool}
        series += [Series("stepwatch_worker_expected_seconds", lab, const(expected, n)),
                   Series("stepwatch_worker_busy_seconds", lab, jump(0, 1, busy, n))]
    fired = [({"job": SVC, "instance": I1, "pool": "large"}, long * p.T * 1.1),
             ({"job": SVC, "instance": I1, "pool": "tiny"}, floor * 1.1)]
    return [Case(p.spec.key, "pool large over the factor, small under it, cold under the floor, tiny over the floor, "
                 "idle at 0", series, [pending(p), Expect(fire, fired)])]


# ----- non-finite images ----------------------------------------------------------------------

def _nonfinite_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return events("stepwatch_service_images_nonfinite_total", need_window(spec, profile), spec.threshold)


def _nonfinite_cases(p: Timing) -> list[Case]:
    return [events_case(p, "stepwatch_service_images_nonfinite_total", {"pool": "large"}, {"pool": "small"},
                        {"pool": "other"})]


# ----- video jobs failing ---------------------------------------------------------------------

def _video_failing_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return events('stepwatch_video_jobs_finished_total{outcome="failed"}', need_window(spec, profile),
                  spec.threshold)


def _video_failing_cases(p: Timing) -> list[Case]:
    n = p.n(4 * p.Wa + 8 * p.s)
    done = Series("stepwatch_video_jobs_finished_total", {"job": SVC, "instance": I1, "pool": "video",
                                                          "outcome": "succeeded"}, ramp(1, n))
    return [events_case(p, "stepwatch_video_jobs_finished_total", {"pool": "video", "outcome": "failed"},
                        {"pool": "clips", "outcome": "failed"}, {"pool": "shorts", "outcome": "failed"}, [done])]


# ----- pool capacity --------------------------------------------------------------------------

def _capacity_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    w = rate_window(th, profile)
    least = int(spec.extra.get("min_instances", 2))
    return (f"  job:stepwatch_service_instances:needed_rate{w}\n/ on (job)\n"
            f"  (job:stepwatch_service_instances:ready >= {least})\n> {num(spec.threshold)}")


def _capacity_cases(p: Timing) -> list[Case]:
    """Per job: two ready instances, pool small; requests q/s each at 0.5 worker seconds (0.1 s queued): needed =
    headroom x 2q x 0.5 against 2 ready, so the ratio is headroom x q x 0.5.  A request rate is only exact once
    its window is full of samples (a young series' rate reads low), so the alert fires one window in."""
    fire = p.W + p.s + p.F
    n = p.n(fire + p.s)
    headroom = capacity_headroom(p.spec)
    series = []
    jobs = {"stepwatch-a": (p.T * 1.1, 2), "stepwatch-b": (p.T * 0.9, 2), "stepwatch-c": (p.T * 3, 1)}
    for job, (ratio, instances) in jobs.items():
        q = ratio / (headroom * 0.5)
        for i in (I1, I2)[:instances]:
            lab = {"job": job, "instance": i, "pool": "small"}
            series += [Series("stepwatch_service_ready", {"job": job, "instance": i}, const(1, n)),
                       Series("stepwatch_service_requests_total", {**lab, "code": "200"}, ramp(round(q * p.s, 9), n)),
                       Series("stepwatch_service_request_duration_seconds_sum", lab, ramp(round(q * p.s * 0.6, 9), n)),
                       Series("stepwatch_queue_wait_seconds_sum", lab, ramp(round(q * p.s * 0.1, 9), n)),
                       Series("stepwatch_queue_wait_seconds_count", lab, ramp(round(q * p.s, 9), n)),
                       Series("stepwatch_queue_depth", lab, const(0, n))]
    return [Case(p.spec.key, "a pool needing 1.1x its ready instances fires, 0.9x does not, a pool of one at 3x "
                 "does not", series,
                 [Expect(p.s + p.F, [], "the window not yet full: a young rate reads low"),
                  Expect(fire, [({"job": "stepwatch-a"}, p.T * 1.1)])])]


# ----- the users' endpoint -------------------------------------------------------------------

def _endpoint_expr(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    """The black-box probe through the balancer, by probed URL: failed on both evaluators' own scrapes alike
    (each evaluator scrapes the blackbox exporter itself; its copy of the alert is the same alert)."""
    probes = sel("probe_success", f'job="{probe_job(th)}"')
    return f"max by (instance) ({probes}) == {num(spec.threshold)}"


def _endpoint_cases(p: Timing) -> list[Case]:
    n = p.n(p.F + p.s)
    job = probe_job(p.th)
    down, up = "http://10.0.0.9:8080/readyz", "http://10.0.0.8:8080/readyz"
    series = [Series("probe_success", {"job": job, "instance": down}, const(0, n)),
              Series("probe_success", {"job": job, "instance": up}, const(1, n)),
              Series("probe_success", {"job": "other-blackbox", "instance": "http://10.0.0.7/"}, const(0, n))]
    return [Case(p.spec.key, "the endpoint's probe fails; another endpoint's succeeds; another job's probe is not ours",
                 series, [pending(p), Expect(p.F or p.e, [({"instance": down}, 0.0)])])]


ALERTS = (
    # A probe that times out or gets 429 behind the queue is the queue's story.
    AlertDef("queue_wait", _queue_expr, ("instance", "pool"), _queue_cases, explains=("queue_backlog",)),
    AlertDef("error_ratio", _errors_expr, ("pool",), _errors_cases, rate_based=True),
    AlertDef("worker_stalled", _stalled_expr, ("instance", "pool"), _stalled_cases),
    AlertDef("nonfinite_outputs", _nonfinite_expr, ("instance", "pool"), _nonfinite_cases),
    AlertDef("video_jobs_failing", _video_failing_expr, ("instance", "pool", "outcome"), _video_failing_cases),
    AlertDef("pool_capacity", _capacity_expr, (), _capacity_cases, rate_based=True),
    AlertDef("endpoint_down", _endpoint_expr, ("instance",), _endpoint_cases),
)
