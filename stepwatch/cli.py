"""The one ``stepwatch`` command.  A subcommand's module is imported only when that command runs."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

# name -> (module, help).  A module provides add_arguments(parser) and run(args) -> int.
# Nested groups map a name to a dict of the same.
COMMANDS: dict[str, tuple[str, str] | dict[str, tuple[str, str]]] = {
    "demo": ("stepwatch.fault_injection.cli_demo", "run the main job on the embedded default and summarize"),
    "serve": ("stepwatch.service.cli_serve", "run the practice inference service (OpenAI-style image API)"),
    "sidecar": ("stepwatch.exporter.sidecar.cli_sidecar", "run the sidecar: NVML collector and quality prober"),
    "baseline": {
        "capture": ("stepwatch.exporter.sidecar.cli_capture", "store quality baseline images with the fingerprint"),
    },
    "rules": {
        "generate": ("stepwatch.alerts.cli_rules", "write Prometheus rules, PrometheusRule and stack configs"),
    },
    "dashboards": {
        "generate": ("stepwatch.dashboards.cli_dashboards", "write the Grafana dashboards JSON"),
    },
    "snapshot": ("stepwatch.dashboards.cli_snapshot", "render dashboard panels to PNG from Prometheus"),
    "drill": ("stepwatch.fault_injection.cli_drill", "run fault drills against the local stack"),
    "triage": {
        "run": ("stepwatch.triage.cli_run", "triage what is firing now"),
        "serve": ("stepwatch.triage.cli_serve", "receive Alertmanager webhooks and triage them"),
        "eval": ("stepwatch.triage.cli_eval", "score triage on recorded scenarios"),
        "false-alarms": ("stepwatch.triage.cli_false_alarms",
                         "write false-alarm controls: every alert presented on a quiet recording"),
        "in-hand": ("stepwatch.fault_injection.cli_in_hand",
                    "write a drill recording's other alerts (its block's also) as scenarios of their own"),
    },
    "bench": {
        "overhead": ("stepwatch.bench.cli_overhead", "instrumentation overhead per step, bare vs instrumented"),
        "service": ("stepwatch.bench.cli_service", "service throughput and latency vs the bare pipeline"),
        "exposition": ("stepwatch.bench.cli_exposition",
                       "series, bytes and render time of /metrics at fleet cardinality"),
        "stream": ("stepwatch.bench.stream",
                   "per-chunk cost of the hooks on chunked autoregressive video, bare vs instrumented"),
        "fleet": ("stepwatch.bench.fleet",
                  "a load test through the fleet's load balancer, side by side with direct requests"),
        "allocator": ("stepwatch.bench.allocator",
                      "an image's time under the worker's malloc settings vs glibc's, process pairs side by side"),
        "ledger": ("stepwatch.bench.ledger",
                   "the FLOPs ledger against torch's FlopCounterMode on eight diffusers families, CFG on and off"),
        "soak": ("stepwatch.bench.soak",
                 "mixed traffic on one practice service for N minutes: failures, memory growth, restarts"),
    },
    "fleet": {
        "up": ("stepwatch.fault_injection.cli_fleet",
               "the practice fleet: replicas behind haproxy, agents, HA evaluators, clustered Alertmanagers"),
    },
    "evaluate": ("stepwatch.bench.cli_evaluate",
                 "the pre-launch performance and quality report per shape, or --determinism"),
    "sweep": ("stepwatch.bench.cli_sweep",
              "a lossy option's speed-quality curve per shape, its working point, and --write-config"),
    "versions": ("stepwatch.versions",
                 "the signals that read other libraries' private state: installed and tested versions, on or off"),
    "gpu-check": ("stepwatch.bench.cli_gpu_check", "prove CUDA timing adds no synchronization (needs a GPU)"),
}

_TOP_HELP = """\
stepwatch: observability and incident triage for diffusion-model inference.

In-process hooks measure per-step time per shape, stage times, cross-step cache
hits, torch.compile recompiles, memory, OOMs and MFU; a sidecar reads the GPUs
and probes output quality; rules, dashboards, runbooks, a triage agent and
fault drills are generated from one thresholds source.
"""


class CommandMissing(Exception):
    pass


def _load(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            raise CommandMissing(module) from None
        raise


def _add(sub: argparse._SubParsersAction, name: str, spec: tuple[str, str], load: bool) -> None:
    module, help_text = spec
    if not load:
        sub.add_parser(name, help=help_text, description=help_text)
        return
    mod = _load(module)
    p = sub.add_parser(name, help=help_text, description=mod.__doc__ or help_text,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_arguments(p)
    p.set_defaults(_run=mod.run)


def _chosen(argv: Sequence[str]) -> tuple[str | None, str | None]:
    words = [a for a in argv if not a.startswith("-")]
    top = words[0] if words and words[0] in COMMANDS else None
    sub = words[1] if top and isinstance(COMMANDS[top], dict) and len(words) > 1 else None
    return top, sub


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser; only the module of the command named in ``argv`` is imported."""
    top, chosen_sub = _chosen(argv)
    parser = argparse.ArgumentParser(prog="stepwatch", description=_TOP_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, spec in COMMANDS.items():
        if isinstance(spec, dict):
            group = sub.add_parser(name, help=", ".join(f"{k}: {v[1]}" for k, v in spec.items()),
                                   description=f"stepwatch {name}")
            gsub = group.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
            for sname, sspec in spec.items():
                _add(gsub, sname, sspec, load=(name == top and sname == chosen_sub))
            group.set_defaults(_group=group)
        else:
            _add(sub, name, spec, load=(name == top))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(args_list)
    except CommandMissing as e:
        print(f"stepwatch: this command is not available in this installation ({e})", file=sys.stderr)
        return 2
    args = parser.parse_args(args_list)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # httpx logs every request at INFO: a service polling /metrics would flood its log
        logging.getLogger("httpx").setLevel(logging.WARNING)
    run = getattr(args, "_run", None)
    if run is None:
        group = getattr(args, "_group", None)
        (group or parser).print_help()
        return 2
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
