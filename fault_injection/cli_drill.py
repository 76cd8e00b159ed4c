"""``stepwatch drill NAME|all``: fault drills on the local stack, with a report.

Brings up the practice service, the sidecar, Prometheus (drill-profile rules)
and Alertmanager (routing to a local webhook receiver) on loopback ports - or
attaches to a running stack given its URLs - sends baseline traffic, injects
each fault, measures the time to the alert firing in Prometheus and to the
webhook arriving, restores, and checks that the alert resolves.  Writes a
markdown and a JSON report (with dashboard panels as PNG); exits non-zero when
any drill fails.

Drills: cache-threshold, off-menu-resolution, vae-tiling-oom (the seeds'
three: ``seeds``), queue-overload, straggler, straggler-neighbour and worker-stall
(two ranks), the rival faults (``rivals``: another true cause behind an alert the
others fire: cache-off, straggler-step-time, compile-off, fingerprint-change, cache-threshold-raise,
cache-kind, prompt-mix-shift, compile-cache-dropped, shape-too-large, worker-killed, pipeline-errors,
worker-freeze, worker-freeze-backlog, cpu-contention, sidecar-killed, host-down, gpu-throttle; by name
only, slow on 2 CPU cores: shape-too-large, compile-off),
video-vae-untiled, cache-on-distilled and video-worker-killed (video jobs and the few-step video
model), stream-stall, stream-cpu-contention, kv-window-too-long, drift and window-drift (streaming sessions),
replica-lost, node-lost, agent-lost, alertmanager-peer-lost, central-store-outage, bad-instance,
replica-config-drift, rolling-update, pool-short and replica-gpu-throttle (``fleet``: on one start of the
practice fleet, ``stepwatch fleet up``), routine-restart, agent-paused and config-rollout (day-two
operations: a fleet replica restarted on its own configuration, which must page nobody; a node agent paused
for 90 s; a configuration rolled out by restart), or all.

``--record DIR`` re-records the triage evaluation set on the code as it is: run
``stepwatch drill all --record triage/scenarios --suffix N`` (and
``stepwatch triage false-alarms`` for the false-alarm controls).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from stepwatch.fault_injection.campaign import Campaign, expand
from stepwatch.fault_injection.drill_hook import triage_for_drill
from stepwatch.fault_injection.recording import Recording
from stepwatch.fault_injection.registry import ALL_DRILLS
from stepwatch.fault_injection.report import summary_table
from stepwatch.fault_injection.stack import StackUrls
from stepwatch.procs import exit_on_sigterm
from stepwatch.thresholds import load as load_thresholds


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("drills", nargs="+", metavar="NAME", help=f"{', '.join(ALL_DRILLS)}, seeds, rivals or all")
    p.add_argument("--out", default="reports", help="report directory (default: %(default)s/drill-<time>)")
    p.add_argument("--compile-backend", choices=("inductor", "aot_eager", "eager"), default=None,
                   help="torch.compile backend of the practice service (default: the service config's, inductor)")
    p.add_argument("--no-snapshots", action="store_true", help="skip the PNG panels in the report")
    p.add_argument("--no-triage", action="store_true", help="do not run the triage agent on each alert")
    p.add_argument("--json", action="store_true", help="end with one JSON line summarizing the drills")
    p.add_argument("--record", metavar="DIR",
                   help="record the triage evaluation set under DIR: per stack two controls (steady traffic; knobs "
                        "set and restored), then each drill when its alert fires, as <name>-<suffix>")
    p.add_argument("--suffix", default="1", help="with --record: the recording run's suffix (default: %(default)s)")
    p.add_argument("--variant", type=int, default=0,
                   help="run each fault with its k-th other values (the drill block's variants; default 0: as "
                        "written): recordings vary the values instead of reusing one")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run the list N times over on the same stacks (default 1): is a drill flaky here? The "
                        "summary has a row per run; each drill's panels are those of its last run")
    a = p.add_argument_group("attach to a running stack instead of starting one")
    a.add_argument("--service", help="practice service URL (its admin endpoint must be on)")
    a.add_argument("--prometheus", help="Prometheus URL (with stepwatch's drill rules loaded)")
    a.add_argument("--alertmanager", help="Alertmanager URL")
    a.add_argument("--admin-token", help="the service's admin token")


def _attach(args: argparse.Namespace) -> StackUrls | None:
    if not (args.service or args.prometheus):
        return None
    if not (args.service and args.prometheus):
        raise SystemExit("stepwatch drill: attaching needs both --service and --prometheus")
    return StackUrls(args.service, args.prometheus, args.alertmanager, admin_token=args.admin_token)


def run(args: argparse.Namespace) -> int:
    try:
        names = expand(args.drills)
    except ValueError as e:
        raise SystemExit(f"stepwatch drill: {e}") from None
    if args.repeat < 1:
        raise SystemExit("stepwatch drill: --repeat must be >= 1")
    if args.repeat > 1 and args.record:
        raise SystemExit("stepwatch drill: --record takes each drill once (a case per drill); leave out --repeat")
    names = names * args.repeat
    attach = _attach(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    t0 = time.time()
    out = Path(args.out) / time.strftime("drill-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)

    def progress(msg: str) -> None:
        print(f"[{time.time() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    campaign = Campaign(load_thresholds(), out, progress, triage=None if args.no_triage else triage_for_drill,
                        compile_backend=args.compile_backend, attach=attach,
                        record=Recording(Path(args.record), args.suffix) if args.record else None,
                        snapshots=not args.no_snapshots, variant=args.variant)
    with exit_on_sigterm():  # CI's SIGTERM still restores the fault and stops the stack (the finally blocks)
        report_path = campaign.run(names)
    print(summary_table(campaign.results, report_path))
    if campaign.record is not None:
        print("\n".join(str(p) for p in campaign.record.recorded))
    if args.json:
        print(json.dumps({"drills": [r.summary_json() for r in campaign.results]}))
    return 0 if all(r.passed for r in campaign.results) else 1
