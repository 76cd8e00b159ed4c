"""The dashboard builder: rows, panels and variables on grafana-foundation-sdk, in layout order.

A row function (``dashboards/rows_*.py``) says *what* a panel shows (title, description,
queries, alert lines); ``Board`` says *how* Grafana gets it: ids in layout order (so they never
change by accident), the datasource variable on every panel and query, dashed alert and
reference lines, runbook links and the alert's summary in the description.

The SDK is imported inside the methods that build: the lint, the snapshot renderer and the
drill reports import this package and must not pay for the SDK (tests/test_dashboards.py
checks that importing them loads neither it nor matplotlib).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stepwatch.alerts.promql import firing, summary
from stepwatch.dashboards.model import DATASOURCE_UID, DATASOURCE_VAR
from stepwatch.thresholds import ALERT_PREFIX, Thresholds

# Filters every stepwatch query carries; each names a template variable of the board.
F_INSTANCE = 'instance=~"$instance"'
F_POOL = 'pool=~"$pool"'
F_SHAPE = 'shape=~"$shape"'
INST = F_INSTANCE  # every overview query filters by the instance variable
RATE = "$__rate_interval"
RED, BLUE, GREEN = "red", "blue", "green"


def diagnosis(th: Thresholds, key: str) -> float | None:
    """A number of the thresholds' diagnosis section, or None when the file does not define it."""
    v = th.diagnosis.get(key)
    return float(v) if isinstance(v, (int, float)) else None


@dataclass(frozen=True)
class T:
    """One query of a panel.  style: '' (data), 'limit' (an alert line: dashed red), 'ref' (a reference:
    baseline, SLO, capacity, gate: dashed blue)."""

    expr: str
    legend: str
    style: str = ""
    heatmap: bool = False


def _ref_id(i: int) -> str:
    return chr(ord("A") + i)


