"""A lossy option swept along its parameter: the speed-quality curve per shape and its working point.

The seeds' method (article three, sections four and five): each lossy option has a continuous parameter (a
cache threshold, a cache kind, the step count); the evaluation's product is a speedup-quality curve per
model x shape x steps and the working point at the quality budget, stored in the config.  Here every value of
the parameter renders the fixed prompt x seed set beside the lossless baseline, item by item in rotating
order (each item's variants run back to back, each variant first as often as the others), so the speedup is
a paired ratio with the bench's 95% interval (bench/paired.py), and the quality is each item against the
baseline's item, its p10 with a bootstrap interval (bench/eval_quality.py).  An A/A row (the baseline against
itself, rendered again) shows what the interval reads when nothing changed: about 1, and identical images.

The working point is the fastest value whose quality p10 is above the gate **at the low end of its interval**
(a launch decision should survive one more bad item), with the gate from stepwatch/thresholds.yaml: an image
at the PSNR gate of the optimization's kind (caching and fewer steps are lossy II, 30 dB, unless ``--gate``),
a video at the video PSNR gate (24 dB) and SSIM gate (0.92), both at its worst frame.  A few-step shape (at
most few_step.max_steps without CFG) is not swept for a cache: a cross-step cache must never hit there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stepwatch.bench.eval_quality import score_item, summarize
from stepwatch.bench.eval_runner import IMAGES, Item, Runner, Setting, Shape, configured
from stepwatch.bench.evaluate import lossless_for
from stepwatch.bench.paired import paired_speedup
from stepwatch.service.config import ServiceConfig
from stepwatch.thresholds import Thresholds

SWEEPS = ("cache-threshold", "cache-kind", "steps")
AA = "A/A"


@dataclass(frozen=True)
class Gate:
    psnr_db: float
    ssim: float | None
    name: str

    def passes(self, quality: dict[str, Any]) -> bool:
        """The p10's interval lies above the gate (PSNR, and SSIM where the gate has one)."""
        ok = quality["psnr"]["p10_interval"][0] >= self.psnr_db
        return ok and (self.ssim is None or quality["ssim"]["p10_interval"][0] >= self.ssim)


def gate_for(shape: Shape, th: Thresholds, name: str | None = None) -> Gate:
    """The quality budget of ``shape`` from the thresholds source (``name``: one of quality.gates_db)."""
    q = th.quality
    if shape.is_video:
        return Gate(q.video_psnr_gate_db, q.ssim_gate.get("video"), "video")
    key = name or q.default_gate
    if key not in q.gates_db:
        raise ValueError(f"gate {key!r}: choose one of {', '.join(q.gates_db)} (quality.gates_db)")
    return Gate(q.gate(key), None, key)


