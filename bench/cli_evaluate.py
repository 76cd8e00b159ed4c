"""``stepwatch evaluate``: the launch owner's performance report, per shape, before a service goes live.

Builds the pipelines the service's config builds (the practice model by default, or the config's ``model``
directory), renders a fixed set of prompts x seeds (20 by default, the seeds' count) under the lossless
baseline and under the configured setting side by side, and prints the seeds' minimal report per shape: what
ran (model, shape, steps, CFG, engine and version, compile, attention backend, parallel degree, precision,
cache parameters, device), how fast (per-step ms median with n, the three stages, end to end, peak memory,
throughput at concurrency 1, the speedup over the baseline with its 95% interval) and how good against the
baseline (PSNR and SSIM p50 and p10, the p10's interval; a video by its worst frame; LPIPS where its weights
are on this machine, else the report says why not).  ``--qps`` adds the devices a load needs
(QPS x end-to-end seconds x 1.3).  ``--determinism`` instead renders the set twice in this process and once
after a restart, and reports every image that differs and what to suspect.
On CPU the peak memory is the process's high-water mark, not a device's.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from stepwatch.bench.eval_quality import json_safe
from stepwatch.bench.eval_runner import IMAGES, Shape, default_shapes, parse_shape
from stepwatch.service.config import ConfigError, ServiceConfig, load


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="the service config to evaluate (default: the embedded default)")
    p.add_argument("--shapes", nargs="+", metavar="SHAPE",
                   help="WxH (an image at the config's default steps), WxHxF (a video of F frames), either with "
                        "_<steps>s (default: the config's default image size, and its default video size when "
                        "video jobs are on)")
    p.add_argument("--images", type=int, default=IMAGES,
                   help="items in the fixed prompt x seed set, at most %(default)s (default: %(default)s)")
    p.add_argument("--qps", type=float, help="also the devices this load needs at the measured end-to-end time")
    p.add_argument("--no-compile", action="store_true", help="evaluate eagerly even if the config compiles")
    p.add_argument("--determinism", action="store_true",
                   help="run the set twice in one deployment and once after a restart; report what differs")
    p.add_argument("--json", action="store_true", help="print JSON instead of markdown")


def config_and_shapes(args: argparse.Namespace) -> tuple[ServiceConfig, list[Shape]]:
    """The config and shapes the options name; ValueError (ConfigError) with the reason."""
    cfg = load(args.config)
    if getattr(args, "no_compile", False):
        cfg.compile.enabled = False
    if not 1 <= args.images <= IMAGES:
        raise ValueError(f"--images: {args.images} is not within 1..{IMAGES}")
    shapes = [parse_shape(s, cfg) for s in args.shapes] if args.shapes else default_shapes(cfg)
    return cfg, shapes


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def emit(report: dict[str, Any], as_json: bool, markdown: Any) -> None:
    print(json.dumps(json_safe(report), indent=2) if as_json else markdown(report))


def run(args: argparse.Namespace) -> int:
    try:
        cfg, shapes = config_and_shapes(args)
    except (ConfigError, ValueError) as e:
        print(f"stepwatch evaluate: {e}", file=sys.stderr)
        return 2
    say(f"evaluating {', '.join(s.label for s in shapes)} on {cfg.model or 'the practice model'} "
        f"({args.images} items per shape)")
    try:
        if args.determinism:
            from stepwatch.bench import determinism

            rep = determinism.determinism(cfg, shapes, args.images, progress=say)
            emit(rep, args.json, determinism.to_markdown)
            return 0 if rep["bit_exact"] else 1
        from stepwatch.bench import evaluate

        emit(evaluate.evaluate(cfg, shapes, args.images, args.qps, progress=say), args.json, evaluate.to_markdown)
    except RUN_ERRORS as e:
        return failed("evaluate", e)
    return 0


# What a run can fail with that is no bug here: the pipeline (an out-of-memory is a RuntimeError), a model
# directory that does not load, a restarted process that failed.
RUN_ERRORS = (RuntimeError, MemoryError, OSError, ValueError)


def failed(command: str, e: BaseException) -> int:
    """One line for the launch owner, no traceback (``-v`` logs one)."""
    import logging

    logging.getLogger("stepwatch.bench").debug("stepwatch %s failed", command, exc_info=e)
    print(f"stepwatch {command}: failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
          file=sys.stderr)
    return 1
