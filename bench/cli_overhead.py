"""``stepwatch bench overhead``: what instrumentation costs, bare vs instrumented, side by side.

Two pipelines built from the same seed (bit-identical), one instrumented, run
interleaved in one process with the same seeds, alternating which goes first
so drift (thermal, caches, other load) hits both alike; every 8 rounds the
instrumentation moves to the other pipeline (a crossover: two objects built
alike differ by a few percent on a shared VM, and that difference cancels).  Per case it reports
the median per-step time of each variant (a step timed by the same
``callback_on_step_end`` in both), the overhead per step from paired
whole-request differences (each instrumented call against the bare call next
to it, so per-request bookkeeping counts too) and the ratio from the paired
instrumented/bare request times: trimmed means with block-bootstrap 95%
intervals, measured until the interval is within ``--precision`` (paired.py
says why; ``--calibrate`` shows the estimator reading an A/A as 1 and a known
1% cost as 1.01 on the same host).  The named cases are the smallest and a large shape, a distilled
model's few-step shape and FirstBlockCache with true CFG.  ``--hooks-only``
measures just the hooks' own cost on a stub pipeline with no compute (seconds):
per extra step (``hooks_per_step_us``) and once per request, per configuration.
The ``stream`` case is ``bench stream`` (per chunk of the causal FAR pipeline).
The ``two_ranks`` case runs two gloo ranks with the rank timing of today and of
before side by side (bench/ranks.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from typing import Any

from stepwatch.bench import overhead as bench
from stepwatch.bench.paired import BUDGET_S, PRECISION, StopRule

TWO_RANKS = "two_ranks"
STREAM = "stream"  # the chunked causal FAR pipeline, per chunk (bench/stream.py)
EXTRA_CASES = (TWO_RANKS, STREAM)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", nargs="+", default=[*bench.DEFAULT_CASES, *EXTRA_CASES], metavar="CASE",
                   help="real-pipeline cases: " + "; ".join(f"{k} = {c.shape}" + (f" with {c.cache}" if c.cache !=
                                                                                    "none" else "")
                                                            for k, c in bench.REAL_CASES.items())
                   + f"; or SIZExSTEPS for a plain square case; {TWO_RANKS} = two ranks, the rank timing now vs "
                   f"before vs bare; {STREAM} = the chunked video pipeline per chunk, as `bench stream` "
                   "(default: all named cases)")
    p.add_argument("--rounds", type=int, default=0,
                   help="a fixed number of interleaved rounds per case (default: adaptive, at least 160 up to "
                        "512^2, else 24, then on until the ratio's interval is within --precision)")
    p.add_argument("--precision", type=float, default=PRECISION,
                   help="stop a case once its ratio's 95%% interval is within this of the estimate on each side "
                        "(default: %(default)s, i.e. +-0.4%%)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S,
                   help="most seconds per case before it stops short of --precision (default: %(default)s)")
    p.add_argument("--calibrate", action="store_true",
                   help="also ask the estimator two known questions on the first case's pipelines: an A/A "
                        "(must read 1) and a 1%% busy-wait (must read about 1.01)")
    p.add_argument("--hooks-only", action="store_true",
                   help="only the stub pipeline's row: the hooks' own host cost, no model (quick)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the results")


def _print_case(r: dict[str, Any]) -> None:
    ci, rci = r["overhead_us_per_step_ci95"], r["ratio_ci95"]
    print(f"{r['name']:<10}{r['shape']:<18}{r['step_ms_bare']:>13.3f}{r['step_ms_instrumented']:>14.3f}"
          f"{r['overhead_us_per_step']:>9.1f}{f'[{ci[0]:.0f}, {ci[1]:.0f}]':>14}{r['ratio']:>8.4f}"
          f"{f'[{rci[0]:.4f}, {rci[1]:.4f}]':>20}")


def _run_cases(cases: list[tuple[str, bench.RealCase]], args: argparse.Namespace) -> list[dict[str, Any]]:
    pairs: dict[str, tuple[Any, Any]] = {}  # one pair of pipelines per cache kind
    results = []
    print(f"{'case':<10}{'shape':<18}{'step ms bare':>13}{'step ms instr':>14}{'us/step':>9}{'95% CI':>14}"
          f"{'ratio':>8}{'ratio 95% CI':>20}")
    for name, case in cases:
        if case.cache not in pairs:
            print(f"building two identical practice pipelines (seed 0, cache {case.cache})...", file=sys.stderr)
            pairs[case.cache] = bench.pipelines(case.cache)
        rule = _stop_rule(args, case)
        print(f"  running {name}: {case.shape}, {rule.min_rounds}-{rule.max_rounds} interleaved rounds (to +-"
              f"{rule.precision:.2%} or {rule.budget_s:.0f} s)...", file=sys.stderr)
        results.append({"name": name} | bench.run_case(pairs[case.cache], case, rule.max_rounds, rule))
        _print_case(results[-1])
    return results


def _stop_rule(args: argparse.Namespace, case: bench.RealCase) -> StopRule:
    """--rounds fixes the count; otherwise the case runs until its interval is narrow enough (paired.py)."""
    return StopRule.of(args.rounds, bench.default_rounds(case.size), args.precision, args.budget_s,
                       progress=lambda line: print(line, file=sys.stderr, flush=True))


def _calibration(args: argparse.Namespace, cases: list[tuple[str, bench.RealCase]]) -> dict[str, Any]:
    name, case = cases[0]
    print(f"  calibrating on {name} ({case.shape}): an A/A and a known 1% cost...", file=sys.stderr)
    r = bench.calibrate(bench.pipelines(case.cache), case, _stop_rule(args, case))
    for arm in ("aa", "known_1pct"):
        _print_case({"name": arm} | r[arm])
    arms = {arm: {k: r[arm][k] for k in ("ratio", "ratio_ci95", "rounds")} for arm in ("aa", "known_1pct")}
    return {"case": name, "known_cost": r["known_cost"]} | arms


def _two_ranks(rounds: int) -> dict[str, Any]:
    from stepwatch.bench import ranks as bench_ranks  # spawns two gloo ranks

    print(f"  running {TWO_RANKS}: two gloo ranks, bare / rank timing before / now, {rounds} rounds...",
          file=sys.stderr)
    r = bench_ranks.two_rank_case(rounds)
    ms = r["request_ms"]
    print(f"two ranks {r['shape']}: request ms bare {ms['bare']:.1f}, before {ms['before']:.1f}, now {ms['now']:.1f}; "
          f"now/before {r['ratio_now_to_before']:.4f} {r['ratio_now_to_before_ci95']}, "
          f"now/bare {r['ratio_now_to_bare']:.4f} {r['ratio_now_to_bare_ci95']}")
    ns = r["per_collective_ns"]
    print(f"rank timing per collective (a wrapped no-op wait): bare {ns['bare']:.0f} ns, before {ns['before']:.0f} ns, "
          f"now {ns['now']:.0f} ns")
    return r


def _stream(rounds: int, precision: float, budget_s: float) -> dict[str, Any] | None:
    """``bench stream``, in fresh processes pooled (its --processes).  In this one, after the FLUX cases, the
    FAR pipeline read 1.0158 [1.0100, 1.0214] and 1.0185 [1.0095, 1.0277] (2026-12-05), fresh processes
    0.994-1.012, and the hooks cost ~20 us per chunk timed directly: the FLUX runs leave the process in a
    state (heap, caches) that a streaming worker, which serves one pipeline, never has."""
    print(f"  running {STREAM}: the tiny causal FAR pipeline, {rounds or 'adaptive'} paired rounds (crossover), "
          "in a fresh process...", file=sys.stderr)
    cmd = [sys.executable, "-m", "stepwatch.cli", "bench", "stream", "--json", "--rounds", str(rounds),
           "--precision", str(precision), "--budget-s", str(budget_s)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        print(f"bench overhead: the stream case failed (exit {done.returncode})", file=sys.stderr)
        return None
    r: dict[str, Any] = json.loads(lines[-1])
    print(f"stream per chunk: bare {r['chunk_ms_bare']:.2f} ms, instrumented {r['chunk_ms_instrumented']:.2f} ms, "
          f"ratio {r['ratio']:.4f} {r['ci95']}; hooks {r['hooks_us_per_chunk']:.1f} us per chunk")
    return r


def _stub_cases() -> dict[str, dict[str, Any]]:
    """The stub rows per configuration: the hooks' cost per step (hot path, the slope over request
    length) apart from the fixed per-request cost, which a short request spreads over few steps."""
    out: dict[str, dict[str, Any]] = {}
    print(f"{'stub case':<10}{'steps':>6}{'branches':>9}{'cache':>19}{'us/step':>9}{'us/request fixed':>18}"
          f"{'us/request':>12}{'= us/step':>11}")
    for name in bench.STUB_CASES:
        r = out[name] = bench.stub_case(name)
        print(f"{name:<10}{r['steps']:>6}{r['branches']:>9}{r['cache']:>19}{r['per_step_us']:>9.2f}"
              f"{r['request_fixed_us']:>18.1f}{r['request_us']:>12.1f}{r['request_us_per_step']:>11.2f}")
    return out


def run(args: argparse.Namespace) -> int:
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    try:
        cases = [bench.parse_case(c) for c in args.cases if c not in EXTRA_CASES]
    except ValueError as e:
        print(f"bench overhead: {e}", file=sys.stderr)
        return 2
    if args.precision <= 0 or args.budget_s <= 0 or args.rounds < 0 or (args.rounds and args.rounds < 2):
        print("bench overhead: --precision and --budget-s must be positive, --rounds 0 (adaptive) or at least 2",
              file=sys.stderr)
        return 2
    results = [] if args.hooks_only else _run_cases(cases, args)
    calibration = _calibration(args, cases) if args.calibrate and cases and not args.hooks_only else None
    ranks = None if args.hooks_only or TWO_RANKS not in args.cases else _two_ranks(args.rounds or 40)
    stream = None if args.hooks_only or STREAM not in args.cases else _stream(args.rounds, args.precision,
                                                                                args.budget_s)
    print("measuring the hooks' own cost on a stub pipeline (no compute)...", file=sys.stderr)
    hooks = bench.hooks_cost()
    print(f"hooks alone (stub pipeline, 4 steps): {hooks['request_us']:.1f} us per request, "
          f"{hooks['per_step_us']:.1f} us per step")
    stub = _stub_cases()
    # Each transformer call is recorded (its batch: CFG branches from what the transformer receives), about
    # 0.6 us on this host; a real transformer call takes milliseconds, so it is budgeted per call.
    print("target: ratio <= 1.01; hooks <= 2 us per step plus 1 us per transformer call (FirstBlockCache and 2"
          " CFG branches: <= 4 us).  Wall-clock differences below the CI width are noise; the stub rows are the"
          " precise host cost.")
    if args.json:
        keys = ("name", "shape", "step_ms_bare", "step_ms_instrumented", "overhead_us_per_step", "ratio",
                "ratio_ci95")
        print(json.dumps({
            "cases": [{k: r[k] for k in keys} | {"ci95": r["overhead_us_per_step_ci95"], "rounds": r["rounds"]}
                      for r in results],
            "hooks_only": hooks,
            "hooks_per_step_us": {name: r["per_step_us"] for name, r in stub.items()},
            "stub_cases": stub,
            "two_ranks": ranks,
            "stream": stream,
            "calibration": calibration,
        }))
    return 0
