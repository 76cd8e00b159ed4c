"""The seeds' minimal performance report, per shape, of the configuration a service would run.

For each shape the set is rendered twice side by side: the lossless baseline (no cross-step cache; with a
first-block cache configured, the same hooks at threshold 0, which compute every step and give the identical
image without switching the compiled blocks' hooks) and the configured setting.  A lossless configuration is
rendered twice all the same: an A/A that must read identical images and a speedup of about 1.  Timings are
the configured run's; quality is the configured output against the baseline of the same prompt and seed.
Items alternate which variant runs first (``Runner.side_by_side``, as the sweep's values do).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from stepwatch.bench.capacity import HEADROOM, gpus_for
from stepwatch.bench.eval_quality import lpips_availability, lpips_scores, score_item, summarize
from stepwatch.bench.eval_runner import IMAGES, Item, Runner, Setting, Shape, configured
from stepwatch.bench.paired import paired_speedup
from stepwatch.service.config import ServiceConfig

GIB = 1024 ** 3


def lossless_for(served: Setting) -> Setting:
    """The baseline a served setting is compared with: every step computed, at the same steps."""
    if served.cache_kind == "first_block_cache":
        return Setting("first_block_cache", 0.0, served.steps)
    return Setting("none", None, served.steps)


def performance(shape: Shape, items: list[Item]) -> dict[str, Any]:
    """Per-step ms (median, n), the three stages' ms, end-to-end seconds, peak memory, throughput."""
    steps = [s for it in items for s in it.step_seconds]
    e2e = statistics.median(it.seconds for it in items)
    per_item = shape.frames or 1
    stages = {k: 1e3 * statistics.median(it.stages.get(k, 0.0) for it in items)
              for k in ("text_encode", "denoise", "vae_decode")}
    return {"step_ms": {"median": 1e3 * statistics.median(steps), "n": len(steps)}, "stages_ms": stages,
            "end_to_end_s": e2e, "peak_memory_gib": max(it.peak_bytes for it in items) / GIB,
            "throughput": {"per_second_per_device": per_item / e2e, "unit": "frames" if shape.frames else "images",
                           "concurrency": 1}}


def quality(shape: Shape, served: list[Item], base: list[Item], lpips_note: str | None) -> dict[str, Any]:
    scores = [score_item(s.output, b.output) for s, b in zip(served, base, strict=True)]
    out = summarize(scores)
    out["identical"] = sum(1 for s, b in zip(served, base, strict=True) if (s.output == b.output).all())
    if lpips_note is None:
        vals = sorted(lpips_scores([s.output for s in served], [b.output for b in base]))
        out["lpips"] = {"p50": vals[len(vals) // 2], "p90": vals[int(0.9 * (len(vals) - 1))]}
    else:
        out["lpips"] = lpips_note
    return out


def evaluate_shape(runner: Runner, shape: Shape, images: int, lpips_note: str | None,
                   qps: float | None = None) -> dict[str, Any]:
    """One row of the report: what ran, how fast, how good against the lossless baseline."""
    served = configured(runner.cfg, shape)
    base = lossless_for(served)
    b, s = runner.side_by_side(shape, [base, served], images)
    decisions = sum(it.decisions for it in s)
    ratio, (lo, hi) = paired_speedup([it.seconds for it in b], [it.seconds for it in s])
    row: dict[str, Any] = {
        "shape": shape.label, "model": runner.model(shape), "kind": "video" if shape.is_video else "image",
        "steps": shape.steps, "compile": runner.compile_mode(shape),
        "frames": shape.frames or None, "cfg": shape.guidance if shape.guidance > 1 else "off",
        "cache": {"kind": served.cache_kind, "threshold": served.cache_threshold,
                  "hit_ratio": sum(it.hits for it in s) / decisions if decisions else 0.0},
        "baseline": base.describe(),
        **performance(shape, s),
        "speedup_vs_baseline": {"ratio": ratio, "interval": [lo, hi], "pairs": images},
        "quality": quality(shape, s, b, lpips_note),
    }
    if qps is not None:
        gpus = gpus_for(qps, row["end_to_end_s"])
        row["capacity"] = {"qps": qps, "headroom": HEADROOM, "gpus": gpus}
    return row


def evaluate(cfg: ServiceConfig, shapes: list[Shape], images: int = IMAGES, qps: float | None = None,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The report: the deployment's description, then one row per shape."""
    runner = Runner(cfg, progress)
    header = runner.describe()
    note = lpips_availability()
    rows = []
    for shape in shapes:
        if progress:
            progress(f"  {shape.label}: {images} items, baseline and configured side by side")
        rows.append(evaluate_shape(runner, shape, images, note, qps))
    return {**header, "images": images, "lpips": note or "measured (AlexNet)", "shapes": rows}


def _fmt(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def _lpips(v: Any) -> str:
    return v if isinstance(v, str) else f"p50 {v['p50']:.3f} / p90 {v['p90']:.3f}"


def to_markdown(report: dict[str, Any]) -> str:
    """The report in the seeds' minimal format, one block per shape."""
    d = report["device"]
    device = f"{d['model']} x{d['count']}" + (f", driver {d['driver']}, CUDA {d['cuda']}" if d.get("cuda") else "")
    lines = ["# Performance report", ""]
    for r in report["shapes"]:
        c, q, p = r["cache"], r["quality"], r["stages_ms"]
        cache = c["kind"] if c["threshold"] is None else f"{c['kind']} threshold {c['threshold']:g}"
        lines += [
            f"## {r['shape']}", "",
            f"{r['model']} · {r['shape']} · {r['steps']} steps · CFG {r['cfg']} · {report['engine']} · "
            f"compile {r['compile']} · attention {report['attention_backend']} · parallel "
            f"{report['parallel_degree']} · {report['precision']} · cache {cache} (hit ratio "
            f"{c['hit_ratio']:.2f}) · {device}", "",
            f"per step {r['step_ms']['median']:.1f} ms (median, n={r['step_ms']['n']}) · text encode "
            f"{p['text_encode']:.1f} ms · denoise {p['denoise']:.1f} ms · VAE decode {p['vae_decode']:.1f} ms · "
            f"end to end {r['end_to_end_s']:.3f} s · peak memory {r['peak_memory_gib']:.2f} GiB · "
            f"{r['throughput']['per_second_per_device']:.2f} {r['throughput']['unit']}/s/device (concurrency 1)", "",
            f"vs baseline ({r['baseline']}, {q['n']} items, {q['identical']} identical): PSNR p50 "
            f"{_fmt(q['psnr']['p50'])} / p10 {_fmt(q['psnr']['p10'])} dB · SSIM p50 {_fmt(q['ssim']['p50'])} / "
            f"p10 {_fmt(q['ssim']['p10'])} · LPIPS {_lpips(q['lpips'])}"
            + (f" · worst frame {q['worst_frame']['frame']} of item {q['worst_frame']['item']}"
               if "worst_frame" in q else ""),
            f"speedup over the baseline {r['speedup_vs_baseline']['ratio']:.3f} "
            f"[{r['speedup_vs_baseline']['interval'][0]:.3f}, {r['speedup_vs_baseline']['interval'][1]:.3f}]"
            + (f" · {r['capacity']['gpus']:.0f} devices for {r['capacity']['qps']:g} QPS "
               f"(x{r['capacity']['headroom']} headroom)" if "capacity" in r else ""), "",
        ]
    return "\n".join(lines)
