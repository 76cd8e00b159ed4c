"""Render dashboard panels to PNG from Prometheus range queries (no Grafana needed).

Drill reports and incident notes show the panels on-call would open: the panel's queries with
its variables substituted, its threshold lines, and the time spans where the alerts linked
from the panel were firing (``ALERTS{alertstate="firing"}``) shaded.

    stepwatch snapshot --panels "OOMs by stage and shape" --from -15m --to now \\
        --prometheus http://127.0.0.1:9090 --out reports/snapshots

    from stepwatch.dashboards.snapshot import render_panels
    render_panels("dashboards/stepwatch-overview.json", ["OOMs by stage and shape"],
                  "http://127.0.0.1:9090", start, end, Path("out"))
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from stepwatch.alerts.promql import firing
from stepwatch.dashboards.model import (
    FILTER_VARS,
    Query,
    expand,
    legend,
    linked_alerts,
    load,
    panel,
    panels,
    queries,
)
from stepwatch.promapi import PromError, Prometheus
from stepwatch.thresholds import Thresholds, parse_duration
from stepwatch.thresholds import load as load_thresholds

DEFAULT_DASHBOARD = "stepwatch-overview.json"
MAX_POINTS = 400
MAX_LEGEND = 12
_REL = re.compile(r"^(?:now)?\s*(?:([+-])\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w))?$")
_UNITS_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_PALETTE = ["#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f",
            "#d62728"]


def parse_time(text: str | float, now: float | None = None) -> float:
    """Unix seconds from ``1716200000``, ``now``, ``now-10m``, ``-10m`` or an ISO 8601 time."""
    now = time.time() if now is None else now
    if isinstance(text, (int, float)):
        return float(text)
    s = text.strip()
    try:
        return float(s)
    except ValueError:
        pass
    m = _REL.match(s)
    if m and s:
        if m.group(1) is None:
            return now
        delta = float(m.group(2)) * _UNITS_S[m.group(3)]
        return now - delta if m.group(1) == "-" else now + delta
    try:
        dt = datetime.fromisoformat(s)
    except ValueError:
        raise ValueError(f"time {text!r}: use unix seconds, now, now-10m, -10m or ISO 8601") from None
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


def scrape_interval(prom: Prometheus, default: float = 15.0) -> float:
    """The Prometheus's global scrape interval (what Grafana's $__rate_interval is built on)."""
    try:
        cfg = yaml.safe_load(prom._api("status/config")["yaml"]) or {}
        return parse_duration(str(cfg.get("global", {}).get("scrape_interval", f"{default:g}s")))
    except Exception:
        return default


def rate_interval(step: float, scrape: float) -> float:
    """Grafana's $__rate_interval: max(step + scrape interval, 4 x scrape interval)."""
    return max(step + scrape, 4 * scrape)


def fmt_duration(seconds: float) -> str:
    s = math.ceil(seconds)
    return f"{s // 60}m" if s % 60 == 0 and s >= 60 else f"{s}s"


# ----- value formatting per Grafana unit -------------------------------------------------------

def _si(v: float, unit: str, base: float = 1000.0, prefixes: str = " kMGTPE") -> str:
    a, i = abs(v), 0
    while a >= base and i < len(prefixes) - 1:
        a /= base
        i += 1
    p = prefixes[i].strip()
    return f"{math.copysign(a, v):.3g} {p}{unit}".strip() if (p or unit) else f"{math.copysign(a, v):.3g}"


def format_value(v: float, unit: str) -> str:
    if v is None or math.isnan(v):
        return ""
    if unit == "percentunit":
        return f"{v * 100:.4g}%"
    if unit == "s":
        a = abs(v)
        if a == 0:
            return "0 s"
        if a < 1e-3:
            return f"{v * 1e6:.3g} µs"
        if a < 1:
            return f"{v * 1e3:.3g} ms"
        if a < 120:
            return f"{v:.3g} s"
        if a < 7200:
            return f"{v / 60:.3g} min"
        return f"{v / 3600:.3g} h"
    if unit == "bytes":
        units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
        a, i = abs(v), 0
        while a >= 1024 and i < len(units) - 1:
            a /= 1024
            i += 1
        return f"{math.copysign(a, v):.3g} {units[i]}"
    if unit == "dB":
        return f"{v:.3g} dB"
    if unit == "celsius":
        return f"{v:.3g} °C"
    simple = {"hertz": "Hz", "watt": "W", "reqps": "req/s", "flops": "FLOP/s", "short": "", "none": ""}
    if unit in simple:
        return _si(v, simple[unit]) if unit != "none" else f"{v:.4g}"
    return f"{v:.4g} {unit}".strip()


