"""Write the Grafana dashboards (dashboards/*.json) from code, or check they are current.

Built with grafana-foundation-sdk; every threshold line, band and runbook link comes from
alerts/thresholds.yaml (``stepwatch.alerts.thresholds.load()``), every alert's "open this
panel first" title is a panel here, and every query passes the lint in
``stepwatch.dashboards.lint``.  Output is deterministic (fixed uids and ids, sorted keys,
no timestamps), so CI can run ``stepwatch dashboards generate --check``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stepwatch.dashboards.model import DATASOURCE_UID, DATASOURCE_VAR, package_dir

if TYPE_CHECKING:
    from stepwatch.alerts.thresholds import Thresholds

OVERVIEW_UID = "stepwatch-overview"
OVERVIEW_FILE = "stepwatch-overview.json"
RATE = "$__rate_interval"
# Filters every stepwatch query carries; each names a template variable.
F_INSTANCE = 'instance=~"$instance"'
F_POOL = 'pool=~"$pool"'
F_SHAPE = 'shape=~"$shape"'
RED, BLUE, GREEN = "red", "blue", "green"


def num(x: float) -> str:
    """A threshold as PromQL / title text: 1.2, 0.9, 1.1 (not 1.1000000000000001)."""
    return format(float(x), ".12g")


def pct(x: float) -> str:
    return num(round(x * 100, 6)) + "%"


@dataclass(frozen=True)
class T:
    """One query of a panel.  style: '' (data), 'limit' (an alert line: dashed red), 'ref' (a reference:
    baseline, SLO, capacity, gate: dashed blue)."""

    expr: str
    legend: str
    style: str = ""
    heatmap: bool = False


def sel(metric: str, *filters: str) -> str:
    return f"{metric}{{{', '.join(filters)}}}" if filters else metric


def ratio_of_rates(by: str, num_sel: str, den_sel: str) -> str:
    """sum(rate(a)) / sum(rate(b)) per ``by``: a mean over the interval, never an average of ratios."""
    return (f"  sum by ({by}) (rate({num_sel}[{RATE}]))\n"
            f"/\n"
            f"  sum by ({by}) (rate({den_sel}[{RATE}]))")


def events(selector: str, by: str) -> str:
    """Events per rate interval, including the first event of a new label set.

    Counters like stepwatch_oom_total{shape,stage} are born at 1 on their first event, which
    increase() alone never shows; the second arm shows a series that did not exist one
    interval ago (only once Prometheus has history for the job, so a restart shows nothing).
    """
    return (f"  sum by ({by}) (increase({selector}[{RATE}])) > 0\n"
            f"or\n"
            f"  (\n"
            f"      sum by ({by}) ({selector} unless {selector} offset {RATE})\n"
            f"    and on (job)\n"
            f"      count by (job) (up offset {RATE})\n"
            f"  )")


def diagnosis(th: Thresholds, key: str) -> float | None:
    """A number of the thresholds' diagnosis section, or None when the file does not define it."""
    v = th.diagnosis.get(key)
    return float(v) if isinstance(v, (int, float)) else None


def quantile(q: float, bucket_sel: str, by: str) -> str:
    return f"histogram_quantile({num(q)}, sum by ({by}, le) (rate({bucket_sel}[{RATE}])))"


