"""Every PromQL query the drills run, as functions of the rate window, built from the PromQL vocabulary.

They are data, not strings inside the drills, so that tests/test_queries.py can check
each one against the metric catalog without a running stack (as the rules, dashboards
and runbook checks are checked).  A drill that needs a new query adds a function here
and lists it in :func:`drill_queries`.
"""

from __future__ import annotations

from stepwatch.alerts.promql import agg, cache_hit_ratio, mean_step_time, quantile, sel, sum_rate
from stepwatch.thresholds import AGENT_JOB, PROBE_JOB
from stepwatch.thresholds import load as load_thresholds

REQUEST_SECONDS_BUCKET = "stepwatch_service_request_duration_seconds_bucket"
LATENCY_QUANTILES = {"p50": 0.5, "p99": 0.99}  # the off-menu drill: p99 rises while p50 stays flat


def mean_step(window: str) -> str:
    """Mean seconds per denoising step over all shapes (the cache drill: performance normal or better)."""
    return mean_step_time(window)


def step_by_shape(window: str) -> str:
    """Mean seconds per step, per shape: the per-shape step-time baselines."""
    return mean_step_time(window, "shape")


def hit_ratio_by_shape(window: str) -> str:
    """Cache hits / decisions, per shape: the per-shape hit-rate baselines."""
    return cache_hit_ratio(window, "shape")


def request_quantile(q: float, window: str) -> str:
    """The q-quantile of service request latency over all pools."""
    return quantile(q, REQUEST_SECONDS_BUCKET, window)


def psnr_p10() -> str:
    """The worst probe set's p10 PSNR (dB)."""
    return agg("min", sel("stepwatch_quality_psnr_decibels", 'stat="p10"'))


def psnr_p10_by_pod() -> str:
    """Each replica's p10 PSNR (dB) on the practice fleet (its sidecar's series carry the replica's ``pod``)."""
    return agg("min", sel("stepwatch_quality_psnr_decibels", 'stat="p10"'), "pod")


def quality_gate() -> str:
    """The strictest PSNR gate (dB) the probe sets are held to."""
    return agg("min", "stepwatch_quality_gate_decibels")


def estimated_wait() -> str:
    """The longest estimated queue wait (seconds) of any pool."""
    return agg("max", "stepwatch_queue_estimated_wait_seconds")


def queue_depth_by_pool() -> str:
    """Requests queued, per pool (the worst instance's)."""
    return agg("max", "stepwatch_queue_depth", "pool")


def service_requests() -> str:
    """Requests the service has answered so far, all pools and codes."""
    return agg("sum", "stepwatch_service_requests_total")


def rank_stuck_outside_collectives() -> str:
    """Per rank: seconds without progress that it did not spend waiting in a collective (the worker-stall
    drill: the frozen rank is the one with the most; a rank waiting for it has about 0)."""
    return (f"max by (rank) ({sel('stepwatch_rank_progress_age_seconds')}"
            f" - {sel('stepwatch_rank_collective_wait_seconds')})")


def rank_busy_ratio(window: str) -> str:
    """Per rank: busy seconds per step over the fastest rank's (the rank-skew alert's own recorded series)."""
    return sel(f"instance_rank:stepwatch_rank_busy_seconds:ratio_to_fastest_rate{window}")


def pipeline_cpu_wait(window: str) -> str:
    """Thread-seconds per second the pipeline's process waited for a CPU (the CPU-contention drill)."""
    return sum_rate("stepwatch_pipeline_cpu_wait_seconds_total", window)


def pipeline_cpu_starved(window: str) -> str:
    """The pipeline's CPU waits per second it ran (the run read as at least ``diagnosis.cpu_run_floor``): the
    step-time runbook's starved-CPU measure, which the CPU-contention drill checks as the runbook asks it."""
    floor = float(load_thresholds().diagnosis["cpu_run_floor"])
    return (f"{sum_rate('stepwatch_pipeline_cpu_wait_seconds_total', window)}\n/\n"
            f"clamp_min({sum_rate('stepwatch_pipeline_cpu_run_seconds_total', window)}, {floor:g})")


def few_step_hits() -> str:
    """Cache hits on few-step requests so far, all shapes (the cache-on-distilled drill: the exporter counted them)."""
    return agg("sum", "stepwatch_cache_few_step_hits_total")