# ----- one panel ----------------------------------------------------------------------------

@dataclass
class Series:
    label: str
    labels: dict[str, str]
    times: list[float]
    values: list[float]
    ref_id: str
    color: str | None = None
    dashed: bool = False
    width: float = 1.4


@dataclass
class PanelData:
    title: str
    kind: str
    unit: str
    series: list[Series] = field(default_factory=list)
    heat: list[Series] = field(default_factory=list)
    lines: list[tuple[float, str]] = field(default_factory=list)
    firing: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    bars: bool = False
    mappings: dict[float, str] = field(default_factory=dict)
    y_min: float | None = None
    y_max: float | None = None
    errors: list[str] = field(default_factory=list)


def _styles(p: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """refId -> {color, dashed, width} from the panel's byFrameRefID overrides."""
    out: dict[str, dict[str, Any]] = {}
    for o in (p.get("fieldConfig") or {}).get("overrides") or []:
        m = o.get("matcher") or {}
        if m.get("id") != "byFrameRefID":
            continue
        st: dict[str, Any] = {}
        for prop in o.get("properties") or []:
            if prop.get("id") == "color" and isinstance(prop.get("value"), dict):
                st["color"] = prop["value"].get("fixedColor")
            elif prop.get("id") == "custom.lineStyle":
                st["dashed"] = (prop.get("value") or {}).get("fill") == "dash"
            elif prop.get("id") == "custom.lineWidth":
                st["width"] = float(prop.get("value") or 1)
        out[str(m.get("options"))] = st
    return out


def _spans(points: list[tuple[float, float]], step: float) -> list[tuple[float, float]]:
    spans: list[tuple[float, float]] = []
    for t, _ in sorted(points):
        if spans and t - spans[-1][1] <= 1.5 * step:
            spans[-1] = (spans[-1][0], t)
        else:
            spans.append((t, t))
    return [(a, b + step) for a, b in spans]


def fetch(p: Mapping[str, Any], prom: Prometheus, start: float, end: float, step: float, values: Mapping[str, str],
          th: Thresholds) -> PanelData:
    """Run the panel's queries and its alerts' ALERTS query over [start, end]."""
    data = _panel_data(p)
    styles = _styles(p)
    for q in queries(p):
        if not q.hidden:
            _run_query(data, q, prom, start, end, step, values, styles.get(q.ref_id, {}))
    names = linked_alerts(p, th)
    if names:
        data.firing = _firing(data, names, prom, start, end, step)
    return data


def _panel_data(p: Mapping[str, Any]) -> PanelData:
    """What the panel's JSON says about drawing it: kind, unit, bars, axis limits, threshold lines, mappings."""
    defaults = (p.get("fieldConfig") or {}).get("defaults") or {}
    custom = defaults.get("custom") or {}
    data = PanelData(str(p.get("title")), str(p.get("type")), str(defaults.get("unit") or ""),
                     bars=custom.get("drawStyle") == "bars", y_min=defaults.get("min"), y_max=defaults.get("max"))
    if (custom.get("thresholdsStyle") or {}).get("mode", "off") != "off":
        data.lines = [(float(s["value"]), str(s.get("color") or "red"))
                      for s in (defaults.get("thresholds") or {}).get("steps") or [] if s.get("value") is not None]
    for mp in defaults.get("mappings") or []:
        for k, res in (mp.get("options") or {}).items():
            try:
                data.mappings[float(k)] = str(res.get("text") or k)
            except ValueError:
                pass
    return data


def _run_query(data: PanelData, q: Query, prom: Prometheus, start: float, end: float, step: float,
               values: Mapping[str, str], style: Mapping[str, Any]) -> None:
    """One query's series into ``data`` (heatmap buckets apart); a failed query is noted on the panel."""
    try:
        result = prom.query_range(expand(q.expr, values), start, end, step)
    except PromError as e:
        data.errors.append(f"{q.ref_id}: {e}")
        return
    for labels, pts in result:
        pts = [(t, v) for t, v in pts if not math.isnan(v)]
        if not pts:  # NaN all along (0/0 before any request): Grafana draws nothing and lists nothing
            continue
        s = Series(legend(q.legend, labels), labels, [t for t, _ in pts], [v for _, v in pts], q.ref_id, **style)
        (data.heat if q.heatmap else data.series).append(s)


def _firing(data: PanelData, names: Sequence[str], prom: Prometheus, start: float, end: float,
            step: float) -> dict[str, list[tuple[float, float]]]:
    """alertname -> the spans it fired in, for the alerts whose runbooks the panel links."""
    expr = firing("|".join(sorted(names)))
    spans: dict[str, list[tuple[float, float]]] = {}
    try:
        for labels, pts in prom.query_range(expr, start, end, step):
            spans.setdefault(labels.get("alertname", "?"), []).extend(pts)
    except PromError as e:
        data.errors.append(f"ALERTS: {e}")
    return {k: _spans(v, step) for k, v in sorted(spans.items())}


def draw(data: PanelData, path: Path, start: float, end: float, step: float, subtitle: str) -> Path:
    """One PNG: the series, threshold lines, firing spans; a heatmap for heatmap panels."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.8), dpi=110)
    fig.suptitle(data.title, fontsize=13, fontweight="bold", x=0.01, ha="left")
    ax.set_title(subtitle, fontsize=8, color="#555555", loc="left")
    handles = _shade_firing(ax, data, start, end)
    if data.kind == "heatmap" and data.heat:
        _heatmap(fig, ax, data, _dt)
    else:
        handles += _plot_series(ax, data, step)
    _notes(ax, data)
    _time_axis(ax, start, end)
    _legend(ax, handles)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib  # lazy: drawing is the only use; importing the snapshot module stays light

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _dt(t: float) -> Any:
    """Unix seconds as a matplotlib date number (UTC)."""
    import matplotlib.dates as mdates  # lazy: drawing is the only use; importing the snapshot module stays light

    return mdates.date2num(datetime.fromtimestamp(t, tz=timezone.utc))


def _shade_firing(ax: Any, data: PanelData, start: float, end: float) -> list[Any]:
    """Shade the spans where the panel's alerts fired; one legend handle per alert."""
    handles: list[Any] = []
    for name, spans in data.firing.items():
        for i, (a, b) in enumerate(spans):
            span = ax.axvspan(_dt(max(a, start)), _dt(min(b, end)), color="#d62728", alpha=0.13, lw=0,
                              label=f"firing: {name}" if i == 0 else None)
            if i == 0:
                handles.append(span)
    return handles


def _plot_series(ax: Any, data: PanelData, step: float) -> list[Any]:
    """Lines (bars stacked, as the panel stacks them), threshold lines and the y axis; the legend handles."""
    colors = _colors(data.series)
    stacked: dict[float, float] = {}
    handles: list[Any] = []
    for s in sorted(data.series, key=lambda s: (s.ref_id, s.label)):
        if not s.times:
            continue
        xs = [_dt(t) for t in s.times]
        h: Any
        if data.bars and not s.dashed:
            bottom = [stacked.get(x, 0.0) for x in xs]
            h = ax.bar(xs, s.values, width=step / 86400 * 0.9, bottom=bottom, color=colors[id(s)], alpha=0.85,
                       label=s.label, align="center")
            for x, b, v in zip(xs, bottom, s.values, strict=True):
                stacked[x] = b + v
        else:
            (h,) = ax.plot(xs, s.values, color=colors[id(s)], lw=s.width, ls=(0, (6, 4)) if s.dashed else "-",
                           label=s.label, marker="o" if len(xs) == 1 else None, ms=3)
        handles.append(h)
    for value, color in data.lines:
        handles.append(ax.axhline(value, color=color, ls="--", lw=1.3,
                                  label=f"threshold {format_value(value, data.unit)}"))
    _y_axis(ax, data, list(stacked.values()))
    return handles


def _y_axis(ax: Any, data: PanelData, stacked: list[float]) -> None:
    """Values in the panel's unit, or its value mappings (UP / DOWN) as the ticks."""
    from matplotlib.ticker import FuncFormatter  # lazy: drawing is the only use

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: data.mappings.get(v, format_value(v, data.unit))))
    if not data.mappings:
        _limits(ax, data, stacked)
        return
    ax.set_yticks(sorted(data.mappings))
    lo, hi = min(data.mappings), max(data.mappings)
    ax.set_ylim(lo - 0.1 * (hi - lo or 1), hi + 0.1 * (hi - lo or 1))


