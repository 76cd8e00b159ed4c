"""Capture the quality baseline: run the probe set once and store its images.

The images are stored with the service's deployment fingerprint (from
``GET /v1/stepwatch/info``) and sha256 checksums; the sidecar compares later
probes with them.  Rerun after every deployment change (image, libraries,
compile, parallel degree), since outputs are only reproducible within one.
A failed capture leaves the previous baseline untouched.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from stepwatch.exporter.sidecar.capture import (
    DEFAULT_OUT,
    DEFAULT_TIMEOUT_S,
    CaptureError,
    CaptureResult,
    capture_baseline,
)
from stepwatch.exporter.sidecar.config import ConfigError, SidecarConfig, check_target, load_config, load_probe_set
from stepwatch.thresholds import ThresholdsError, load


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="service base URL, e.g. http://127.0.0.1:8000 (or `target` in --config)")
    p.add_argument("--out", default=None, help=f"baseline root folder (default: the config's baseline_dir, "
                                              f"else ./{DEFAULT_OUT})")
    p.add_argument("--probe-set", default=None, help="probe set YAML (default: the config's, else the built-in "
                                                     "20 probes at 256x256 x 8 steps)")
    p.add_argument("--config", default=None, help="the sidecar's YAML config, for its target, probe set and "
                                                  "baseline_dir")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per request (default %(default)s)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the repeat of the first probe that checks the service is deterministic")


def _print_result(res: CaptureResult, ratio: float) -> None:
    gpu_s = res.cost_seconds * res.gpus
    interval = res.cost_seconds / ratio
    print(f"stored {res.probes} probes for fingerprint {res.fingerprint_id} (instance {res.instance_id}) in {res.path}")
    if res.repeat_psnr_db is not None:
        print(f"repeat of the first probe: PSNR {res.repeat_psnr_db:.1f} dB (deterministic)")
    print(f"probe set costs {gpu_s:.1f} GPU-s; at {ratio * 100:g}% budget the cadence is every {interval:.0f} s")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config) if args.config else SidecarConfig()
        target = check_target(args.target or cfg.target or "", "--target")
        probe_set = load_probe_set(args.probe_set) if args.probe_set else cfg.probe_set
        out = Path(args.out) if args.out else (cfg.baseline_dir if args.config else Path(DEFAULT_OUT))
        ratio = load(cfg.thresholds).quality.probe_budget_ratio
    except (ConfigError, ThresholdsError) as e:
        print(f"stepwatch baseline capture: {e}", file=sys.stderr)
        return 2
    print(f"capturing {len(probe_set.items)} probes of {probe_set.name!r} from {target} ...", file=sys.stderr)
    try:
        res = capture_baseline(target, probe_set, out, timeout_s=args.timeout, verify=not args.no_verify)
    except CaptureError as e:
        print(f"stepwatch baseline capture: {e}", file=sys.stderr)
        return 1
    _print_result(res, ratio)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    parser = argparse.ArgumentParser(prog="stepwatch baseline capture", description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
