"""The one ``stepwatch`` command.  Subcommands import their heavy parts only when run."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# name -> (module, help).  A module provides add_arguments(parser) and run(args) -> int.
# Nested groups map a name to a dict of the same.
COMMANDS: dict[str, tuple[str, str] | dict[str, tuple[str, str]]] = {
    "demo": ("stepwatch.service.demo", "run the practice pipeline at two shapes, serve /metrics, summarize"),
    "bench": {
        "overhead": ("stepwatch.exporter.bench", "instrumentation overhead per step, bare vs instrumented"),
    },
}

_TOP_HELP = """\
stepwatch: observability and incident triage for diffusion-model inference.

In-process hooks measure per-step time per shape, stage times, cross-step cache
hits, torch.compile recompiles, memory, OOMs and MFU; a sidecar reads the GPUs
and probes output quality; rules, dashboards, runbooks, a triage agent and
fault drills are generated from one thresholds source.
"""


def _add(sub: argparse._SubParsersAction, name: str, spec: tuple[str, str]) -> None:
    module, help_text = spec
    p = sub.add_parser(name, help=help_text, description=(importlib.import_module(module).__doc__ or help_text),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    mod = importlib.import_module(module)
    mod.add_arguments(p)
    p.set_defaults(_run=mod.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepwatch", description=_TOP_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, spec in COMMANDS.items():
        if isinstance(spec, dict):
            group = sub.add_parser(name, help=f"{name}: " + ", ".join(spec), description=f"stepwatch {name}")
            gsub = group.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
            for sname, sspec in spec.items():
                _add(gsub, sname, sspec)
            group.set_defaults(_group=group)
        else:
            _add(sub, name, spec)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
