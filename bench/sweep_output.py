"""What a sweep leaves behind: the curve as a PNG, the working points in a service config, the alerts' baselines.

``write_config`` stores the decision where the service reads it: a cache-threshold sweep as ``shape_cache``
(each shape's own threshold, service/shape_cache.py), a cache-kind sweep as ``cache.kind`` (one kind per
service: the kind most shapes chose), a steps sweep as ``default_steps`` (the most steps any shape needs, so
every shape meets its gate).  Beside it goes a baselines file, the per-shape step seconds and cache hit ratio
measured at the working point, which the exporter publishes as the baselines StepwatchStepTimeRegression and
StepwatchCacheHitRateShift compare with; the config points at it.  The new config is checked by the
service's own parser before anything is written, and written whole or not at all.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from stepwatch.exporter.shapes import ShapeKey
from stepwatch.files import write_atomically
from stepwatch.service.config import ConfigError, default_path, parse

PLOT_CAP_DB = 60.0  # identical images (PSNR inf) are drawn here, marked


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """Speedup (x) against PSNR p10 (y) per shape, both intervals as error bars, the gate and the working point."""
    import matplotlib  # lazy: only a plot needs it (the dashboards extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["shapes"] if "curve" in r]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for r in rows:
        xs = [p["speedup"] for p in r["curve"]]
        ys = [min(p["quality"]["psnr"]["p10"], PLOT_CAP_DB) for p in r["curve"]]
        xerr = [[x - p["speedup_interval"][0] for x, p in zip(xs, r["curve"], strict=True)],
                [p["speedup_interval"][1] - x for x, p in zip(xs, r["curve"], strict=True)]]
        yerr = [[max(0.0, y - min(p["quality"]["psnr"]["p10_interval"][0], PLOT_CAP_DB))
                 for y, p in zip(ys, r["curve"], strict=True)],
                [max(0.0, min(p["quality"]["psnr"]["p10_interval"][1], PLOT_CAP_DB) - y)
                 for y, p in zip(ys, r["curve"], strict=True)]]
        line = ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, marker="o", capsize=3, label=r["shape"])
        for x, y, p in zip(xs, ys, r["curve"], strict=True):
            ax.annotate(str(p["value"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.axhline(r["gate"]["psnr_db"], color=line[0].get_color(), linestyle="--", linewidth=1)
        wp = r["working_point"]
        if wp is not None:
            ax.plot([wp["speedup"]], [min(wp["psnr_p10"], PLOT_CAP_DB)], marker="o", markersize=14,
                    markerfacecolor="none", color="black")
    ax.set_xlabel("speedup over the lossless baseline (paired, 95% interval)")
    ax.set_ylabel(f"PSNR p10 against the baseline, dB (identical: {PLOT_CAP_DB:g})")
    ax.set_title(f"stepwatch sweep {result['sweep']} ({result['model']})\ndashed: the gate; circled: the working point",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out


def working_points(result: dict[str, Any]) -> dict[str, Any]:
    """{shape label: working value} of the shapes that have one."""
    return {r["shape"]: r["working_point"]["value"] for r in result["shapes"]
            if r.get("working_point") is not None}


def _apply(raw: dict[str, Any], result: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The config with the sweep's decision in it, and notes on what was decided for whom."""
    points = {k: v for k, v in working_points(result).items() if not ShapeKey.parse(k).frames}
    notes: list[str] = []
    if not points:
        raise ConfigError("no image shape has a working point: nothing to write")
    sweep = result["sweep"]
    if sweep == "cache-threshold":
        raw["cache"] = {**(raw.get("cache") or {}), "kind": "first_block_cache"}
        raw["shape_cache"] = {**(raw.get("shape_cache") or {}),
                              **{s: {"threshold": float(v)} for s, v in points.items()}}
    elif sweep == "cache-kind":
        kind, n = Counter(points.values()).most_common(1)[0]
        raw["cache"] = {**(raw.get("cache") or {}), "kind": kind}
        if kind != "first_block_cache" and raw.pop("shape_cache", None):
            notes.append("shape_cache removed: per-shape thresholds apply to first_block_cache only")
        if n < len(points):
            notes.append(f"cache.kind {kind}: chosen by {n} of {len(points)} shapes (one kind per service)")
    else:
        raw["default_steps"] = max(int(v) for v in points.values())
        notes.append(f"default_steps {raw['default_steps']}: the most steps any swept shape needs")
    return raw, notes


def baselines(result: dict[str, Any]) -> dict[str, Any]:
    """The alerts' per-shape baselines at each working point (labelled with the working steps)."""
    out = {}
    for r in result["shapes"]:
        wp = r.get("working_point")
        if wp is None:
            continue
        label = r["shape"]
        if result["sweep"] == "steps":
            size, _, rest = label.partition("_")
            label = f"{size}_{wp['value']}s" + ("_cfg" if rest.endswith("_cfg") else "")
        out[label] = {"step_seconds": round(wp["step_seconds"], 6), "cache_hit_ratio": round(wp["hit_ratio"], 4)}
    return {"shapes": out}


def write_config(result: dict[str, Any], source: str | None, out: str | Path) -> tuple[Path, Path, list[str]]:
    """Write the config with the working points to ``out`` and its baselines beside it; ConfigError if the
    result would not load (nothing is written then)."""
    src = Path(source) if source else default_path()
    raw = yaml.safe_load(src.read_text()) or {}
    raw, notes = _apply(raw, result)
    out = Path(out)
    base_path = out.with_name(out.stem + ".baselines.yaml")
    raw["baselines"] = str(base_path)
    write_atomically(base_path, "# Per-shape baselines at the working points of `stepwatch sweep " + result["sweep"]
                  + "`: what StepwatchStepTimeRegression and StepwatchCacheHitRateShift compare with.\n"
                  + yaml.safe_dump(baselines(result), sort_keys=True))
    try:
        parse(dict(raw))
    except ConfigError:
        base_path.unlink(missing_ok=True)
        raise
    write_atomically(out, f"# Written by `stepwatch sweep {result['sweep']} --write-config` from {src.name}.\n"
                  + yaml.safe_dump(raw, sort_keys=False))
    return out, base_path, notes