def default_values(sweep: str, cfg: ServiceConfig, shape: Shape) -> list[Any]:
    """Values worth sweeping by default: thresholds around the practice default (0.7), the three cache kinds,
    a quarter to three quarters of the shape's steps."""
    if sweep == "cache-threshold":
        return [0.3, 0.5, 0.7, 0.9, 1.2, 1.6]
    if sweep == "cache-kind":
        return ["first_block_cache", "mag_cache", "taylorseer"]
    return sorted({max(1, shape.steps * k // 4) for k in (1, 2, 3)} - {shape.steps})


def candidate(sweep: str, value: Any, cfg: ServiceConfig, shape: Shape) -> Setting:
    """The setting a value stands for; the rest of the setting is the baseline's."""
    if sweep == "cache-threshold":
        return Setting("first_block_cache", float(value))
    if sweep == "cache-kind":
        kind = str(value)
        same = kind == cfg.cache.kind and kind != "none"
        return Setting(kind, float(cfg.cache.threshold) if same else None)
    base = baseline(sweep, cfg, shape)
    return Setting(base.cache_kind, base.cache_threshold, int(value))


def baseline(sweep: str, cfg: ServiceConfig, shape: Shape) -> Setting:
    """Every step computed at the shape's steps (through the first-block cache's hooks at 0 where it is on)."""
    if sweep == "cache-threshold":
        return Setting("first_block_cache", 0.0)
    if sweep == "cache-kind":
        return Setting("none", None)
    return lossless_for(configured(cfg, shape))


def check_values(sweep: str, values: list[Any]) -> list[Any]:
    """The values parsed for ``sweep``; ValueError naming a bad one."""
    from stepwatch.service.cache import KINDS

    out: list[Any] = []
    for v in values:
        if sweep == "cache-threshold":
            try:
                t = float(v)
            except ValueError:
                t = math.nan
            if not 0 <= t < math.inf:
                raise ValueError(f"--values: threshold {v} must be a finite number >= 0")
            out.append(t)
        elif sweep == "cache-kind":
            if v not in KINDS or v == "none":
                raise ValueError(f"--values: {v!r} is not a cache kind ({', '.join(k for k in KINDS if k != 'none')})")
            out.append(v)
        else:
            if not str(v).isdigit() or int(v) < 1:
                raise ValueError(f"--values: {v!r} is not a step count >= 1")
            out.append(int(v))
    return out


def point(value: Any, base: list[Item], cand: list[Item], gate: Gate) -> dict[str, Any]:
    """One point of the curve: the paired speedup over the baseline and the quality against it."""
    ratio, (lo, hi) = paired_speedup([b.seconds for b in base], [c.seconds for c in cand])
    quality = summarize([score_item(c.output, b.output) for c, b in zip(cand, base, strict=True)])
    decisions = sum(c.decisions for c in cand)
    steps = [s for c in cand for s in c.step_seconds]
    # The mean, as StepwatchStepTimeRegression compares a window's mean step time with the baseline.
    return {"value": value, "speedup": ratio, "speedup_interval": [lo, hi], "quality": quality,
            "hit_ratio": sum(c.hits for c in cand) / decisions if decisions else 0.0,
            "step_seconds": sum(steps) / len(steps), "passes_gate": gate.passes(quality)}


def sweep_shape(runner: Runner, sweep: str, values: list[Any], shape: Shape, images: int, gate: Gate,
                ) -> dict[str, Any]:
    """The curve of one shape, its A/A row and its working point."""
    cfg = runner.cfg
    base = baseline(sweep, cfg, shape)
    settings = [base, base] + [candidate(sweep, v, cfg, shape) for v in values]
    items = runner.side_by_side(shape, settings, images)
    aa = point(AA, items[0], items[1], gate)
    curve = [point(v, items[0], it, gate) for v, it in zip(values, items[2:], strict=True)]
    passing = [(p["speedup"], v, p) for v, p in zip(values, curve, strict=True) if p["passes_gate"]]
    best = max(passing, key=lambda x: x[0]) if passing else None
    return {"shape": shape.label, "baseline": base.describe(), "gate": gate.__dict__, "a_a": aa, "curve": curve,
            "working_point": None if best is None else {"value": best[1], **{k: best[2][k] for k in (
                "speedup", "speedup_interval", "hit_ratio", "step_seconds")},
                "psnr_p10": best[2]["quality"]["psnr"]["p10"]},
            "why_none": None if best else "no value keeps the quality p10's interval above the gate"}


def skip_reason(sweep: str, shape: Shape, th: Thresholds) -> str | None:
    few = th.few_step_max_steps
    if sweep.startswith("cache") and shape.guidance <= 1 and shape.steps <= few:
        return f"few-step ({shape.steps} steps without CFG): a cross-step cache must never hit here"
    return None


def run_sweep(cfg: ServiceConfig, sweep: str, shapes: list[Shape], th: Thresholds, values: list[Any] | None = None,
              images: int = IMAGES, gate_name: str | None = None,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every shape's curve and working point."""
    if sweep not in SWEEPS:
        raise ValueError(f"sweep {sweep!r}: choose one of {', '.join(SWEEPS)}")
    runner = Runner(cfg, progress)
    rows = []
    for shape in shapes:
        reason = skip_reason(sweep, shape, th)
        if reason:
            rows.append({"shape": shape.label, "skipped": reason})
            continue
        vals = check_values(sweep, values) if values else default_values(sweep, cfg, shape)
        if progress:
            progress(f"  {shape.label}: {len(vals)} values + baseline + A/A, {images} items each")
        rows.append(sweep_shape(runner, sweep, vals, shape, images, gate_for(shape, th, gate_name)))
    return {"sweep": sweep, "model": runner.model(shapes[0]) if shapes else None, "images": images,
            "compile": cfg.compile.enabled, "shapes": rows}
