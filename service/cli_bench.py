"""``stepwatch bench service``: what the HTTP service layer costs, against calling the pipeline in-process.

Starts ``stepwatch serve`` and measures throughput and p50/p99 latency at
several client counts, then the same requests on an in-process instrumented
pipeline (``bench.py``).
"""

from __future__ import annotations

import argparse
import json
import sys

from stepwatch.service import bench
from stepwatch.service.config import ConfigError, parse_size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="512x512", help="image size WxH (default: %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="denoising steps (default: %(default)s)")
    p.add_argument("--requests", type=int, default=24, help="requests per concurrency level (default: %(default)s)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4], help="concurrency levels (default: 1 2 4)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the results")


def run(args: argparse.Namespace) -> int:
    try:
        parse_size(args.size)
    except ConfigError as e:
        raise SystemExit(f"bench service: bad --size {e}") from None
    try:
        results = bench.bench(args.size, args.steps, args.requests, args.clients)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print(bench.table(results))
    if args.json:
        print(json.dumps(results))
    return 0