def _notes(ax: Any, data: PanelData) -> None:
    """"No data" as Grafana shows it, and the first query errors in red."""
    if not data.series and not data.heat:
        ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", va="center", fontsize=16, color="#888888")
    for err in data.errors[:3]:
        ax.text(0.01, 0.02, err[:160], transform=ax.transAxes, fontsize=7, color="#d62728")


def _time_axis(ax: Any, start: float, end: float) -> None:
    import matplotlib.dates as mdates  # lazy: drawing is the only use

    ax.set_xlim(_dt(start), _dt(end))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=timezone.utc))
    ax.set_xlabel("time (UTC)", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(True, color="#e5e5e5", lw=0.6)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _legend(ax: Any, handles: list[Any]) -> None:
    """Below the plot, at most MAX_LEGEND entries (the last says how many more)."""
    if not handles:
        return
    shown = handles[:MAX_LEGEND]
    labels = [str(h.get_label()) for h in shown]
    if len(handles) > MAX_LEGEND:
        labels[-1] += f"  (+{len(handles) - MAX_LEGEND} more)"
    ax.legend(shown, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16),
              ncol=min(3, len(shown)), frameon=False)


def _colors(series: list[Series]) -> dict[int, str]:
    """Palette colors for data series; a styled line (alert line, reference) keeps its fixed color unless its
    query returned several lines, then it takes the color of the data series with the same labels (shape,
    pool, ...), so each shape's alert line reads next to that shape."""
    out: dict[int, str] = {}
    data = sorted((s for s in series if s.color is None), key=lambda s: (s.ref_id, s.label))
    for i, s in enumerate(data):
        out[id(s)] = _PALETTE[i % len(_PALETTE)]
    per_ref: dict[str, int] = {}
    for s in series:
        per_ref[s.ref_id] = per_ref.get(s.ref_id, 0) + 1
    for s in series:
        if s.color is None:
            continue
        out[id(s)] = s.color
        if per_ref[s.ref_id] > 1:
            keys = set(s.labels) - {"__name__"}
            for d in data:
                shared = keys & set(d.labels)
                if shared and all(s.labels[k] == d.labels[k] for k in shared):
                    out[id(s)] = out[id(d)]
                    break
    return out


