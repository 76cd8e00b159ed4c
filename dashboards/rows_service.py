"""The overview's service rows: traffic, the queue and its stalled workers, the fleet's balancer, video jobs.

Row functions of ``dashboards/overview.py``'s ``ROWS["service"]``, in board order.
"""

from __future__ import annotations

from stepwatch.alerts.promql import (
    floored_multiple,
    num,
    pct,
    quantile,
    ratio_of_rates,
    sel,
    sum_increase,
    sum_rate,
)
from stepwatch.dashboards.board import F_POOL, INST, RATE, RED, Board, T
from stepwatch.thresholds import balancer_job, capacity_headroom, probe_job, stall_floor


def traffic_row(b: Board) -> None:
    er = b.th.alert("error_ratio")
    sreq = sel("stepwatch_service_requests_total", INST, F_POOL)
    b.row("Traffic and latency")
    b.timeseries(
        "Requests by pool and code", """Generation requests per second by pool and HTTP code. Healthy: all 200;
        429 = queue past its hard limit, 503 = warming up or worker restarting, 507 = out of memory.""",
        "reqps", [T(sum_rate(sreq, RATE, "pool, code"), "{{pool}} {{code}}")], min_=0)
    b.timeseries(
        er.panel, """Share of generation requests answered 5xx, per pool (0 when none failed). Healthy: 0.""",
        "percentunit",
        [T(ratio_of_rates(sel("stepwatch_service_requests_total", INST, F_POOL, 'code=~"5.."'), sreq, RATE,
                          "job, pool", zero_fill=True), "{{pool}}")],
        alerts=["error_ratio"], lines=[(er.threshold, RED)], min_=0)
    lat = sel("stepwatch_service_request_duration_seconds_bucket", INST, F_POOL)
    b.timeseries(
        "Latency p50 / p99, by pool", """End-to-end latency (queue + work) of generation requests per pool,
        with the pool's latency SLO dashed. Healthy: p99 under the SLO. p99 up with p50 flat = a few slow
        requests (serving recompiles, a queue backlog in one pool).""", "s",
        [T(quantile(0.5, lat, RATE, "pool"), "{{pool}} p50"), T(quantile(0.99, lat, RATE, "pool"), "{{pool}} p99"),
         T(f"max by (pool) ({sel('stepwatch_queue_slo_seconds', INST, F_POOL)})", "{{pool}} SLO", "ref")],
        min_=0, span=24)


def queue_row(b: Board) -> None:
    qw = b.th.alert("queue_wait")
    b.row("Queue")
    b.timeseries(
        qw.panel, f"""Estimated queue wait (GPU-seconds of queued work / workers) as a share of the pool's
        latency SLO. Healthy: well under {pct(qw.threshold)}; above it, scale out (a cold start takes minutes:
        weights + compile).""", "percentunit",
        [T(sel("instance_pool:stepwatch_queue_estimated_wait_seconds:slo_ratio", INST, F_POOL),
           "{{pool}} @ {{instance}}")],
        alerts=["queue_wait"], lines=[(qw.threshold, RED)], min_=0)
    qwait = sel("stepwatch_queue_wait_seconds_bucket", INST, F_POOL)
    b.timeseries(
        f"Estimated queue wait vs SLO x {num(qw.threshold)}, by pool", f"""Estimated queue wait in seconds and
        the scale-out line (SLO x {num(qw.threshold)}, dashed red), with the measured p99 wait of the requests
        that left the queue. Healthy: the estimate stays under the dashed line.""", "s",
        [T(sel("stepwatch_queue_estimated_wait_seconds", INST, F_POOL), "{{pool}} estimated @ {{instance}}"),
         T(quantile(0.99, qwait, RATE, "pool"), "{{pool}} measured p99"),
         T(f"{sel('stepwatch_queue_slo_seconds', INST, F_POOL)} * {num(qw.threshold)}",
           f"{{{{pool}}}} scale out (SLO x {num(qw.threshold)})", "limit")],
        alerts=["queue_wait"], min_=0)
    b.timeseries(
        "Queue depth, by pool", """Requests waiting for a worker, per pool. Healthy: 0 to a few. Depth alone
        is not the signal (a 2048² request weighs ~16x a 512² one); the estimated wait is.""", "short",
        [T(sel("stepwatch_queue_depth", INST, F_POOL), "{{pool}} @ {{instance}}")], min_=0, decimals=0,
        span=12, height=6)
    _worker_stall_panel(b)


def fleet_row(b: Board) -> None:
    """The pool's capacity by the seeds' formula: instances needed against instances ready."""
    pc = b.th.alert("pool_capacity")
    window = b.th.profiles["production"].rate_window  # recorded in both rule files under the same names
    needed, ready = f"job:stepwatch_service_instances:needed_rate{window}", "job:stepwatch_service_instances:ready"
    b.row("Fleet: capacity")
    _endpoint_panel(b)
    b.timeseries(
        pc.panel, f"""Instances the pool needs (requests per second, plus queue growth, x worker seconds per
        request x {num(capacity_headroom(pc))}, over {window}) against the instances ready.
        Healthy: needed under ready. Needed above ready for minutes ({pc.name}): add instances before the queues
        grow; they take minutes to load and compile.""", "short",
        [T(needed, "needed ({{job}})"), T(ready, "ready ({{job}})", "limit")],
        alerts=["pool_capacity"], min_=0)
    b.timeseries(
        "Demand and seconds per request, by pool", f"""What the needed line is made of: requests per second per
        pool (all answers, 429s included: they are demand too) and the worker seconds one request costs (latency
        minus queue wait, over {window}). A rising request rate is more load; rising seconds per request are
        slower instances or larger requests.""", "short",
        [T(sum_rate(sel("stepwatch_service_requests_total", F_POOL), RATE, "job, pool"), "{{pool}} requests/s"),
         T(sel(f"pool:stepwatch_service_work_seconds:mean_rate{window}", F_POOL), "{{pool}} seconds/request")],
        min_=0)


