"""``stepwatch demo``: the main job on the embedded default.

Brings up the local stack on loopback ports - the practice service (a real
offline FLUX pipeline, instrumented, compiled, under a memory budget), the
sidecar (quality prober), Prometheus with the drill-profile rules and
Alertmanager routing to a webhook receiver - sends traffic, and runs four fault
drills: the seeds' three (a cache threshold past the quality gate, off-menu
resolutions, VAE tiling off at 2048x2048) and prompt-mix-shift, whose alert
(CacheHitRateShift) the cache-threshold drill fires too: triage must name a
different cause for each.  About 10 minutes on 2 CPU cores (torch.compile with
the aot_eager backend; ``--compile-backend inductor`` compiles as production
does and takes longer).  It ends with the paths of the report (markdown and
JSON), the dashboard panels (PNG) and each drill's triage report.

The full pre-launch campaign is ``stepwatch drill all``: 40 drills on the
one-rank, stream-probe, two-rank and fleet stacks, about 70 minutes.

``--exporter-only`` runs the small in-process demo instead: the exporter on the
practice pipeline at two shapes, /metrics served on loopback, a summary.
"""

from __future__ import annotations

import argparse

from stepwatch.fault_injection import cli_drill
from stepwatch.service.config import ConfigError, parse_size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drills", nargs="+", default=["demo"], metavar="NAME",
                   help="drills to run (default: demo, the seeds' three and prompt-mix-shift, about 10 min; "
                        "'all' for the full campaign, about 70 min)")
    p.add_argument("--compile-backend", choices=("inductor", "aot_eager", "eager"), default="aot_eager",
                   help="torch.compile backend of the practice service (default: %(default)s; inductor compiles "
                        "as production does, minutes longer on CPU)")
    p.add_argument("--out", default="reports", help="report directory (default: %(default)s)")
    p.add_argument("--exporter-only", action="store_true", help="the small in-process exporter demo instead")
    p.add_argument("--port", type=int, default=9464, help="loopback port for /metrics (0: any free port)")
    p.add_argument("--shapes", nargs="+", default=["512x512", "1024x1024"], metavar="WxH",
                   help="image sizes to generate (default: %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="denoising steps per image (default: %(default)s)")
    p.add_argument("--requests", type=int, default=3, help="requests per shape (default: %(default)s)")
    p.add_argument("--cache-threshold", type=float, default=0.6,
                   help="first-block cache threshold on the second shape (default: %(default)s)")
    p.add_argument("--hold", type=float, default=0.0,
                   help="keep serving /metrics this many seconds after the summary (default: exit)")


def _sizes(shapes: list[str]) -> list[tuple[int, int]]:
    try:
        return [parse_size(s) for s in shapes]
    except ConfigError as e:
        raise SystemExit(f"demo: bad --shapes {e}") from None


def run(args: argparse.Namespace) -> int:
    if args.exporter_only:
        # Imported here: the exporter demo runs the pipeline (torch) in this process; the drills do not.
        from stepwatch.service import demo

        return demo.exporter_demo(_sizes(args.shapes), port=args.port, steps=args.steps, requests=args.requests,
                                  cache_threshold=args.cache_threshold, hold=args.hold)
    return cli_drill.run(drill_arguments(args))


def drill_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """``stepwatch drill``'s own arguments for the demo's drills: parsed by its parser, so every option the
    drill command reads has its default."""
    p = argparse.ArgumentParser(prog="stepwatch drill")
    cli_drill.add_arguments(p)
    argv = [*args.drills, "--out", args.out]
    if args.compile_backend:
        argv += ["--compile-backend", args.compile_backend]
    return p.parse_args(argv)
