"""``stepwatch sweep KIND``: a lossy option's speed-quality curve per shape, its working point, and the config.

KIND is ``cache-threshold`` (the first-block cache's threshold), ``cache-kind`` (first_block_cache, mag_cache,
taylorseer at their default parameters) or ``steps`` (fewer denoising steps).  For each value the fixed
prompt x seed set is rendered beside the lossless baseline, item by item; each value gets the paired speedup
over the baseline with its 95% interval and the quality p10 (PSNR, SSIM; a video's worst frame) with its
interval, and an A/A row shows the intervals reading "nothing changed".  The working point is the fastest
value whose p10 interval stays above the gate from stepwatch/thresholds.yaml (lossy II, 30 dB, for caching
and steps unless ``--gate``; video 24 dB and SSIM 0.92).  The curve is drawn to ``--plot`` (speedup against
PSNR p10, the gate dashed, the working point circled).  ``--write-config OUT`` stores the working points in
a copy of the service config (per-shape cache thresholds, the cache kind or the default steps) and writes
the per-shape step-time and hit-ratio baselines the alerts compare with beside it (OUT.baselines.yaml).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from stepwatch.bench.cli_evaluate import RUN_ERRORS, config_and_shapes, emit, failed, say
from stepwatch.bench.eval_runner import IMAGES
from stepwatch.bench.sweep import SWEEPS
from stepwatch.service.config import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep", choices=SWEEPS, help="the lossy option to sweep")
    p.add_argument("--values", nargs="+", metavar="V",
                   help="the values to sweep (default: thresholds 0.3-1.6, the three cache kinds, or a quarter "
                        "to three quarters of the steps)")
    p.add_argument("--config", help="the service config to start from (default: the embedded default)")
    p.add_argument("--shapes", nargs="+", metavar="SHAPE",
                   help="WxH, WxHxF, either with _<steps>s (default: the config's default sizes)")
    p.add_argument("--images", type=int, default=IMAGES, help="items per value, at most %(default)s")
    p.add_argument("--gate", help="the PSNR gate of images by name in quality.gates_db (default: default_gate)")
    p.add_argument("--thresholds", help="the thresholds file (default: the packaged stepwatch/thresholds.yaml)")
    p.add_argument("--no-compile", action="store_true", help="sweep eagerly even if the config compiles")
    p.add_argument("--plot", default=None, help="the curve's PNG (default: sweep-<KIND>.png here)")
    p.add_argument("--write-config", metavar="OUT", help="write the config with the working points to OUT")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def to_table(result: dict[str, Any]) -> str:
    lines = [f"# stepwatch sweep {result['sweep']} on {result['model']} ({result['images']} items per value)", ""]
    for r in result["shapes"]:
        if "skipped" in r:
            lines += [f"## {r['shape']}: skipped, {r['skipped']}", ""]
            continue
        g = r["gate"]
        lines += [f"## {r['shape']} (baseline {r['baseline']}; gate PSNR p10 >= {g['psnr_db']:g} dB"
                  + (f", SSIM p10 >= {g['ssim']:g}" if g["ssim"] else "") + ")", "",
                  "| value | speedup [95%] | PSNR p10 [95%] dB | SSIM p10 | hit ratio | gate |",
                  "|---|---|---|---|---|---|"]
        for p in [r["a_a"], *r["curve"]]:
            q = p["quality"]
            (slo, shi), (qlo, qhi) = p["speedup_interval"], q["psnr"]["p10_interval"]
            lines.append(f"| {p['value']} | {p['speedup']:.3f} [{slo:.3f}, {shi:.3f}] | {q['psnr']['p10']:.1f} "
                         f"[{qlo:.1f}, {qhi:.1f}] | {q['ssim']['p10']:.3f} | {p['hit_ratio']:.2f} | "
                         f"{'pass' if p['passes_gate'] else 'fail'} |")
        wp = r["working_point"]
        lines += ["", f"working point: {wp['value']} ({wp['speedup']:.3f}x, PSNR p10 {wp['psnr_p10']:.1f} dB)"
                  if wp else f"working point: none, {r['why_none']}", ""]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from stepwatch.bench import sweep_output
    from stepwatch.bench.sweep import check_values, gate_for, run_sweep
    from stepwatch.thresholds import ThresholdsError, load

    try:
        cfg, shapes = config_and_shapes(args)
        th = load(args.thresholds)
        values = check_values(args.sweep, args.values) if args.values else None
        for shape in shapes:
            gate_for(shape, th, args.gate)
        if args.write_config and args.no_compile:
            raise ValueError("--write-config with --no-compile: step-time baselines measured eagerly would not "
                             "match the compiled service; sweep as the service runs")
        say(f"sweeping {args.sweep} on {', '.join(s.label for s in shapes)} ({args.images} items per value)")
    except (ConfigError, ThresholdsError, ValueError) as e:
        print(f"stepwatch sweep: {e}", file=sys.stderr)
        return 2
    try:
        result = run_sweep(cfg, args.sweep, shapes, th, values, args.images, args.gate, progress=say)
        result["plot"] = str(sweep_output.plot(result, args.plot or f"sweep-{args.sweep}.png"))
    except RUN_ERRORS as e:
        return failed("sweep", e)
    if args.write_config:
        try:
            out, base, notes = sweep_output.write_config(result, args.config, args.write_config)
        except ConfigError as e:
            print(f"stepwatch sweep: --write-config: {e} (nothing written)", file=sys.stderr)
            return 1
        result["written"] = {"config": str(out), "baselines": str(base), "notes": notes}
        say(f"wrote {out} and {base}" + "".join(f"\n  {n}" for n in notes))
    emit(result, args.json, to_table)
    return 0