class Board:
    """Collects rows and panels of one dashboard; ids in layout order, so they never change by accident."""

    def __init__(self, th: Thresholds) -> None:
        from grafana_foundation_sdk.models import dashboard as dm

        self.th = th
        self.ds = dm.DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)
        self.items: list[Any] = []
        self.next_id = 1

    # ----- pieces -----------------------------------------------------------------------------
    def _id(self) -> int:
        i = self.next_id
        self.next_id += 1
        return i

    def row(self, title: str) -> None:
        from grafana_foundation_sdk.builders import dashboard as db

        self.items.append(("row", db.Row(title).id(self._id())))

    def summary(self, key: str) -> str:
        """The alert's summary with its placeholders filled (production profile values)."""
        spec = self.th.alert(key)
        values = {"threshold": num(spec.threshold), "threshold_pct": num(round(spec.threshold * 100, 6)),
                  "upper": num(round(1 + spec.threshold, 9)), "lower": num(round(1 - spec.threshold, 9)),
                  "for": spec.for_["production"],
                  "window": spec.window.get("production", self.th.profiles["production"].rate_window)}
        text = spec.summary
        for k, v in values.items():
            text = text.replace("${" + k + "}", v)
        return text

    def alert_note(self, key: str) -> str:
        spec = self.th.alert(key)
        return f"Alert {spec.name} ({spec.severity}): {self.summary(key)} The runbook is linked from this panel."

    def _links(self, alerts: Sequence[str]) -> list[Any]:
        from grafana_foundation_sdk.builders import dashboard as db

        return [db.DashboardLink(f"Runbook: {self.th.alert(k).name}").url(self.th.runbook_url(k))
                .target_blank(True).tooltip(self.summary(k)) for k in alerts]

    def _targets(self, targets: Sequence[T]) -> list[Any]:
        from grafana_foundation_sdk.builders import prometheus
        from grafana_foundation_sdk.models import prometheus as pm

        out = []
        for i, t in enumerate(targets):
            q = (prometheus.Dataquery().ref_id(chr(ord("A") + i)).expr(t.expr).legend_format(t.legend)
                 .datasource(self.ds).range())
            if t.heatmap:
                q = q.format(pm.PromQueryFormat.HEATMAP)
            out.append(q)
        return out

    def _thresholds(self, lines: Sequence[tuple[float, str]]) -> Any:
        from grafana_foundation_sdk.builders import dashboard as db
        from grafana_foundation_sdk.models import dashboard as dm

        steps = [dm.Threshold(value=None, color=GREEN)] + [dm.Threshold(value=v, color=c) for v, c in lines]
        return db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(steps)

    def _describe(self, description: str, alerts: Sequence[str]) -> str:
        return " ".join([" ".join(description.split())] + [self.alert_note(k) for k in alerts])

    # ----- panel kinds ------------------------------------------------------------------------
    def timeseries(self, title: str, description: str, unit: str, targets: Sequence[T], *,
                   alerts: Sequence[str] = (), lines: Sequence[tuple[float, str]] = (), bars: bool = False,
                   min_: float | None = None, max_: float | None = None, decimals: int | None = None,
                   no_value: str | None = None, span: int = 12, height: int = 8) -> None:
        from grafana_foundation_sdk.builders import common as cb
        from grafana_foundation_sdk.builders import timeseries
        from grafana_foundation_sdk.models import common as cm
        from grafana_foundation_sdk.models import dashboard as dm

        p = (timeseries.Panel().id(self._id()).title(title).description(self._describe(description, alerts))
             .datasource(self.ds).unit(unit).span(span).height(height).targets(self._targets(targets))
             .thresholds(self._thresholds(lines))
             .thresholds_style(cb.GraphThresholdsStyleConfig().mode(
                 cm.GraphTresholdsStyleMode.DASHED if lines else cm.GraphTresholdsStyleMode.OFF))
             .legend(cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.LIST)
                     .placement(cm.LegendPlacement.BOTTOM).show_legend(True).calcs([]))
             .tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING))
             .line_width(1).fill_opacity(0).show_points(cm.VisibilityMode.NEVER).span_nulls(False))
        if bars:
            p = (p.draw_style(cm.GraphDrawStyle.BARS).fill_opacity(80)
                 .stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL).group("A")))
        if min_ is not None:
            p = p.min(min_)
        if max_ is not None:
            p = p.max(max_)
        if decimals is not None:
            p = p.decimals(decimals)
        if no_value is not None:
            p = p.no_value(no_value)
        if alerts:
            p = p.links(self._links(alerts))
        for i, t in enumerate(targets):
            if t.style:
                color = RED if t.style == "limit" else BLUE
                p = p.override_by_query(chr(ord("A") + i), [
                    dm.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
                    dm.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": color}),
                    dm.DynamicConfigValue(id_val="custom.lineWidth", value=2 if t.style == "limit" else 1),
                    dm.DynamicConfigValue(id_val="custom.drawStyle", value="line"),
                    dm.DynamicConfigValue(id_val="custom.fillOpacity", value=0),
                ])
        self.items.append(("panel", p))

    def stat(self, title: str, description: str, unit: str, targets: Sequence[T], *,
             alerts: Sequence[str] = (), lines: Sequence[tuple[float, str]] = (),
             mappings: dict[str, tuple[str, str]] | None = None, span: int = 6, height: int = 6) -> None:
        from grafana_foundation_sdk.builders import common as cb
        from grafana_foundation_sdk.builders import stat
        from grafana_foundation_sdk.models import common as cm
        from grafana_foundation_sdk.models import dashboard as dm

        p = (stat.Panel().id(self._id()).title(title).description(self._describe(description, alerts))
             .datasource(self.ds).unit(unit).span(span).height(height).targets(self._targets(targets))
             .thresholds(self._thresholds(lines)).graph_mode(cm.BigValueGraphMode.AREA)
             .color_mode(cm.BigValueColorMode.BACKGROUND).text_mode(cm.BigValueTextMode.VALUE_AND_NAME)
             .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))
        if mappings:
            p = p.mappings([dm.ValueMap(options={k: dm.ValueMappingResult(text=text, color=color)
                                                 for k, (text, color) in sorted(mappings.items())})])
        if alerts:
            p = p.links(self._links(alerts))
        self.items.append(("panel", p))

    def heatmap(self, title: str, description: str, y_unit: str, target: T, *, alerts: Sequence[str] = (),
                span: int = 12, height: int = 8) -> None:
        from grafana_foundation_sdk.builders import heatmap
        from grafana_foundation_sdk.models import common as cm
        from grafana_foundation_sdk.models import heatmap as hm

        p = (heatmap.Panel().id(self._id()).title(title).description(self._describe(description, alerts))
             .datasource(self.ds).unit("short").span(span).height(height).targets(self._targets([target]))
             .calculate(False)
             .y_axis(heatmap.YAxisConfig().unit(y_unit).min(0).max(1))
             .cell_values(heatmap.CellValues().unit("short"))
             .color(heatmap.HeatmapColorOptions().mode(hm.HeatmapColorMode.SCHEME).scheme("Oranges")
                    .fill("dark-orange").scale(hm.HeatmapColorScale.EXPONENTIAL).exponent(0.5).steps(64))
             .rows_frame(heatmap.RowsHeatmapOptions().layout(cm.HeatmapCellLayout.LE).value("hits"))
             .show_legend().show_tooltip())
        if alerts:
            p = p.links(self._links(alerts))
        self.items.append(("panel", p))

    # ----- the dashboard ----------------------------------------------------------------------
    def build(self, uid: str, title: str, description: str, tags: list[str]) -> dict[str, Any]:
        from grafana_foundation_sdk.builders import dashboard as db
        from grafana_foundation_sdk.cog.encoder import JSONEncoder
        from grafana_foundation_sdk.models import dashboard as dm

        from stepwatch.alerts.thresholds import ALERT_PREFIX

        d = (db.Dashboard(title).uid(uid).description(description).tags(tags).editable().timezone("utc")
             .time("now-1h", "now").refresh("30s").tooltip(dm.DashboardCursorSync.CROSSHAIR)
             .timepicker(db.TimePicker().refresh_intervals(["10s", "30s", "1m", "5m", "15m"]))
             .link(db.DashboardLink("Runbooks").url(self.th.runbook_base_url).target_blank(True)
                   .tooltip("one runbook per alert: what to check first").icon("doc"))
             .annotation(db.AnnotationQuery().name("Firing stepwatch alerts").datasource(self.ds).enable(True)
                         .icon_color("rgba(255, 96, 96, 0.6)")
                         .expr(f'ALERTS{{alertstate="firing", alertname=~"{ALERT_PREFIX}.*"}}')))
        for var in self.variables():
            d = d.with_variable(var)
        for kind, item in self.items:
            d = d.with_row(item) if kind == "row" else d.with_panel(item)
        out: dict[str, Any] = json.loads(json.dumps(d.build(), cls=JSONEncoder, sort_keys=True))
        # Prometheus annotations need these Grafana fields the SDK does not model.
        for a in out.get("annotations", {}).get("list", []):
            if a.get("expr"):
                a.update({"step": "15s", "titleFormat": "{{alertname}}", "tagKeys": "severity,instance",
                          "textFormat": "{{alertname}} ({{severity}}) {{instance}}",
                          "useValueForTime": False})
        return out

    def variables(self) -> list[Any]:
        from grafana_foundation_sdk.builders import dashboard as db
        from grafana_foundation_sdk.models import dashboard as dm

        def query_var(name: str, label: str, query: str, description: str) -> Any:
            return (db.QueryVariable(name).label(label).description(description).datasource(self.ds)
                    .query(query)
                    .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
                    .multi(True).include_all(True).all_value(".*")
                    .current(dm.VariableOption(selected=True, text="All", value="$__all")))

        return [
            db.DatasourceVariable(DATASOURCE_VAR).label("Prometheus").type("prometheus")
            .description("The Prometheus that scrapes the stepwatch service and sidecar."),
            query_var("instance", "Instance", f'label_values(up{{job=~"{self.th.job_regex}"}}, instance)',
                      "Scrape targets of the stepwatch jobs (service and sidecar are separate targets)."),
            query_var("pool", "Pool", f"label_values(stepwatch_queue_slo_seconds{{{F_INSTANCE}}}, pool)",
                      "Shape pools of the service config."),
            query_var("shape", "Shape", f"label_values(stepwatch_pipeline_cfg_branches{{{F_INSTANCE}}}, shape)",
                      "Shape keys HxW[xF]_<steps>s[_cfg] on the serving allowlist (else 'other')."),
        ]


