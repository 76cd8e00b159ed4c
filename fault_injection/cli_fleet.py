"""``stepwatch fleet up``: the practice fleet on loopback until Ctrl-C.

N replicas (service + sidecar each, its own worker) behind haproxy (least outstanding requests, health checks
on /readyz), one Prometheus agent per node remote-writing to two central evaluators (the rules run on both),
a blackbox exporter probing the users' endpoint through the balancer (scraped by both evaluators), two
Alertmanagers clustered by gossip, a webhook receiver.  Prints every URL; send traffic to the balancer,
query either evaluator, read alerts on either Alertmanager.  Everything stops on Ctrl-C or SIGTERM.
See fault_injection/fleet.py for the wiring and alerts/fleet.py for the configs.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from stepwatch.fault_injection.fleet import FleetStack


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=3, help="practice replicas (default %(default)s)")
    p.add_argument("--nodes", type=int, default=2, help="nodes, one Prometheus agent each (default %(default)s)")
    p.add_argument("--workdir", help="configs, data and logs (default: a new temporary folder)")
    p.add_argument("--profile", default="drill", choices=("drill", "production"),
                   help="alert timings of the rules (default %(default)s)")


def _urls(f: FleetStack) -> list[str]:
    lines = [f"balancer      {f.balancer_url}   (haproxy stats: {f.balancer_metrics_url}/stats)"]
    lines += [f"{r.name:<13} {r.service_url}   sidecar {r.sidecar_url}   ({r.node})" for r in f.members]
    lines += [f"agent {n:<7} {u}" for n, u in enumerate(f.agents)]
    lines += [f"evaluator {n}   {u}" for n, u in zip("ab", f.evaluators, strict=False)]
    lines += [f"alertmanager  {u}" for u in f.alertmanagers]
    lines += [f"blackbox      {f.blackbox_url}   (probes {f.endpoint_url})"]
    return lines


def run(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="stepwatch-fleet-"))
    try:
        fleet = FleetStack(workdir, replicas=args.replicas, nodes=args.nodes, profile=args.profile,
                           progress=lambda m: print(m, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"stepwatch fleet up: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    try:
        fleet.start()
    except (RuntimeError, TimeoutError, FileNotFoundError) as e:
        print(f"stepwatch fleet up: the fleet did not come up: {e}\nlogs in {workdir}", file=sys.stderr)
        return 1
    try:
        print("\n".join(_urls(fleet)) + f"\nlogs and configs in {workdir}; Ctrl-C stops everything", flush=True)
        stop.wait()
    finally:
        fleet.stop()
    return 0