def stream_chunk_psnr() -> str:
    """The stream probe's worst chunk PSNR (dB) per chunk-index range (the drift drill: early ranges hold)."""
    return sel("stepwatch_quality_stream_chunk_psnr_decibels")


# The central evaluators' own scrapes (the node agents, the blackbox exporter): not remote-written.
_REMOTE_WRITTEN = f'job!~"{AGENT_JOB}|{PROBE_JOB}"'


def targets_up() -> str:
    """Every remote-written target's ``up`` (the fleet: every target reached the central store through the node
    agents; the evaluators' own scrapes of the agents are ``agents_up``)."""
    return sel("up", _REMOTE_WRITTEN)


def agents_up() -> str:
    """Each node agent's ``up`` as the central evaluators scrape it (StepwatchNodeSilent's series)."""
    return sel("up", f'job="{AGENT_JOB}"')


def up_samples(window: str) -> str:
    """``up`` samples per remote-written target over ``window`` (a central-store outage: none of the window may
    be missing).  The evaluators' own scrapes of the node agents are not remote-written: down with them."""
    return f"count_over_time({sel('up', _REMOTE_WRITTEN)}[{window}])"


def least_complete(window: str) -> str:
    """The least complete remote-written target's scrapes over ``window`` against its job's best-covered one's
    (1: every instance counts in the fleet comparisons, ``diagnosis.complete_ratio``)."""
    return f"min(instance:stepwatch_up_samples:ratio_to_most_rate{window}{{{_REMOTE_WRITTEN}}})"


def requests_ok_by_instance() -> str:
    """Requests answered 200 so far, per service instance (the fleet's load test against its clients' count)."""
    return agg("sum", sel("stepwatch_service_requests_total", 'job="stepwatch-service"', 'code="200"'), "instance")


def series_per_target() -> str:
    """Series of each service and sidecar target (the fleet's scale table)."""
    return 'count by (job, instance) ({job=~"stepwatch-service|stepwatch-sidecar"})'


def series_per_family() -> str:
    """Series per metric family and service instance (which families cost the most)."""
    return 'count by (__name__, instance) ({job="stepwatch-service"})'


def cardinality_queries() -> dict[str, str]:
    """The fleet's scale measurements: series counts over every name of a job, so they name no series (checked
    apart from the drills' queries, by job)."""
    return {"series_per_target": series_per_target(), "series_per_family": series_per_family()}


def rollout_keys() -> str:
    """The knobs (or ``fingerprint``) the last rollout by restart changed, one series per key."""
    return sel("stepwatch_service_config_rollout_key_active") + " == 1"


def alert_evaluations(alertname: str, window: str) -> str:
    """The most evaluations any one series of the alert spent pending or firing over ``window``: how long its
    condition held (a quiet drill: would production's longer ``for:`` have paged?)."""
    alerts = sel("ALERTS", f'alertname="{alertname}"')
    return f"max(sum without (alertstate) (count_over_time({alerts}[{window}])))"


def drill_queries(window: str) -> dict[str, str]:
    """Every query the drills and the baseline calibration run, by name, for one rate window."""
    out = {"mean_step": mean_step(window), "step_by_shape": step_by_shape(window),
           "hit_ratio_by_shape": hit_ratio_by_shape(window), "psnr_p10": psnr_p10(),
           "psnr_p10_by_pod": psnr_p10_by_pod(), "quality_gate": quality_gate(), "estimated_wait": estimated_wait(),
           "queue_depth": queue_depth_by_pool(),
           "service_requests": service_requests(), "rank_stuck": rank_stuck_outside_collectives(),
           "rank_busy_ratio": rank_busy_ratio(window), "pipeline_cpu_wait": pipeline_cpu_wait(window),
           "pipeline_cpu_starved": pipeline_cpu_starved(window),
           "few_step_hits": few_step_hits(), "stream_chunk_psnr": stream_chunk_psnr(), "targets_up": targets_up(),
           "agents_up": agents_up(),
           "requests_ok_by_instance": requests_ok_by_instance(), "up_samples": up_samples(window),
           "least_complete": least_complete(window),
           "rollout_keys": rollout_keys(), "alert_evaluations": alert_evaluations("StepwatchTargetDown", window)}
    for name, q in LATENCY_QUANTILES.items():
        out[f"request_{name}"] = request_quantile(q, window)
    return out