def _limits(ax: Any, data: PanelData, extra: list[float]) -> None:
    """Grafana's axis: min/max of the panel where set (hard limits), else the data's range padded."""
    values = [v for s in data.series for v in s.values if math.isfinite(v)] + [v for v, _ in data.lines] + extra
    if not values:
        return
    lo = float(data.y_min) if data.y_min is not None else min(values)
    hi = float(data.y_max) if data.y_max is not None else max(values)
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    pad = (hi - lo) * 0.08
    ax.set_ylim(lo if data.y_min is not None else lo - pad, hi if data.y_max is not None else hi + pad)


def _heatmap(fig: Any, ax: Any, data: PanelData, dt: Any) -> None:
    """Prometheus buckets (cumulative, one series per ``le``) -> counts per bucket and time."""
    import numpy as np  # lazy, as matplotlib: drawing is the only use
    from matplotlib.ticker import FuncFormatter

    by_le: dict[float, dict[float, float]] = {}
    for s in data.heat:
        le = float(s.labels.get("le", "nan"))
        if math.isnan(le):
            continue
        by_le.setdefault(le, {}).update(zip(s.times, s.values, strict=True))
    les = sorted(by_le)
    times = sorted({t for d in by_le.values() for t in d})
    cum = np.array([[by_le[le].get(t, np.nan) for t in times] for le in les])
    counts = np.diff(np.vstack([np.zeros((1, len(times))), cum]), axis=0).clip(min=0)
    finite = [le for le in les if math.isfinite(le)]
    if les and not math.isfinite(les[-1]):
        counts = counts[:-1]  # hits above the last bucket cannot happen for a ratio <= 1
    edges_y = [0.0, *finite]
    step = (times[1] - times[0]) if len(times) > 1 else 60.0
    edges_x = [dt(t - step / 2) for t in times] + [dt(times[-1] + step / 2)]
    masked = np.ma.masked_where(~(counts > 0), counts)
    mesh = ax.pcolormesh(edges_x, edges_y, masked, cmap="Oranges", shading="flat", vmin=0)
    cb = fig.colorbar(mesh, ax=ax, pad=0.01)
    cb.set_label("hits per interval", fontsize=8)
    cb.ax.tick_params(labelsize=7)
    ax.set_ylim(0, max(finite) if finite else 1)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_value(v, "percentunit")))
    ax.set_ylabel("position in trajectory (step / steps)", fontsize=8)


