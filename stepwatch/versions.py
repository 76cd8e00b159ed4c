"""The version gate: each signal that reads another library's private state, and the versions it was tested on.

Like OpenTelemetry's instrumentations (``_instruments``), a signal that depends on a library's internals runs
only on the versions the suite ran it against: on any other, that one signal is off, with one logged warning
and one count in ``stepwatch_exporter_errors_total{component="version.<signal>"}`` (the StepwatchExporterErrors
ticket), instead of misreading state whose meaning may have changed.  Everything else keeps working.

The ranges are half-open, ``[lowest, below)``: the declared minimum of ``pyproject.toml`` up to the next minor
release after the newest version tested.  Raising ``below`` is a release decision: run the suite on the new
version first.  Versions are read from the installed distributions' metadata, so nothing is imported here.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

log = logging.getLogger("stepwatch.versions")


@dataclass(frozen=True)
class Gate:
    """One signal, the distribution whose private state it reads, what it reads, and the tested range."""

    signal: str
    distribution: str
    reads: str
    lowest: str
    below: str


GATES: Mapping[str, Gate] = {g.signal: g for g in (
    Gate("cache_decisions", "diffusers", "cache hooks' state_manager._state_cache (hit or miss per branch)",
         "0.36", "0.43"),
    Gate("compiled_call", "torch", "a module's _compiled_call_impl (the call record on a module compiled in place)",
         "2.5", "2.14"),
    Gate("batched_observe", "prometheus-client", "Histogram._upper_bounds/_buckets/_sum (one increment per bucket)",
         "0.20", "0.27"),
    Gate("stall_timeout", "uvicorn", "H11Protocol's conn, timeout_keep_alive_task (closing stalled request heads)",
         "0.29", "0.56"),
)}


def parse(version: str) -> tuple[int, ...]:
    """The release numbers of a version string ("2.13.0+cpu" -> (2, 13, 0); "0.43.0.dev0" -> (0, 43, 0))."""
    numbers = []
    for part in version.split("."):
        m = re.match(r"\d+", part)
        if m is None:
            break
        numbers.append(int(m.group()))
        if m.end() < len(part):
            break
    return tuple(numbers)


def installed(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def in_range(version: str, gate: Gate) -> bool:
    v = parse(version)
    return parse(gate.lowest) <= v < parse(gate.below)


def _checked(signal: str, warn: bool = True) -> tuple[bool, str]:
    """(on?, why) for a signal; a signal turned off is logged as a warning (once per handle that asks)."""
    gate = GATES[signal]
    version = installed(gate.distribution)
    if version is None:
        return False, f"{gate.distribution} is not installed"
    if in_range(version, gate):
        return True, ""
    why = (f"{gate.distribution} {version} is outside the tested range [{gate.lowest}, {gate.below}): the "
           f"{signal} signal, which reads {gate.reads}, is off")
    if warn:
        log.warning("stepwatch: %s", why)
    return False, why


def enabled(signal: str, count: Callable[[str], None] | None = None) -> bool:
    """True when ``signal`` may read private state on the installed version; else False, and ``count`` (a
    handle's error counter) is called with ``version.<signal>``."""
    on, _ = _checked(signal)
    if not on and count is not None:
        count(f"version.{signal}")
    return on


def report() -> list[dict[str, str | bool | None]]:
    """Every gate with the installed version and whether its signal is on (``stepwatch versions``)."""
    rows: list[dict[str, str | bool | None]] = []
    for gate in GATES.values():
        on, why = _checked(gate.signal, warn=False)
        rows.append({"signal": gate.signal, "distribution": gate.distribution,
                     "installed": installed(gate.distribution), "tested": f">={gate.lowest},<{gate.below}",
                     "on": on, "why": why or None})
    return rows


def add_arguments(p: Any) -> None:
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table")


def run(args: Any) -> int:
    """``stepwatch versions``: each gated signal, the installed version, the tested range, on or off."""
    rows = report()
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'signal':<17}{'package':<19}{'installed':<14}{'tested':<16}state")
    for r in rows:
        print(f"{r['signal']!s:<17}{r['distribution']!s:<19}{r['installed'] or '-'!s:<14}{r['tested']!s:<16}"
              f"{'on' if r['on'] else 'OFF: ' + str(r['why'])}")
    return 0