# ----- the overview ---------------------------------------------------------------------------

def overview(th: Thresholds) -> dict[str, Any]:
    """The on-call overview: one row per subsystem, each alert's panel first in its row."""
    from prometheus_client.utils import floatToGoString

    from stepwatch.alerts.thresholds import ALERT_PREFIX

    b = Board(th)
    a = th.alert
    inst = F_INSTANCE

    b.row("Alerts")
    b.timeseries(
        "Firing stepwatch alerts", """Stepwatch alerts firing, per alert: how many label sets (instances,
        shapes, pools, ...) fire. Healthy: empty. Each alert names the panel to open first; the runbook links are on
        those panels.""", "short",
        [T(f'sum by (alertname, severity) (ALERTS{{alertstate="firing", alertname=~"{ALERT_PREFIX}.*"}})',
           "{{alertname}} ({{severity}})")], min_=0, decimals=0, span=24, height=6, no_value="none firing")

    b.row("Traffic and latency")
    b.timeseries(
        "Requests by pool and code", """Generation requests per second by pool and HTTP code. Healthy: all 200;
        429 = queue past its hard limit, 503 = warming up or worker restarting, 507 = out of memory.""",
        "reqps", [T(f"sum by (pool, code) (rate({sel('stepwatch_service_requests_total', inst, F_POOL)}[{RATE}]))",
                    "{{pool}} {{code}}")], min_=0)
    sreq = sel("stepwatch_service_requests_total", inst, F_POOL)
    s5xx = sel("stepwatch_service_requests_total", inst, F_POOL, 'code=~"5.."')
    b.timeseries(
        a("error_ratio").panel, """Share of generation requests answered 5xx, per pool (0 when none
        failed). Healthy: 0.""", "percentunit",
        [T(f"  (\n    sum by (job, pool) (rate({s5xx}[{RATE}]))\n  or\n"
           f"    sum by (job, pool) (rate({sreq}[{RATE}])) * 0\n  )\n/\n"
           f"  sum by (job, pool) (rate({sreq}[{RATE}]))", "{{pool}}")],
        alerts=["error_ratio"], lines=[(a("error_ratio").threshold, RED)], min_=0)
    lat = sel("stepwatch_service_request_duration_seconds_bucket", inst, F_POOL)
    b.timeseries(
        "Latency p50 / p99, by pool", """End-to-end latency (queue + work) of generation requests per pool,
        with the pool's latency SLO dashed. Healthy: p99 under the SLO. p99 up with p50 flat = a few slow
        requests (serving recompiles, a queue backlog in one pool).""", "s",
        [T(quantile(0.5, lat, "pool"), "{{pool}} p50"), T(quantile(0.99, lat, "pool"), "{{pool}} p99"),
         T(f"max by (pool) ({sel('stepwatch_queue_slo_seconds', inst, F_POOL)})", "{{pool}} SLO", "ref")],
        min_=0, span=24)

    b.row("Queue")
    qw = a("queue_wait")
    b.timeseries(
        qw.panel, f"""Estimated queue wait (GPU-seconds of queued work / workers) as a share of the pool's
        latency SLO. Healthy: well under {pct(qw.threshold)}; above it, scale out (a cold start takes minutes:
        weights + compile).""", "percentunit",
        [T(sel("instance_pool:stepwatch_queue_estimated_wait_seconds:slo_ratio", inst, F_POOL),
           "{{pool}} @ {{instance}}")],
        alerts=["queue_wait"], lines=[(qw.threshold, RED)], min_=0)
    qwait = sel("stepwatch_queue_wait_seconds_bucket", inst, F_POOL)
    b.timeseries(
        f"Estimated queue wait vs SLO x {num(qw.threshold)}, by pool", f"""Estimated queue wait in seconds and
        the scale-out line (SLO x {num(qw.threshold)}, dashed red), with the measured p99 wait of the requests
        that left the queue. Healthy: the estimate stays under the dashed line.""", "s",
        [T(sel("stepwatch_queue_estimated_wait_seconds", inst, F_POOL), "{{pool}} estimated @ {{instance}}"),
         T(quantile(0.99, qwait, "pool"), "{{pool}} measured p99"),
         T(f"{sel('stepwatch_queue_slo_seconds', inst, F_POOL)} * {num(qw.threshold)}",
           f"{{{{pool}}}} scale out (SLO x {num(qw.threshold)})", "limit")],
        alerts=["queue_wait"], min_=0)
    b.timeseries(
        "Queue depth, by pool", """Requests waiting for a worker, per pool. Healthy: 0 to a few. Depth alone
        is not the signal (a 2048² request weighs ~16x a 512² one); the estimated wait is.""", "short",
        [T(sel("stepwatch_queue_depth", inst, F_POOL), "{{pool}} @ {{instance}}")], min_=0, decimals=0,
        span=24, height=6)

    b.row("Denoising: step time, stages, MFU")
    st = a("step_time_regression")
    step_mean = ratio_of_rates("job, instance, shape",
                               sel("stepwatch_pipeline_step_duration_seconds_sum", inst, F_SHAPE),
                               sel("stepwatch_pipeline_step_duration_seconds_count", inst, F_SHAPE))
    base = sel("stepwatch_baseline_step_duration_seconds", inst, F_SHAPE)
    b.timeseries(
        st.panel, f"""Mean time of one denoising step (all CFG branches) per shape, and each shape's alert line:
        its baseline x {num(st.threshold)} (dashed red). Healthy: every shape under its line. Above it: check
        rank skew, GPU clocks and temperature, other processes, compile disabled.""", "s",
        [T(step_mean, "{{shape}} @ {{instance}}"),
         T(f"{base} * {num(st.threshold)}", f"{{{{shape}}}} alert (baseline x {num(st.threshold)})", "limit")],
        alerts=["step_time_regression"], min_=0)
    b.timeseries(
        "Per-step time / baseline, by shape", f"""Per-step time as a share of the shape's baseline (what the
        step-time alert compares). Healthy: about 100%; the alert line is {pct(st.threshold)}.""",
        "percentunit",
        [T(f"(\n{step_mean}\n)\n/ on (job, instance, shape)\n  ({base} > 0)", "{{shape}} @ {{instance}}")],
        alerts=["step_time_regression"], lines=[(st.threshold, RED)], min_=0)
    flops = sel("stepwatch_ledger_flops_total", inst, F_SHAPE)
    step_sum = sel("stepwatch_pipeline_step_duration_seconds_sum", inst, F_SHAPE)
    peak = f"max by (job, instance) ({sel('stepwatch_device_peak_flops_per_second', inst)} > 0)"
    achieved = ratio_of_rates("job, instance, shape", flops, step_sum)
    mfu_floor = diagnosis(th, "mfu_floor")
    floor_text = (f"below {num(mfu_floor)} (dashed) suspect eager mode or compile off" if mfu_floor is not None
                  else "well below that, suspect eager mode or compile off")
    b.timeseries(
        "MFU, by shape", f"""Model FLOPs utilization from the FLOPs ledger: nominal denoising FLOPs / step
        seconds / the device's dense peak FLOP/s, over the interval and for the last request. GPU-Util says
        nothing here; this does. Healthy on a compiled DiT: ~0.5 (seeds: eager ~0.31, compiled ~0.49);
        {floor_text}. Empty where the device peak is unknown (CPU).""", "percentunit",
        [T(f"(\n{achieved}\n)\n/ on (job, instance) group_left\n  {peak}", "{{shape}} @ {{instance}}"),
         T(f"{sel('stepwatch_ledger_mfu_ratio', inst, F_SHAPE)} > 0", "{{shape}} last request")],
        lines=[(mfu_floor, "orange")] if mfu_floor is not None else [], min_=0, max_=1)
    b.timeseries(
        "Achieved FLOP/s vs device peak, by shape", """Nominal denoising FLOPs per second of denoising time
        (the ledger's numerator of MFU) and the device's dense peak (dashed). Healthy: a stable fraction of
        the peak per shape; a drop at the same shape = the same work ran slower.""", "flops",
        [T(achieved, "{{shape}} @ {{instance}}"), T(peak, "device peak @ {{instance}}", "ref")], min_=0)

    b.timeseries(
        "Stage time per request (text_encode / denoise / vae_decode)", """Mean seconds per request in each
        stage, per shape. Healthy: denoise dominates (~97% on a GPU); text_encode is small and flat; vae_decode
        is short but the memory peak.""", "s",
        [T(ratio_of_rates("shape, stage", sel("stepwatch_pipeline_stage_duration_seconds_sum", inst, F_SHAPE),
                          sel("stepwatch_pipeline_stage_duration_seconds_count", inst, F_SHAPE)),
           "{{shape}} {{stage}}")], min_=0, span=24)

    b.row("Compile")
    rc = a("recompile")
    b.timeseries(
        rc.panel, """torch.compile compilations while serving, per shape that triggered them, per interval.
        Healthy: none after warm-up. A bar = requests of that shape waited for a compile (p99 up, p50 flat):
        add the shape to the warm-up list.""", "short",
        [T(events(sel("stepwatch_compile_total", inst, F_SHAPE, 'phase="serving"'), "job, instance, shape"),
           "{{shape}} @ {{instance}}")],
        alerts=["recompile"], bars=True, min_=0, decimals=0, no_value="0")
    b.timeseries(
        "Compile seconds, by shape and phase", """Seconds spent compiling per interval, by the shape that
        triggered it and the phase (warmup at start, serving after). Healthy: warmup only, at start.""", "s",
        [T(events(sel("stepwatch_compile_duration_seconds_sum", inst, F_SHAPE), "job, instance, shape, phase"),
           "{{shape}} {{phase}}")], bars=True, min_=0, no_value="0")

    b.row("Cross-step cache")
    ch = a("cache_hit_rate_shift")
    hits = sel("stepwatch_cache_decisions_total", inst, F_SHAPE, 'decision="hit"')
    dec = sel("stepwatch_cache_decisions_total", inst, F_SHAPE)
    hbase = sel("stepwatch_baseline_cache_hit_ratio", inst, F_SHAPE)
    b.timeseries(
        ch.panel, f"""Share of transformer calls that reused the cached residual, per shape, inside its baseline
        band: baseline x (1 ± {num(ch.threshold)}) (dashed red). Healthy: inside the band (a fixed deployment
        has a stable hit rate per shape). Above: quality at risk (check the PSNR row); below: speed lost;
        any hits on a distilled few-step model are wrong.""", "percentunit",
        [T(f"  (\n    sum by (job, instance, shape) (rate({hits}[{RATE}]))\n  or\n"
           f"    sum by (job, instance, shape) (rate({dec}[{RATE}])) * 0\n  )\n/\n"
           f"  sum by (job, instance, shape) (rate({dec}[{RATE}]))", "{{shape}} @ {{instance}}"),
         T(f"{hbase} * {num(1 - ch.threshold)}", f"{{{{shape}}}} band low (x {num(1 - ch.threshold)})", "limit"),
         T(f"{hbase} * {num(1 + ch.threshold)}", f"{{{{shape}}}} band high (x {num(1 + ch.threshold)})",
           "limit")],
        alerts=["cache_hit_rate_shift"], min_=0, max_=1)
    late = diagnosis(th, "late_hit_position")
    late_text = f"Hits past {pct(late)} blur details." if late is not None else "Late hits blur details."
    pos = sel("stepwatch_cache_hit_position_ratio_bucket", inst, F_SHAPE)
    b.heatmap(
        "Cache hit positions (step / steps)", f"""Where in the denoising trajectory cache hits land (0 = first
        step, 1 = last), hits per interval. Healthy: in the middle; first and last steps are always computed.
        {late_text}""", "percentunit",
        T(f"sum by (le) (increase({pos}[{RATE}]))", "{{le}}", heatmap=True), alerts=["cache_hit_rate_shift"])
    b.timeseries(
        "Late cache hits: p90 hit position, by shape", f"""90th percentile of where hits land in the trajectory.
        Healthy: in the middle of the trajectory; late hits blur details (threshold too high). {late_text}""",
        "percentunit", [T(quantile(0.9, pos, "job, instance, shape"), "{{shape}} @ {{instance}}")],
        lines=[(late, "orange")] if late is not None else [], min_=0, max_=1, span=24, height=6)

    b.row("Ranks (sequence parallel)")
    rk = a("rank_skew")
    busy = sel("stepwatch_rank_busy_seconds_total", inst)
    steps = sel("stepwatch_rank_steps_total", inst)
    per_step = ratio_of_rates("job, instance, rank", busy, steps)
    b.timeseries(
        rk.panel, f"""Each rank's busy time per step (step time minus collective waits) over the interval,
        as a share of the fastest rank's, and the last request's ratio (what the alert reads). Healthy: all
        ranks near 100%; the alert line is {pct(1 + rk.threshold)}. Every step waits for the slowest rank:
        check that GPU's clock, temperature, processes and link.""", "percentunit",
        [T(f"(\n{per_step}\n)\n/ on (job, instance) group_left\n  min by (job, instance) (\n(\n{per_step}\n) > 0\n)",
           "rank {{rank}} @ {{instance}}"),
         T(sel("instance_rank:stepwatch_rank_step_duration_seconds:ratio_to_fastest", inst),
           "rank {{rank}} last request")],
        alerts=["rank_skew"], lines=[(1 + rk.threshold, RED)], min_=0)
    b.timeseries(
        "Per-rank busy time per step", """Seconds each rank works per denoising step (over the interval) and
        each rank's mean step time in the last request. Healthy: ranks equal. Empty with one rank.""", "s",
        [T(per_step, "rank {{rank}} busy/step @ {{instance}}"),
         T(sel("stepwatch_rank_step_duration_seconds", inst), "rank {{rank}} last request")],
        alerts=["rank_skew"], min_=0)

    b.row("Memory and OOM")
    mp = a("memory_pressure")
    ratio_b = sel("stepwatch_memory_peak_ratio_bucket", inst)
    peak_req = sel("stepwatch_memory_peak_bytes", inst, 'stage="request"')
    le_sel = sel("stepwatch_memory_peak_ratio_bucket", inst, 'le="' + floatToGoString(mp.threshold) + '"')
    b.timeseries(
        mp.panel, f"""Peak memory of requests / the device's capacity: the largest request in the interval (to
        the histogram's bucket bound, so every request counts, whatever the scrape interval; one outlier
        among hundreds is what the alert is about, so no percentile) and the last request (a gauge: the next
        request may overwrite an outlier before a scrape). Healthy: under {pct(mp.threshold)} (dashed); above
        it the next larger request may OOM; above 100% is an OOM's failed demand.""", "percentunit",
        [T(quantile(1, ratio_b, "job, instance, device"), "{{device}} largest request @ {{instance}}"),
         T(f"  max by (job, instance, device) ({peak_req})\n"
           f"/\n  max by (job, instance, device) ({sel('stepwatch_memory_capacity_bytes', inst)} > 0)",
           "{{device}} last request")],
        alerts=["memory_pressure"], lines=[(mp.threshold, RED)], min_=0)
    b.timeseries(
        f"Requests above {pct(mp.threshold)} of memory", f"""Requests per interval whose peak memory passed
        {pct(mp.threshold)} of capacity (what the memory alert counts). Healthy: none.""", "short",
        [T(f"  sum by (job, instance, device) (increase({sel('stepwatch_memory_peak_ratio_count', inst)}[{RATE}]))\n"
           f"-\n  sum by (job, instance, device) (increase("
           f"{le_sel}[{RATE}]))", "{{device}} @ {{instance}}")],
        alerts=["memory_pressure"], bars=True, min_=0)
    cap = sel("stepwatch_memory_capacity_bytes", inst)
    b.timeseries(
        "Peak memory by stage", f"""Peak memory of the last request in each stage (on an OOM: the demand that
        failed), with the capacity and {pct(mp.threshold)} of it (dashed). Healthy: vae_decode is the peak and
        stays under the red line; untiled VAE decode at high resolution is the usual OOM.""", "bytes",
        [T(f"max by (instance, device, stage) ({sel('stepwatch_memory_peak_bytes', inst)})",
           "{{device}} {{stage}}"),
         T(cap, "{{device}} capacity", "ref"),
         T(f"{cap} * {num(mp.threshold)}", f"{{{{device}}}} {pct(mp.threshold)} of capacity", "limit")],
        min_=0)
    b.timeseries(
        a("oom").panel, """Requests that failed with out-of-memory per interval, by the stage that was running
        and the shape (the first OOM of a shape included). Healthy: none. vae_decode at high resolution =
        VAE tiling off; the instance keeps serving other shapes.""", "short",
        [T(events(sel("stepwatch_oom_total", inst, F_SHAPE), "job, instance, shape, stage"),
           "{{stage}} {{shape}} @ {{instance}}")],
        alerts=["oom"], bars=True, min_=0, decimals=0, no_value="0")

    b.row("Output quality")
    qd = a("quality_drop")
    psnr = "stepwatch_quality_psnr_decibels"
    gate = sel("stepwatch_quality_gate_decibels", inst)
    b.timeseries(
        qd.panel, f"""PSNR of the fixed probe set (prompt x seed) against the baseline images: p10 and p50 per
        probe set and target instance, the probe set's gate (dashed blue) and the alert line, gate -
        {num(qd.threshold)} dB (dashed red). Healthy: above the gate (> 35 dB invisible, 30-35 visible on a
        close look, < 28 obvious). A drop with normal performance panels: deployment fingerprint vs baseline,
        cache hit rate, PSNR by instance.""", "dB",
        [T(sel(psnr, inst, 'quantile="p10"'), "{{probe_set}} p10 ({{instance_id}})"),
         T(sel(psnr, inst, 'quantile="p50"'), "{{probe_set}} p50 ({{instance_id}})"),
         T(gate, "{{probe_set}} gate", "ref"),
         T(f"{gate} - {num(qd.threshold)}", f"{{{{probe_set}}}} alert (gate - {num(qd.threshold)} dB)", "limit")],
        alerts=["quality_drop"])
    ssim_gate = th.quality.ssim_gate["image"]
    b.timeseries(
        "Probe SSIM p10 / p50", f"""Structural similarity of the probe images against the baseline. Healthy:
        above {num(ssim_gate)} for images (dashed; video {num(th.quality.ssim_gate.get('video', ssim_gate))}).
        """, "none",
        [T(sel("stepwatch_quality_ssim_ratio", inst, 'quantile=~"p10|p50"'),
           "{{probe_set}} {{quantile}} ({{instance_id}})")],
        lines=[(ssim_gate, "orange")], decimals=3)
    pf = a("probe_failing")
    b.timeseries(
        pf.panel, """Probe sets completed and probe requests failed per interval, by reason. Healthy: runs
        at the probe cadence, no failures. While failing, quality is unwatched.""", "short",
        [T(f"sum by (job, instance, probe_set) (increase({sel('stepwatch_quality_probe_runs_total', inst)}[{RATE}]))",
           "{{probe_set}} runs"),
         T(f"sum by (job, instance, probe_set, reason) (increase("
           f"{sel('stepwatch_quality_probe_failures_total', inst)}[{RATE}]))", "{{probe_set}} failed: {{reason}}")],
        alerts=["probe_failing"], min_=0)
    missed = int(pf.extra.get("missed_probes", 3))
    b.timeseries(
        "Time since the last successful probe", f"""Seconds since the probe set last completed, against
        {missed} probe intervals (dashed red: the probe-failing alert's clock). Healthy: a sawtooth under the
        line.""", "s",
        [T(f"time() - ({sel('stepwatch_quality_last_success_timestamp_seconds', inst)} > 0)",
           "{{probe_set}} @ {{instance}}"),
         T(f"{missed} * {sel('stepwatch_quality_probe_interval_seconds', inst)}",
           f"{{{{probe_set}}}} alert ({missed} intervals)", "limit")],
        alerts=["probe_failing"], min_=0)
    b.stat(
        a("baseline_stale").panel, """Whether each probe set's baseline loaded with matching checksums (ok)
        and matches this deployment's fingerprint (stale = captured on another deployment: no PSNR is
        reported until it is rebuilt with `stepwatch baseline capture`). Healthy: ok 1, stale 0.""", "none",
        [T(sel("stepwatch_quality_baseline_stale", inst), "{{probe_set}} stale"),
         T(sel("stepwatch_quality_baseline_ok", inst), "{{probe_set}} baseline ok")],
        alerts=["baseline_stale"], span=12, height=8)
    nf = a("nonfinite_outputs")
    b.timeseries(
        nf.panel, """Images that came out NaN/Inf or all black per interval, by pool (the first one
        included). Healthy: none. Check FP8 and which layers (outliers saturating per-tensor scales).""",
        "short",
        [T(events(sel("stepwatch_service_images_nonfinite_total", inst, F_POOL), "job, instance, pool"),
           "{{pool}} @ {{instance}}")],
        alerts=["nonfinite_outputs"], bars=True, min_=0, decimals=0, no_value="0")

    b.row("Health: scrape targets, exporter, sidecar, GPUs")
    b.stat(
        a("target_down").panel, """Whether Prometheus can scrape each stepwatch target (service and sidecar).
        Healthy: all UP. A DOWN target blinds every alert that reads it.""", "none",
        [T(sel("up", f'job=~"{th.job_regex}"', inst), "{{job}} {{instance}}")],
        alerts=["target_down"], mappings={"0": ("DOWN", RED), "1": ("UP", GREEN)})
    b.timeseries(
        a("exporter_errors").panel, """Errors inside stepwatch's own hooks per interval, by component (the
        first one included). The pipeline never sees them, but that hook's signals are missing or wrong.
        Healthy: none.""", "short",
        [T(events(sel("stepwatch_exporter_errors_total", inst), "job, instance, component"),
           "{{component}} @ {{instance}}")],
        alerts=["exporter_errors"], bars=True, min_=0, decimals=0, no_value="0", span=6, height=6)
    b.stat(
        "Worker and NVML up", """Worker process alive, service warmed up, and the sidecar's NVML collector
        answering. Healthy: all 1 (NVML is 0 on a machine without a GPU, and the GPU panels are then
        empty).""", "none",
        [T(sel("stepwatch_worker_up", inst), "worker up {{instance}}"),
         T(sel("stepwatch_service_ready", inst), "ready {{instance}}"),
         T(sel("stepwatch_nvml_up", inst), "NVML up {{instance}}")],
        mappings={"0": ("DOWN", RED), "1": ("UP", GREEN)})
    b.timeseries(
        "Worker restarts", """Worker processes restarted after dying, per interval. Healthy: none; each
        restart fails its in-flight requests and costs a warm-up.""", "short",
        [T(f"sum by (instance) (increase({sel('stepwatch_worker_restarts_total', inst)}[{RATE}]))",
           "{{instance}}")], bars=True, min_=0, span=6, height=6)
    gpu_mem_used = sel("stepwatch_gpu_memory_used_bytes", inst)
    b.timeseries(
        "GPU memory used / total (NVML)", f"""Device memory in use per GPU as NVML sees it (all processes),
        with the total and {pct(mp.threshold)} of it. Healthy: stable; a climb without traffic = another
        process or a leak.""", "bytes",
        [T(gpu_mem_used, "GPU {{gpu}} used @ {{instance}}"),
         T(sel("stepwatch_gpu_memory_total_bytes", inst), "GPU {{gpu}} total", "ref"),
         T(f"{sel('stepwatch_gpu_memory_total_bytes', inst)} * {num(mp.threshold)}",
           f"GPU {{{{gpu}}}} {pct(mp.threshold)}", "limit")], min_=0)
    b.timeseries(
        "GPU utilization (NVML)", """Share of time a kernel ran. Says nothing about efficiency (eager FLUX shows
        ~100% at MFU 0.31): read MFU for that. Healthy: high while serving.""", "percentunit",
        [T(sel("stepwatch_gpu_utilization_ratio", inst), "GPU {{gpu}} @ {{instance}}")], min_=0, max_=1)
    b.timeseries(
        "GPU SM clock and throttling", """SM clock per GPU, and 1 while a clock throttle reason is active.
        Healthy: clocks flat at the application clock, no throttle; one GPU lower = the straggler rank's
        GPU.""", "hertz",
        [T(sel("stepwatch_gpu_sm_clock_hertz", inst), "GPU {{gpu}} @ {{instance}}"),
         T(f"{sel('stepwatch_gpu_throttle_active', inst)} == 1", "GPU {{gpu}} throttled: {{reason}}")],
        min_=0)
    b.timeseries(
        "GPU temperature", """Temperature per GPU. Healthy: steady under the slowdown temperature; a hot GPU
        throttles its clock and drags its rank.""", "celsius",
        [T(sel("stepwatch_gpu_temperature_celsius", inst), "GPU {{gpu}} @ {{instance}}")], min_=0)
    b.timeseries(
        "GPU power", """Power draw per GPU. Healthy: high and steady while serving; a GPU at its power limit
        with a lower clock is power-throttled.""", "watt",
        [T(sel("stepwatch_gpu_power_watts", inst), "GPU {{gpu}} @ {{instance}}")], min_=0)
    b.timeseries(
        "GPU XID and NVML read errors", """XID errors reported by NVML events and failed NVML reads per GPU
        per interval. Healthy: none; an XID usually means a driver or hardware fault on that GPU.""", "short",
        [T(f"sum by (instance, gpu) (increase({sel('stepwatch_gpu_xid_errors_total', inst)}[{RATE}]))",
           "GPU {{gpu}} XID"),
         T(f"sum by (instance, gpu) (increase({sel('stepwatch_gpu_read_errors_total', inst)}[{RATE}]))",
           "GPU {{gpu}} read errors")], bars=True, min_=0)

    return b.build(
        OVERVIEW_UID, "stepwatch: diffusion inference overview",
        "On-call overview of diffusion-model inference: traffic, queue, per-step time, stages, MFU, "
        "recompiles, cross-step cache, ranks, memory and OOMs, output quality, and the health of the "
        "exporter, sidecar and GPUs. Generated by `stepwatch dashboards generate`; do not edit in Grafana.",
        ["stepwatch", "diffusion", "generated"])


