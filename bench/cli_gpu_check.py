"""``stepwatch gpu-check``: prove on a real GPU that CUDA timing adds no synchronization.

Run on a machine with one CUDA GPU (under 5 minutes on an H100/H200).  It
builds a FLUX.1-dev-shaped pipeline (the full 57-block transformer, 11.9 B
parameters, random bf16 weights; small text encoders with the right output
widths; the FLUX VAE), instruments it, and:

1. runs every stepwatch hook body under ``torch.cuda.set_sync_debug_mode("error")``:
   any host-device synchronization inside stepwatch raises there, is caught
   by the hook guard and counted in ``stepwatch_exporter_errors_total`` - the
   check demands zero (and first proves the detector fires on a deliberate sync);
2. compares per-step times from the CUDA events with a separate run timed with
   explicit ``torch.cuda.synchronize()`` at every step;
3. prints per-step times and MFU at 1024^2 from the FLOPs ledger.

Exit 0 when all checks pass, 1 when one fails, 2 when there is no GPU.
``--device cpu --small`` runs the same code path on the CPU (no sync check),
which is how the script itself is tested without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from typing import Any

from stepwatch.bench import gpu_check
from stepwatch.exporter.report import RequestReport


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    p.add_argument("--size", type=int, default=1024, help="square image size (default: %(default)s)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps (default: %(default)s)")
    p.add_argument("--requests", type=int, default=3, help="instrumented requests (default: %(default)s)")
    p.add_argument("--small", action="store_true", help="the tiny practice pipeline instead of FLUX.1-dev's shape")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the results")


def _print(results: dict[str, Any], rep: RequestReport, size: int) -> None:
    timer = "CUDA events" if results["device"].startswith("cuda") else "host clock"
    print(f"\nper-step seconds ({timer}): {' '.join(f'{s:.4f}' for s in rep.step_seconds)}")
    print(f"per-step seconds (synchronized): {' '.join(f'{s:.4f}' for s in results['step_seconds_synchronized'])}")
    print("stages: " + ", ".join(f"{k} {v:.3f}s" for k, v in rep.stages.items()))
    if rep.step_flops:
        print(f"ledger: {rep.step_flops / 1e12:.1f} TFLOP per step (CFG branches: {rep.cfg_branches})")
    peak = results["peak_flops"]
    if results["mfu"] is not None and peak:
        print(f"MFU at {size}^2: {results['mfu']:.3f} (peak {peak / 1e12:.0f} TFLOP/s, eager bf16)")
    for k, ok in results["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {k}")
    if results["exporter_errors"]:
        print(f"exporter errors: {results['exporter_errors']}")


def run(args: argparse.Namespace) -> int:
    try:
        check = gpu_check.build(args.device, args.size, args.steps, args.small, log=partial(print, flush=True))
    except gpu_check.NoGpu as e:
        print(e)
        return 2
    results, rep = gpu_check.run_check(check, args.requests)
    if rep is None:
        print("no report was resolved")
        return 1
    _print(results, rep, args.size)
    if args.json:
        print(json.dumps(results, default=str))
    return 0 if all(results["checks"].values()) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
