"""``stepwatch bench exposition``: series, bytes and render time of one ``/metrics`` at fleet cardinality.

Service cases: 1, 16 and 50 allowlisted shapes, 1 and 8 ranks; sidecar: 8 GPUs and one probe set
(see ``stepwatch.bench.exposition`` for what each case holds).  The budget the service
must meet at 50 shapes x 8 ranks (docs/contracts.md): <= 3,000 series, <= 10 ms median render.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

BUDGET_SERIES = 3000
BUDGET_RENDER_MS = 10.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--renders", type=int, default=50, help="renders timed per case (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the results")


def _row(r: dict[str, Any]) -> None:
    where = f"{r['shapes']} shapes x {r['ranks']} ranks" if r["target"] == "service" else f"{r['gpus']} GPUs"
    print(f"{r['target']:<9}{where:<22}{r['series']:>8}{r['bytes']:>10}{r['render_ms_median']:>10.2f}"
          f"{r['render_ms_p99']:>9.2f}", flush=True)


def run(args: argparse.Namespace) -> int:
    if args.renders < 1:
        print("bench exposition: --renders must be at least 1", file=sys.stderr)
        return 2
    print("building the instrumented stub and the service's metrics per case...", file=sys.stderr)
    from stepwatch.bench import exposition as bench_exposition  # heavy: the stub, the service's config

    print(f"{'target':<9}{'case':<22}{'series':>8}{'bytes':>10}{'ms p50':>10}{'ms p99':>9}")
    cases = bench_exposition.run_all(renders=args.renders, progress=_row)
    worst = next(c for c in cases if c["target"] == "service" and c["shapes"] == 50 and c["ranks"] == 8)
    ok = worst["series"] <= BUDGET_SERIES and worst["render_ms_median"] <= BUDGET_RENDER_MS
    print(f"budget at 50 shapes x 8 ranks: <= {BUDGET_SERIES} series, <= {BUDGET_RENDER_MS:g} ms median: "
          f"{worst['series']} series, {worst['render_ms_median']:.2f} ms -> {'within' if ok else 'OVER'}")
    if args.json:
        print(json.dumps({"cases": cases}))
    return 0
