"""``stepwatch bench service``: what the HTTP service layer costs, against calling the pipeline in-process.

Starts ``stepwatch serve`` and measures throughput and p50/p99 latency at
several client counts, then the same requests on an in-process instrumented
pipeline (``bench.py``); and video jobs through ``/v1/videos`` against the in-process
video pipeline (time per job and per frame).
"""

from __future__ import annotations

import argparse
import json
import sys

from stepwatch.bench import service as bench
from stepwatch.service.config import ConfigError, parse_size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="512x512", help="image size WxH (default: %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="denoising steps (default: %(default)s)")
    p.add_argument("--requests", type=int, default=24, help="requests per concurrency level (default: %(default)s)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4], help="concurrency levels (default: 1 2 4)")
    p.add_argument("--video-jobs", type=int, default=6,
                   help="video jobs measured through /v1/videos and in-process, side by side (0: none; default: "
                        "%(default)s)")
    p.add_argument("--video-size", default="128x128", help="video job size WxH (default: %(default)s)")
    p.add_argument("--video-frames", type=int, default=9, help="frames per video job, 4k+1 (default: %(default)s)")
    p.add_argument("--video-steps", type=int, default=4, help="steps per video job (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the results")


def run(args: argparse.Namespace) -> int:
    try:
        parse_size(args.size)
    except ConfigError as e:
        raise SystemExit(f"bench service: bad --size {e}") from None
    video = None
    if args.video_jobs > 0:
        try:
            parse_size(args.video_size)
        except ConfigError as e:
            raise SystemExit(f"bench service: bad --video-size {e}") from None
        if args.video_frames < 5 or (args.video_frames - 1) % 4:
            raise SystemExit(f"bench service: --video-frames {args.video_frames} is not 4k+1 (5, 9, 13, ...)")
        video = bench.VideoBench(args.video_size, args.video_frames, args.video_steps, args.video_jobs)
    try:
        results = bench.bench(args.size, args.steps, args.requests, args.clients, video)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print(bench.table(results))
    if args.json:
        print(json.dumps(results))
    return 0