def dashboards(th: Thresholds | None = None) -> dict[str, dict[str, Any]]:
    """File name -> dashboard JSON object."""
    from stepwatch.alerts.thresholds import load

    th = th or load()
    return {OVERVIEW_FILE: overview(th)}


def render(th: Thresholds | None = None) -> dict[str, str]:
    """File name -> the exact text written (sorted keys, 2-space indent, trailing newline)."""
    return {name: json.dumps(d, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
            for name, d in dashboards(th).items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming every file that differs from the generator")
    parser.add_argument("--out", type=Path, default=None, help="directory (default: the dashboards package)")
    parser.add_argument("--thresholds", type=Path, default=None, help="thresholds file (default: packaged)")


def run(args: argparse.Namespace) -> int:
    from stepwatch.alerts.thresholds import load
    from stepwatch.dashboards.lint import lint

    th = load(args.thresholds)
    out_dir: Path = args.out or package_dir()
    texts = render(th)
    problems = [f"{name}: {p}" for name, text in texts.items() for p in lint(json.loads(text), th)]
    if problems:
        print("the generated dashboards fail the lint:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    stale = []
    for name, text in sorted(texts.items()):
        path = out_dir / name
        current = path.read_text() if path.is_file() else None
        if current == text:
            continue
        if args.check:
            stale.append(f"{path}: {'missing' if current is None else 'differs from the generator'}")
        else:
            out_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("dashboards are not current; run `stepwatch dashboards generate`:\n  " + "\n  ".join(stale),
              file=sys.stderr)
        return 1
    if args.check:
        print(f"{len(texts)} dashboard file(s) current")
    return 0
