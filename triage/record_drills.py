"""Record triage scenarios from real runs of the practice service: the drills, and no-fault controls.

    python -m stepwatch.triage.record_drills --out triage/scenarios --suffix 1
    python -m stepwatch.triage.record_drills --out /tmp/sc --drills straggler --controls 0

Brings up a ``LocalStack`` (aot_eager compile backend: fast on CPU) per rank
count, calibrates per-shape baselines from steady traffic as ``stepwatch drill``
does, records each control (steady traffic, nothing injected, expected cause:
none), then runs each drill with the ``fault_injection`` runner.  When the drill's
alert fires, the runner calls triage; this script's hook triages live (the
verdict is kept in the scenario as ``live``) and records the last
``--window`` seconds of Prometheus as ``<drill>-<suffix>``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WINDOW_S = 420.0


def expected_cause(alertname: str) -> str:
    """The cause runbooks/drills.md says triage must name for a drill's alert."""
    from stepwatch.runbooks.parse import load_drills

    for d in load_drills():
        if alertname in d.alerts:
            return d.cause
    raise KeyError(f"no drill in runbooks/drills.md expects {alertname}")


def main(argv: list[str] | None = None) -> int:
    from stepwatch.fault_injection.stack import exit_on_sigterm

    with exit_on_sigterm():  # a SIGTERM still stops the stack and restores the fault (the finally blocks)
        return _main(argv)


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stepwatch.triage.record_drills", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="triage/scenarios", help="scenario directory (default: %(default)s)")
    p.add_argument("--drills", default="all", help="comma-separated drill names, or all (default)")
    p.add_argument("--controls", type=int, default=1, help="controls to record per stack before the drills")
    p.add_argument("--control-seconds", type=float, default=60.0, help="steady traffic before a control's end")
    p.add_argument("--suffix", default="1", help="scenario name suffix: <drill>-<suffix>")
    p.add_argument("--window", type=float, default=WINDOW_S, help="seconds of history per scenario")
    p.add_argument("--late", type=float, default=0.0,
                   help="also record <drill>-<suffix>-late this many seconds later, fault still in place "
                        "(companion alerts have fired by then)")
    p.add_argument("--workdir", default=None, help="stack work directory (default: a temporary one)")
    args = p.parse_args(argv)

    from stepwatch.alerts.thresholds import load, parse_duration
    from stepwatch.fault_injection.drills import ALL_DRILLS, DRILLS, DrillResult, Runner, calibrate_baselines
    from stepwatch.fault_injection.stack import LocalStack
    from stepwatch.triage.drill_hook import triage_for_drill
    from stepwatch.triage.record import record_scenario

    th = load()
    names = list(ALL_DRILLS) if args.drills == "all" else [n.strip() for n in args.drills.split(",") if n.strip()]
    out = Path(args.out)
    t0 = time.time()

    def progress(msg: str) -> None:
        print(f"[{time.time() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    by_ranks: dict[int, list[str]] = {}
    for n in names:
        by_ranks.setdefault(DRILLS[n].needs_ranks, []).append(n)
    if not by_ranks and args.controls:
        by_ranks[1] = []
    recorded: list[Path] = []
    tmp = tempfile.TemporaryDirectory(prefix="stepwatch-record-") if args.workdir is None else None
    root = Path(args.workdir or (tmp.name if tmp else "."))
    try:
        for ranks, group in sorted(by_ranks.items()):
            overrides: dict[str, Any] = {}
            if ranks > 1:  # as `stepwatch drill` runs the two-rank stack
                overrides = {"compile": {"enabled": False}, "warmup": ["256x256", "512x512"]}
            stack = LocalStack(root / f"stack-{ranks}rank-{args.suffix}", ranks=ranks, service_overrides=overrides,
                               compile_backend="aot_eager" if ranks == 1 else None, progress=progress)
            stack.start()
            scrape_s = parse_duration(th.profiles[stack.profile].scrape_interval)
            how = (f"stepwatch.triage.record_drills on a LocalStack ({ranks} rank(s), "
                   f"compile {'aot_eager' if ranks == 1 else 'off'}, drill profile), suffix {args.suffix}")
            try:
                with stack.traffic(concurrency=2):
                    time.sleep(70)
                    calibrate_baselines(stack, progress, th)
                    for k in range(args.controls):
                        time.sleep(args.control_seconds)
                        end = time.time()
                        name = f"control-{ranks}rank-{args.suffix}" + (f"{chr(97 + k)}" if args.controls > 1 else "")
                        path = record_scenario(stack.prometheus_url, max(stack.started, end - args.window), end,
                                               out / name, {
                            "expected_cause": None,
                            "description": "no fault: steady baseline traffic (512x512 and 256x256, 2 clients) "
                                           "after baseline calibration",
                            "recorded": how + f"; {args.control_seconds:.0f}s of steady traffic after calibration",
                            "kind": "control", "profile": stack.profile, "scrape_interval_s": scrape_s})
                        recorded.append(path)
                        progress(f"recorded {path}")

                def hook(st: Any, r: DrillResult, how: str = how, scrape_s: float = scrape_s) -> dict[str, Any] | None:
                    verdict = triage_for_drill(st, r)
                    end = time.time()
                    path = record_scenario(st.prometheus_url, max(st.started, end - args.window), end,
                                           out / f"{r.name}-{args.suffix}", {
                        "expected_cause": expected_cause(r.expected_alert),
                        "description": DRILLS[r.name].description,
                        "recorded": how + f"; drill {r.name} via fault_injection Runner, recorded when the runner "
                                          "called triage (expected alert firing, fault in place)",
                        "kind": "drill", "profile": st.profile, "scrape_interval_s": scrape_s, "drill": r.name,
                        "expected_alert": r.expected_alert,
                        "injected_at": round(r.injected_at, 3), "time_to_detect_s": r.time_to_detect_s,
                        "live": {"cause": (verdict or {}).get("cause"),
                                 "firing": (verdict or {}).get("firing", [])}})
                    recorded.append(path)
                    progress(f"recorded {path}; live triage: {(verdict or {}).get('cause')}")
                    if args.late > 0:
                        time.sleep(args.late)
                        late = triage_for_drill(st, r)
                        end = time.time()
                        if not (late or {}).get("incident"):  # a burst that ended, an event alert's window passed
                            progress(f"[{r.name}] {r.expected_alert} stopped firing: no late case")
                            return verdict
                        path = record_scenario(st.prometheus_url, max(st.started, end - args.window), end,
                                               out / f"{r.name}-{args.suffix}-late", {
                            "expected_cause": expected_cause(r.expected_alert),
                            "description": DRILLS[r.name].description + f" Recorded {args.late:.0f}s after the "
                                           "first triage, with the fault still in place.",
                            "recorded": how + f"; drill {r.name} via fault_injection Runner, recorded {args.late:.0f}s "
                                              "after the runner called triage (fault in place)",
                            "kind": "drill", "profile": st.profile, "scrape_interval_s": scrape_s, "drill": r.name,
                            "expected_alert": r.expected_alert, "injected_at": round(r.injected_at, 3),
                            "time_to_detect_s": r.time_to_detect_s,
                            "live": {"cause": (late or {}).get("cause"), "firing": (late or {}).get("firing", [])}})
                        recorded.append(path)
                        progress(f"recorded {path}; live triage: {(late or {}).get('cause')}")
                    return verdict

                runner = Runner(stack, th, progress, hook)
                for n in group:
                    r = runner.run(DRILLS[n](th))
                    progress(f"[{n}] passed={r.passed} triage={r.triage_cause} failures={r.failures}")
            finally:
                stack.stop()
    finally:
        if tmp is not None:
            tmp.cleanup()
    for pth in recorded:
        print(pth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
