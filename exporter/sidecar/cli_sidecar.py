"""stepwatch sidecar: NVML GPU collector and sampled-quality prober, with its own /metrics.

Runs next to the inference container: reads the GPUs through NVML at scrape
time and probes output quality through the service's public API on a cadence
that stays within the probe budget.  It never imports torch; if NVML is absent
it reports ``stepwatch_nvml_up 0`` and keeps probing.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from prometheus_client import disable_created_metrics

from stepwatch.exporter.sidecar.config import (
    ConfigError,
    SidecarConfig,
    check_gate,
    check_target,
    load_config,
    load_probe_set,
    parse_config,
    positive,
)
from stepwatch.exporter.sidecar.main import DEFAULT_HOST, DEFAULT_PORT, serve
from stepwatch.thresholds import ThresholdsError, load

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "add_arguments", "resolve_config", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="the service's base URL, e.g. http://127.0.0.1:8000 (or `target` in --config)")
    p.add_argument("--config", help="YAML config: probe_set, baseline_dir, gate, interval_s, timeout_s, ...")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port of /metrics (default %(default)s; 0 = any)")
    p.add_argument("--host", default=DEFAULT_HOST, help="address of /metrics (default %(default)s; 0.0.0.0 in a pod)")
    p.add_argument("--baseline-dir", help="baseline root folder (default: the config's, else ./baselines)")
    p.add_argument("--probe-set", help="probe set YAML (default: the config's, else 20 probes at 256x256 x 8 steps)")
    p.add_argument("--stream-probe-set", metavar="FILE|default",
                   help="also probe streaming sessions for drift against their baseline session: a probe set YAML "
                        "whose items give chunks, or `default` (one 8-chunk session at 64x64); its baseline is "
                        "captured like the images' (stepwatch baseline capture --probe-set FILE)")
    p.add_argument("--gate", help="gate kind the probe set guards: a key of quality.gates_db or `video` "
                                  "(default: the probe set's, else quality.default_gate)")
    p.add_argument("--interval", type=float, help="seconds between probe runs (default: from the probe budget)")
    p.add_argument("--timeout", type=float, help="seconds per probe request (default: a few seconds beyond the "
                                                 "slowest probe seen)")
    p.add_argument("--thresholds", help="thresholds YAML (default: the packaged stepwatch/thresholds.yaml)")
    p.add_argument("--no-nvml", action="store_true", help="do not read GPUs")
    p.add_argument("--practice-gpus", metavar="FILE",
                   help="report stand-in GPUs from this JSON state file instead of NVML (the practice stack's "
                        "drills write it; no file: no GPU); see exporter/sidecar/practice_gpus.py")
    p.add_argument("--no-prober", action="store_true", help="do not probe quality (GPU metrics only)")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields the flags set (each checked, naming the flag)."""
    kw: dict[str, Any] = {}
    if args.target:
        kw["target"] = check_target(args.target, "--target")
    if args.baseline_dir:
        kw["baseline_dir"] = Path(args.baseline_dir)
    if args.probe_set:
        kw["probe_set"] = load_probe_set(args.probe_set)
    if args.stream_probe_set:
        kw["stream_probe_set"] = parse_config({"stream_probe_set": args.stream_probe_set}).stream_probe_set
    if args.gate:
        kw["gate"] = args.gate
    if args.interval is not None:
        kw["interval_s"] = positive(args.interval, "--interval")
    if args.timeout is not None:
        kw["timeout_s"] = positive(args.timeout, "--timeout")
    if args.thresholds:
        kw["thresholds"] = Path(args.thresholds)
    if args.no_nvml:
        kw["nvml"] = False
    if args.practice_gpus:
        kw["practice_gpus"] = Path(args.practice_gpus)
    if args.no_prober:
        kw["prober"] = False
    return kw


def resolve_config(args: argparse.Namespace) -> SidecarConfig:
    """The config file with the CLI flags applied; raises ConfigError naming the bad key."""
    cfg = load_config(args.config) if args.config else SidecarConfig()
    cfg = replace(cfg, **_overrides(args))
    if cfg.prober and not cfg.target:
        raise ConfigError("target: missing (give --target URL or `target:` in the config, or --no-prober)")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port: {args.port} is not a port")
    return cfg


def run(args: argparse.Namespace) -> int:
    try:
        cfg = resolve_config(args)
        thresholds = load(cfg.thresholds)
        gate = cfg.probe_set.gate_kind(cfg.gate) or thresholds.quality.default_gate
        check_gate(thresholds.quality, gate, "gate" if cfg.gate or not cfg.probe_set.gate else "probe_set.gate")
    except (ConfigError, ThresholdsError) as e:
        print(f"stepwatch sidecar: bad config: {e}", file=sys.stderr)
        return 2
    disable_created_metrics()  # no _created series: a third more series for a value no rule reads
    return serve(cfg, thresholds, args.host, args.port)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="stepwatch sidecar", description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