# ----- the API the drill reports call ------------------------------------------------------------

def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") or "panel"


def render_panels(dashboard_json_path: str | Path, titles: Sequence[str] | None, prometheus_url: str,
                  start: float | str, end: float | str, out_dir: str | Path, *,
                  variables: Mapping[str, str] | None = None, thresholds: Thresholds | None = None,
                  step: float | None = None) -> list[Path]:
    """Render the titled panels (all panels when ``titles`` is None) to ``out_dir/<slug>.png``.

    Variables default to ``.*`` (all instances, pools, shapes); ``$__rate_interval`` is derived
    from the step and Prometheus's scrape interval as Grafana does.
    """
    th = thresholds or load_thresholds()
    d = load(dashboard_json_path)
    chosen = [panel(d, t) for t in titles] if titles else list(panels(d))
    t0, t1 = parse_time(start), parse_time(end)
    if t1 <= t0:
        raise ValueError(f"--to ({t1:.0f}) must be after --from ({t0:.0f})")
    with Prometheus(prometheus_url) as prom:
        scrape = scrape_interval(prom)
        step = step or max(scrape, math.ceil((t1 - t0) / MAX_POINTS))
        values = _values(variables or {}, step, scrape)
        head = _subtitle(str(d.get("title")), t0, t1, values)
        paths = []
        for p in chosen:
            data = fetch(p, prom, t0, t1, step, values, th)
            paths.append(draw(data, Path(out_dir) / f"{slug(str(p.get('title')))}.png", t0, t1, step,
                              f"{head}  |  unit {data.unit}"))
    return paths


def _values(variables: Mapping[str, str], step: float, scrape: float) -> dict[str, str]:
    """The dashboard variables' values (``.*`` unless given) and ``$__rate_interval`` as Grafana derives it."""
    values = {v: ".*" for v in FILTER_VARS}
    values.update(variables)
    values["__rate_interval"] = fmt_duration(rate_interval(step, scrape))
    return values


def _subtitle(dashboard_title: str, t0: float, t1: float, values: Mapping[str, str]) -> str:
    """Which dashboard, time span, variables and rate interval a snapshot shows."""
    chosen_vars = ", ".join(f"{k}={v}" for k, v in sorted(values.items()) if not k.startswith("__"))
    span = (f"{datetime.fromtimestamp(t0, tz=timezone.utc):%Y-%m-%d %H:%M:%S} to "
            f"{datetime.fromtimestamp(t1, tz=timezone.utc):%H:%M:%S} UTC")
    return f"{dashboard_title}  |  {span}  |  {chosen_vars}  |  rate interval {values['__rate_interval']}"
