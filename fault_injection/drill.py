"""``stepwatch drill NAME|all``: fault drills on the local stack, with a report.

Brings up the practice service, the sidecar, Prometheus (drill-profile rules)
and Alertmanager (routing to a local webhook receiver) on loopback ports - or
attaches to a running stack given its URLs - sends baseline traffic, injects
each fault, measures the time to the alert firing in Prometheus and to the
webhook arriving, restores, and checks that the alert resolves.  Writes a
markdown and a JSON report (with dashboard panels as PNG); exits non-zero when
any drill fails.

Drills: cache-threshold, off-menu-resolution, vae-tiling-oom (the seeds'
three), queue-overload, straggler (two ranks), or all.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from stepwatch.fault_injection.drills import ALL_DRILLS, DRILLS, SEED_DRILLS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("drills", nargs="+", metavar="NAME", help=f"{', '.join(ALL_DRILLS)}, seeds or all")
    p.add_argument("--out", default="reports", help="report directory (default: %(default)s/drill-<time>)")
    p.add_argument("--compile-backend", choices=("inductor", "aot_eager", "eager"), default=None,
                   help="torch.compile backend of the practice service (default: the service config's, inductor)")
    p.add_argument("--no-snapshots", action="store_true", help="skip the PNG panels in the report")
    p.add_argument("--no-triage", action="store_true", help="do not run the triage agent on each alert")
    p.add_argument("--json", action="store_true", help="end with one JSON line summarizing the drills")
    p.add_argument("--record", metavar="DIR", help="record each drill's window as a triage scenario under DIR")
    a = p.add_argument_group("attach to a running stack instead of starting one")
    a.add_argument("--service", help="practice service URL (its admin endpoint must be on)")
    a.add_argument("--prometheus", help="Prometheus URL (with stepwatch's drill rules loaded)")
    a.add_argument("--alertmanager", help="Alertmanager URL")
    a.add_argument("--admin-token", help="the service's admin token")


def _expand(names: list[str]) -> list[str]:
    out: list[str] = []
    for n in names:
        if n == "all":
            out += list(ALL_DRILLS)
        elif n == "seeds":
            out += list(SEED_DRILLS)
        elif n in DRILLS:
            out.append(n)
        else:
            raise SystemExit(f"stepwatch drill: unknown drill {n!r}; choose from {', '.join(ALL_DRILLS)}, seeds, all")
    return list(dict.fromkeys(out))


def run(args: argparse.Namespace) -> int:
    from stepwatch.fault_injection.stack import exit_on_sigterm

    with exit_on_sigterm():  # CI's SIGTERM still restores the fault and stops the stack (the finally blocks)
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    import logging

    from stepwatch.alerts.thresholds import load
    from stepwatch.fault_injection.drills import DrillResult, Runner, calibrate_baselines
    from stepwatch.fault_injection.report import write_report
    from stepwatch.fault_injection.stack import LocalStack, StackUrls

    logging.getLogger("httpx").setLevel(logging.WARNING)
    names = _expand(args.drills)
    th = load()
    t0 = time.time()
    out = Path(args.out) / time.strftime("drill-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)

    def progress(msg: str) -> None:
        print(f"[{time.time() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    triage = None
    if not args.no_triage:
        try:
            from stepwatch.triage.drill_hook import triage_for_drill

            triage = triage_for_drill
        except ImportError:
            triage = None
    results: list[DrillResult] = []
    by_ranks: dict[int, list[str]] = {}
    for n in names:
        by_ranks.setdefault(DRILLS[n].needs_ranks, []).append(n)
    attach = None
    if args.service or args.prometheus:
        if not (args.service and args.prometheus):
            raise SystemExit("stepwatch drill: attaching needs both --service and --prometheus")
        attach = StackUrls(args.service, args.prometheus, args.alertmanager, admin_token=args.admin_token)
    stacks_meta: list[dict[str, Any]] = []
    for ranks, group in sorted(by_ranks.items()):
        overrides: dict[str, Any] = {}
        if ranks > 1:
            overrides = {"compile": {"enabled": False}, "warmup": ["256x256", "512x512"]}
        stack = LocalStack(out / f"stack-{ranks}rank", ranks=ranks, service_overrides=overrides,
                           compile_backend=args.compile_backend, attach=attach, progress=progress)
        progress(f"bringing up the local stack ({ranks} rank{'s' if ranks > 1 else ''}) for {', '.join(group)}")
        try:
            stack.start()
        except Exception as e:
            progress(f"the stack did not come up: {e}")
            for n in group:
                d = DRILLS[n](th)
                r = DrillResult(n, d.expected, expected_cause=d.cause)
                r.failures.append(f"stack did not come up: {e}")
                r.service_survived = False
                results.append(r)
            continue
        try:
            runner = Runner(stack, th, progress, triage)
            if args.record:
                runner.record_dir = Path(args.record)
            progress("baseline traffic to calibrate per-shape baselines (step time, cache hit rate)")
            with stack.traffic(concurrency=2):
                time.sleep(70)
                calibrate_baselines(stack, progress, th)
            for n in group:
                results.append(runner.run(DRILLS[n](th)))
            stacks_meta.append({"ranks": ranks, "service": stack.service_url, "prometheus": stack.prometheus_url,
                                "alertmanager": stack.alertmanager_url, "workdir": str(stack.workdir)})
            report_path = write_report(out, results, th, stack=stack, snapshots=not args.no_snapshots,
                                       progress=progress, stacks=stacks_meta)
        finally:
            stack.stop()
    report_path = write_report(out, results, th, stack=None, snapshots=False, progress=progress, stacks=stacks_meta,
                               keep_snapshots=True)
    passed = all(r.passed for r in results)
    print()
    print(f"{'drill':<22}{'result':<8}{'detect s':>9}{'webhook s':>11}  expected alert")
    for r in results:
        d = f"{r.time_to_detect_s:.1f}" if r.time_to_detect_s is not None else "-"
        w = f"{r.time_to_webhook_s:.1f}" if r.time_to_webhook_s is not None else "-"
        print(f"{r.name:<22}{'PASS' if r.passed else 'FAIL':<8}{d:>9}{w:>11}  {r.expected_alert}"
              + (f"   <- {'; '.join(r.failures)}" if r.failures else ""))
    print(f"\nreport: {report_path}")
    if args.json:
        print(json.dumps({"drills": [r.summary_json() for r in results]}))
    return 0 if passed else 1