def _endpoint_panel(b: Board) -> None:
    """What clients see: the black-box probe through the balancer, beside the balancer's own scrape."""
    ed = b.th.alert("endpoint_down")
    probes, balancer = sel("probe_success", f'job="{probe_job(b.th)}"'), sel("up", f'job="{balancer_job(b.th)}"')
    b.timeseries(
        ed.panel, f"""The blackbox exporter's probe of the users' endpoint through the load balancer (1 = answered
        2xx in time), per probed URL, and whether the balancer's own exporter is scraped. Healthy: both at 1.
        The probe at 0 for {ed.for_["production"]} is {ed.name}; with the balancer's scrape at 0 too and its node
        agent up, the balancer hangs or is gone.""", "short",
        [T(f"max by (instance) ({probes})", "probe {{instance}}"), T(f"max({balancer})", "balancer scraped", "ref")],
        alerts=["endpoint_down"], min_=0, max_=1, decimals=0, span=24, height=6)


def _worker_stall_panel(b: Board) -> None:
    ws = b.th.alert("worker_stalled")
    floor = stall_floor(ws, "production")  # one board for both; the drill stack's shorter floor is in its rules
    busy, expected = (sel(m, INST, F_POOL) for m in ("stepwatch_worker_busy_seconds",
                                                      "stepwatch_worker_expected_seconds"))
    b.timeseries(
        ws.panel, f"""Seconds the worker has spent on the generation in flight, with its stall line: {num(ws.threshold)}
        x the queue's prediction, never below {num(floor)} s (dashed red). Healthy: a sawtooth that drops to 0 as
        each request ends, under the line. A ramp that keeps climbing = a hung worker (a frozen process, a rank
        stuck in a collective); the service restarts it at twice the line.""", "s",
        [T(busy, "{{pool}} busy @ {{instance}}"),
         T(f"{floored_multiple(expected, ws.threshold, floor)} and {busy} > 0",
           f"{{{{pool}}}} stall line (x {num(ws.threshold)})", "limit")],
        alerts=["worker_stalled"], min_=0, span=12, height=6)


def video_row(b: Board) -> None:
    pool = sel("stepwatch_video_jobs_finished_total", INST, F_POOL)
    b.row("Video jobs")
    b.timeseries(
        b.th.alert("video_jobs_failing").panel, """Video jobs that ended per interval, by pool and outcome
        (succeeded, failed, cancelled). Healthy: no failed. A job fails after its 202, so no HTTP error shows it;
        its error code says why (out_of_memory, worker_died, timeout).""", "short",
        [T(sum_increase(pool, RATE, "job, instance, pool, outcome"), "{{pool}} {{outcome}} @ {{instance}}")],
        alerts=["video_jobs_failing"], bars=True, min_=0, decimals=0, no_value="0")
    slo = sel("stepwatch_queue_slo_seconds", INST, F_POOL)
    b.timeseries(
        "Video jobs in flight and the oldest job's age", """Video jobs queued and running (left), and the
        age of the oldest one still in flight against the pool's SLO (dashed). Healthy: a few jobs, the oldest
        younger than the SLO. A growing backlog with the oldest job ageing = under-provisioned pool or a
        stuck worker.""", "s",
        [T(sel("stepwatch_video_oldest_job_age_seconds", INST, F_POOL), "{{pool}} oldest job @ {{instance}}"),
         T(f"{slo} and on (job, instance, pool) {sel('stepwatch_video_oldest_job_age_seconds', INST, F_POOL)}",
           "{{pool}} SLO", "ref"),
         T(sel("stepwatch_video_jobs_depth", INST, F_POOL), "{{pool}} {{state}} jobs")], min_=0)
    dur = sel("stepwatch_video_job_duration_seconds_bucket", INST, F_POOL)
    b.timeseries(
        "Video job time and time per frame", """Creation to completion of succeeded jobs (p50, p99: queue,
        generation and encoding) and seconds per delivered frame. Healthy: p99 under the pool's SLO; seconds per
        frame flat for a fixed mix (a video's cost is fixed at admission by size, frames, steps and CFG).""",
        "s",
        [T(quantile(0.5, dur, RATE, "pool"), "{{pool}} p50"), T(quantile(0.99, dur, RATE, "pool"), "{{pool}} p99"),
         T(ratio_of_rates(sel("stepwatch_video_job_duration_seconds_sum", INST, F_POOL),
                          sel("stepwatch_video_frames_total", INST, F_POOL), RATE, "pool"), "{{pool}} per frame")],
        min_=0, span=24, height=6)
