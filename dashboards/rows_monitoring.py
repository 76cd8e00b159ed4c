"""The overview's monitoring row: scrape targets, node agents, the exporter and sidecar, the GPUs.

Row functions of ``dashboards/overview.py``'s ``ROWS["monitoring"]``.
"""

from __future__ import annotations

from stepwatch.alerts.promql import (
    events,
    num,
    pct,
    sel,
    sum_increase,
)
from stepwatch.dashboards.board import GREEN, INST, RATE, RED, Board, T
from stepwatch.thresholds import agent_job


def health_row(b: Board) -> None:
    b.row("Health: scrape targets, exporter, sidecar, GPUs")
    _stepwatch_health_panels(b)
    _gpu_memory_and_load_panels(b)
    _gpu_clock_and_error_panels(b)


def _stepwatch_health_panels(b: Board) -> None:
    up = {"0": ("DOWN", RED), "1": ("UP", GREEN)}
    b.stat(
        b.th.alert("target_down").panel, """Whether Prometheus can scrape each stepwatch target (service and
        sidecar). Healthy: all UP. A DOWN target blinds every alert that reads it.""", "none",
        [T(sel("up", f'job=~"{b.th.job_regex}"', INST), "{{job}} {{instance}}")],
        alerts=["target_down"], mappings=up)
    _node_agents_panel(b)
    b.timeseries(
        b.th.alert("exporter_errors").panel, """Errors inside stepwatch's own hooks per interval, by component
        (the first one included). The pipeline never sees them, but that hook's signals are missing or wrong.
        Healthy: none.""", "short",
        [T(events(sel("stepwatch_exporter_errors_total", INST), RATE, by="job, instance, component"),
           "{{component}} @ {{instance}}")],
        alerts=["exporter_errors"], bars=True, min_=0, decimals=0, no_value="0", span=6, height=6)
    b.stat(
        "Worker and NVML up", """Worker process alive, service warmed up, and the sidecar's NVML collector
        answering. Healthy: all 1 (NVML is 0 on a machine without a GPU, and the GPU panels are then
        empty).""", "none",
        [T(sel("stepwatch_worker_up", INST), "worker up {{instance}}"),
         T(sel("stepwatch_service_ready", INST), "ready {{instance}}"),
         T(sel("stepwatch_nvml_up", INST), "NVML up {{instance}}")],
        mappings=up)
    b.timeseries(
        "Worker restarts", """Worker processes restarted after dying, per interval. Healthy: none; each
        restart fails its in-flight requests and costs a warm-up.""", "short",
        [T(sum_increase(sel("stepwatch_worker_restarts_total", INST), RATE, "instance"), "{{instance}}")],
        bars=True, min_=0, span=6, height=6)


def _gpu_memory_and_load_panels(b: Board) -> None:
    mp = b.th.alert("memory_pressure")
    total = sel("stepwatch_gpu_memory_total_bytes", INST)
    b.timeseries(
        "GPU memory used / total (NVML)", f"""Device memory in use per GPU as NVML sees it (all processes),
        with the total and {pct(mp.threshold)} of it. Healthy: stable; a climb without traffic = another
        process or a leak.""", "bytes",
        [T(sel("stepwatch_gpu_memory_used_bytes", INST), "GPU {{gpu}} used @ {{instance}}"),
         T(total, "GPU {{gpu}} total", "ref"),
         T(f"{total} * {num(mp.threshold)}", f"GPU {{{{gpu}}}} {pct(mp.threshold)}", "limit")], min_=0)
    b.timeseries(
        "GPU utilization (NVML)", """Share of time a kernel ran. Says nothing about efficiency (eager FLUX shows
        ~100% at MFU 0.31): read MFU for that. Healthy: high while serving.""", "percentunit",
        [T(sel("stepwatch_gpu_utilization_ratio", INST), "GPU {{gpu}} @ {{instance}}")], min_=0, max_=1)


def _gpu_clock_and_error_panels(b: Board) -> None:
    b.timeseries(
        "GPU SM clock and throttling", """SM clock per GPU, and 1 while a clock throttle reason is active.
        Healthy: clocks flat at the application clock, no throttle; one GPU lower = the straggler rank's
        GPU.""", "hertz",
        [T(sel("stepwatch_gpu_sm_clock_hertz", INST), "GPU {{gpu}} @ {{instance}}"),
         T(f"{sel('stepwatch_gpu_throttle_active', INST)} == 1", "GPU {{gpu}} throttled: {{reason}}")],
        min_=0)
    b.timeseries(
        "GPU temperature", """Temperature per GPU. Healthy: steady under the slowdown temperature; a hot GPU
        throttles its clock and drags its rank.""", "celsius",
        [T(sel("stepwatch_gpu_temperature_celsius", INST), "GPU {{gpu}} @ {{instance}}")], min_=0)
    b.timeseries(
        "GPU power", """Power draw per GPU. Healthy: high and steady while serving; a GPU at its power limit
        with a lower clock is power-throttled.""", "watt",
        [T(sel("stepwatch_gpu_power_watts", INST), "GPU {{gpu}} @ {{instance}}")], min_=0)
    b.timeseries(
        "GPU XID and NVML read errors", """XID errors reported by NVML events and failed NVML reads per GPU
        per interval. Healthy: none; an XID usually means a driver or hardware fault on that GPU.""", "short",
        [T(sum_increase(sel("stepwatch_gpu_xid_errors_total", INST), RATE, "instance, gpu"), "GPU {{gpu}} XID"),
         T(sum_increase(sel("stepwatch_gpu_read_errors_total", INST), RATE, "instance, gpu"),
           "GPU {{gpu}} read errors")], bars=True, min_=0)


def _node_agents_panel(b: Board) -> None:
    """Each node's agent as the central evaluators scrape it, beside the balancer's view of each replica."""
    ns = b.th.alert("node_silent")
    b.timeseries(
        ns.panel, f"""Each fleet node's Prometheus agent (1 = the central evaluators scrape it) and each replica
        as the load balancer's health checks see it (1 = up). Healthy: every line at 1. An agent at 0 is a silent
        node ({ns.name}): its replicas' series stop and their last values stay for five minutes; the balancer's
        lines tell whether its replicas went with it (node down) or still serve (only the agent).""", "short",
        [T(f'up{{job="{agent_job(b.th)}"}}', "agent {{node}}"),
         T('max by (server) (haproxy_server_status{state="UP"})', "balancer: {{server}}")],
        alerts=["node_silent"], min_=0, decimals=0)