class Board:
    """Collects rows and panels of one dashboard; ids in layout order, so they never change by accident."""

    def __init__(self, th: Thresholds) -> None:
        from grafana_foundation_sdk.models import dashboard as dm  # SDK on use: keeps importers light

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
        from grafana_foundation_sdk.builders import dashboard as db  # SDK on use: keeps importers light

        self.items.append(("row", db.Row(title).id(self._id())))

    def summary(self, key: str) -> str:
        """The alert's summary as the rules show it (production profile values)."""
        return summary(self.th, self.th.alert(key), "production")

    def alert_note(self, key: str) -> str:
        spec = self.th.alert(key)
        return f"Alert {spec.name} ({spec.severity}): {self.summary(key)} The runbook is linked from this panel."

    def _links(self, alerts: Sequence[str]) -> list[Any]:
        from grafana_foundation_sdk.builders import dashboard as db  # SDK on use: keeps importers light

        return [db.DashboardLink(f"Runbook: {self.th.alert(k).name}").url(self.th.runbook_url(k))
                .target_blank(True).tooltip(self.summary(k)) for k in alerts]

    def _targets(self, targets: Sequence[T]) -> list[Any]:
        from grafana_foundation_sdk.builders import prometheus  # SDK on use: keeps importers light
        from grafana_foundation_sdk.models import prometheus as pm

        out = []
        for i, t in enumerate(targets):
            q = (prometheus.Dataquery().ref_id(_ref_id(i)).expr(t.expr).legend_format(t.legend)
                 .datasource(self.ds).range())
            if t.heatmap:
                q = q.format(pm.PromQueryFormat.HEATMAP)
            out.append(q)
        return out

    def _thresholds(self, lines: Sequence[tuple[float, str]]) -> Any:
        from grafana_foundation_sdk.builders import dashboard as db  # SDK on use: keeps importers light
        from grafana_foundation_sdk.models import dashboard as dm

        steps = [dm.Threshold(value=None, color=GREEN)] + [dm.Threshold(value=v, color=c) for v, c in lines]
        return db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(steps)

    def _describe(self, description: str, alerts: Sequence[str]) -> str:
        return " ".join([" ".join(description.split())] + [self.alert_note(k) for k in alerts])

    def _line_styles(self, p: Any, targets: Sequence[T]) -> Any:
        """Alert lines dashed red and thick, references dashed blue: per query, whatever its series."""
        from grafana_foundation_sdk.models import dashboard as dm  # SDK on use: keeps importers light

        for i, t in enumerate(targets):
            if t.style:
                color = RED if t.style == "limit" else BLUE
                p = p.override_by_query(_ref_id(i), [
                    dm.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
                    dm.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": color}),
                    dm.DynamicConfigValue(id_val="custom.lineWidth", value=2 if t.style == "limit" else 1),
                    dm.DynamicConfigValue(id_val="custom.drawStyle", value="line"),
                    dm.DynamicConfigValue(id_val="custom.fillOpacity", value=0),
                ])
        return p

    # ----- panel kinds ------------------------------------------------------------------------
    def timeseries(self, title: str, description: str, unit: str, targets: Sequence[T], *,
                   alerts: Sequence[str] = (), lines: Sequence[tuple[float, str]] = (), bars: bool = False,
                   min_: float | None = None, max_: float | None = None, decimals: int | None = None,
                   no_value: str | None = None, span: int = 12, height: int = 8) -> None:
        from grafana_foundation_sdk.builders import common as cb  # SDK on use: keeps importers light
        from grafana_foundation_sdk.builders import timeseries
        from grafana_foundation_sdk.models import common as cm

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
        self.items.append(("panel", self._line_styles(p, targets)))

    def stat(self, title: str, description: str, unit: str, targets: Sequence[T], *,
             alerts: Sequence[str] = (), lines: Sequence[tuple[float, str]] = (),
             mappings: dict[str, tuple[str, str]] | None = None, span: int = 6, height: int = 6) -> None:
        from grafana_foundation_sdk.builders import common as cb  # SDK on use: keeps importers light
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
        from grafana_foundation_sdk.builders import heatmap  # SDK on use: keeps importers light
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
        from grafana_foundation_sdk.builders import dashboard as db  # SDK on use: keeps importers light
        from grafana_foundation_sdk.cog.encoder import JSONEncoder
        from grafana_foundation_sdk.models import dashboard as dm

        d = (db.Dashboard(title).uid(uid).description(description).tags(tags).editable().timezone("utc")
             .time("now-1h", "now").refresh("30s").tooltip(dm.DashboardCursorSync.CROSSHAIR)
             .timepicker(db.TimePicker().refresh_intervals(["10s", "30s", "1m", "5m", "15m"]))
             .link(db.DashboardLink("Runbooks").url(self.th.runbook_base_url).target_blank(True)
                   .tooltip("one runbook per alert: what to check first").icon("doc"))
             .annotation(db.AnnotationQuery().name("Firing stepwatch alerts").datasource(self.ds).enable(True)
                         .icon_color("rgba(255, 96, 96, 0.6)")
                         .expr(firing(f"{ALERT_PREFIX}.*"))))
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

    def _query_var(self, name: str, label: str, query: str, description: str) -> Any:
        from grafana_foundation_sdk.builders import dashboard as db  # SDK on use: keeps importers light
        from grafana_foundation_sdk.models import dashboard as dm

        return (db.QueryVariable(name).label(label).description(description).datasource(self.ds)
                .query(query)
                .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
                .multi(True).include_all(True).all_value(".*")
                .current(dm.VariableOption(selected=True, text="All", value="$__all")))

    def variables(self) -> list[Any]:
        from grafana_foundation_sdk.builders import dashboard as db  # SDK on use: keeps importers light

        return [
            db.DatasourceVariable(DATASOURCE_VAR).label("Prometheus").type("prometheus")
            .description("The Prometheus that scrapes the stepwatch service and sidecar."),
            self._query_var("instance", "Instance", f'label_values(up{{job=~"{self.th.job_regex}"}}, instance)',
                            "Scrape targets of the stepwatch jobs (service and sidecar are separate targets)."),
            self._query_var("pool", "Pool", f"label_values(stepwatch_queue_slo_seconds{{{F_INSTANCE}}}, pool)",
                            "Shape pools of the service config."),
            self._query_var("shape", "Shape",
                            f"label_values(stepwatch_pipeline_cfg_branches{{{F_INSTANCE}}}, shape)",
                            "Shape keys WxH[xF]_<steps>s[_cfg] (width first, as the API's size) on the serving "
                            "allowlist (else 'other')."),
        ]
