"""``stepwatch triage serve``: receive Alertmanager webhooks on /alerts, triage each notification, write reports.

Each notification's firing alerts are triaged against Prometheus (with the
other alerts firing on the same hosts as context, so that alerts sharing a
cause form one incident even when Alertmanager notifies them apart).  For
every notification the reports go to --out as <time>-<id>.txt / .md / .json
and latest.txt / .md / .json; with --forward the JSON report is POSTed there.
The webhook is answered at once; the report follows within a second or two.

Endpoints: POST /alerts (Alertmanager webhook, version 4), GET /healthz,
GET /latest (the latest JSON report), GET /openapi.json.  The receiver is
triage/receiver.py; this module parses the arguments and runs it.
"""

from __future__ import annotations

import argparse
import time

from stepwatch.triage.receiver import TriageServer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prometheus", required=True, metavar="URL", help="Prometheus base URL")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    p.add_argument("--port", type=int, default=9466, help="listen port (default: %(default)s)")
    p.add_argument("--out", default="triage-reports", help="report directory (default: %(default)s)")
    p.add_argument("--forward", metavar="URL", help="POST each JSON report to this URL")
    p.add_argument("--no-context", action="store_true",
                   help="triage only the notified alerts (no grouping with other firing alerts)")


def run(args: argparse.Namespace) -> int:
    try:
        server = TriageServer(args.prometheus, args.out, args.host, args.port, args.forward,
                              context=not args.no_context).start()
    except OSError as e:
        print(f"stepwatch triage serve: cannot listen on {args.host}:{args.port}: {e}")
        return 2
    print(f"stepwatch triage: webhook on {server.url}/alerts, Prometheus {args.prometheus}, reports in {args.out}",
          flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
