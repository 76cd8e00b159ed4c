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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepwatch.alerts.thresholds import Thresholds, load, parse_duration
from stepwatch.fault_injection.campaign import by_ranks, calibrate, make_stack
from stepwatch.fault_injection.drills import ALL_DRILLS, DRILLS, DrillResult, Runner
from stepwatch.fault_injection.stack import LocalStack, exit_on_sigterm
from stepwatch.runbooks.parse import load_drills
from stepwatch.triage.drill_hook import triage_for_drill
from stepwatch.triage.record import record_scenario

WINDOW_S = 420.0


def expected_cause(alertname: str) -> str:
    """The cause runbooks/drills.md says triage must name for a drill's alert."""
    for d in load_drills():
        if alertname in d.alerts:
            return d.cause
    raise KeyError(f"no drill in runbooks/drills.md expects {alertname}")


def _parser() -> argparse.ArgumentParser:
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
    return p


@dataclass
class Recorder:
    """Records the controls and drills of one stack after another; ``recorded`` lists the scenario paths."""

    args: argparse.Namespace
    th: Thresholds
    progress: Callable[[str], None]
    recorded: list[Path] = field(default_factory=list)
    how: str = ""  # how the current stack was run, for each scenario's "recorded"
    scrape_s: float = 0.0

    @property
    def out(self) -> Path:
        return Path(self.args.out)

    def _save(self, stack: LocalStack, name: str, meta: dict[str, Any]) -> Path:
        """The last ``--window`` seconds of the stack's Prometheus as scenario ``name``."""
        end = time.time()
        path = record_scenario(stack.prometheus_url, max(stack.started, end - self.args.window), end,
                               self.out / name, meta)
        self.recorded.append(path)
        return path

    def run_stack(self, root: Path, ranks: int, group: list[str]) -> None:
        a = self.args
        stack = make_stack(root / f"stack-{ranks}rank-{a.suffix}", ranks,
                           compile_backend="aot_eager" if ranks == 1 else None, progress=self.progress)
        stack.start()
        self.scrape_s = parse_duration(self.th.profiles[stack.profile].scrape_interval)
        self.how = (f"stepwatch.triage.record_drills on a LocalStack ({ranks} rank(s), "
                    f"compile {'aot_eager' if ranks == 1 else 'off'}, drill profile), suffix {a.suffix}")
        try:
            with stack.traffic(concurrency=2):
                calibrate(stack, self.th, self.progress)
                for k in range(a.controls):
                    self.control(stack, ranks, k)
            runner = Runner(stack, self.th, self.progress, self.hook)
            for n in group:
                r = runner.run(DRILLS[n](self.th))
                self.progress(f"[{n}] passed={r.passed} triage={r.triage_cause} failures={r.failures}")
        finally:
            stack.stop()

    def control(self, stack: LocalStack, ranks: int, k: int) -> None:
        """A no-fault scenario: ``--control-seconds`` more of steady traffic, expected cause none."""
        a = self.args
        time.sleep(a.control_seconds)
        name = f"control-{ranks}rank-{a.suffix}" + (f"{chr(97 + k)}" if a.controls > 1 else "")
        path = self._save(stack, name, {
            "expected_cause": None,
            "description": "no fault: steady baseline traffic (512x512 and 256x256, 2 clients) "
                           "after baseline calibration",
            "recorded": self.how + f"; {a.control_seconds:.0f}s of steady traffic after calibration",
            "kind": "control", "profile": stack.profile, "scrape_interval_s": self.scrape_s})
        self.progress(f"recorded {path}")

    def hook(self, st: LocalStack, r: DrillResult) -> dict[str, Any] | None:
        """The runner's triage step: triage live, record the scenario; with ``--late``, again later."""
        verdict = triage_for_drill(st, r)
        when = "when the runner called triage (expected alert firing, fault in place)"
        path = self._save(st, f"{r.name}-{self.args.suffix}",
                          self._drill_meta(st, r, verdict, DRILLS[r.name].description, when))
        self.progress(f"recorded {path}; live triage: {(verdict or {}).get('cause')}")
        if self.args.late > 0:
            self.late(st, r)
        return verdict

    def late(self, st: LocalStack, r: DrillResult) -> None:
        late_s = self.args.late
        time.sleep(late_s)
        verdict = triage_for_drill(st, r)
        if not (verdict or {}).get("incident"):  # a burst that ended, an event alert's window passed
            self.progress(f"[{r.name}] {r.expected_alert} stopped firing: no late case")
            return
        description = (DRILLS[r.name].description + f" Recorded {late_s:.0f}s after the first triage, with the "
                       "fault still in place.")
        when = f"{late_s:.0f}s after the runner called triage (fault in place)"
        path = self._save(st, f"{r.name}-{self.args.suffix}-late",
                          self._drill_meta(st, r, verdict, description, when))
        self.progress(f"recorded {path}; live triage: {(verdict or {}).get('cause')}")

    def _drill_meta(self, st: LocalStack, r: DrillResult, verdict: dict[str, Any] | None, description: str,
                    when: str) -> dict[str, Any]:
        return {"expected_cause": expected_cause(r.expected_alert), "description": description,
                "recorded": self.how + f"; drill {r.name} via fault_injection Runner, recorded {when}",
                "kind": "drill", "profile": st.profile, "scrape_interval_s": self.scrape_s, "drill": r.name,
                "expected_alert": r.expected_alert, "injected_at": round(r.injected_at, 3),
                "time_to_detect_s": r.time_to_detect_s,
                "live": {"cause": (verdict or {}).get("cause"), "firing": (verdict or {}).get("firing", [])}}


def main(argv: list[str] | None = None) -> int:
    with exit_on_sigterm():  # a SIGTERM still stops the stack and restores the fault (the finally blocks)
        return _main(argv)


def _main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    names = list(ALL_DRILLS) if args.drills == "all" else [n.strip() for n in args.drills.split(",") if n.strip()]
    t0 = time.time()

    def progress(msg: str) -> None:
        print(f"[{time.time() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    groups = by_ranks(names)
    if not groups and args.controls:
        groups[1] = []
    rec = Recorder(args, load(), progress)
    tmp = tempfile.TemporaryDirectory(prefix="stepwatch-record-") if args.workdir is None else None
    root = Path(args.workdir or (tmp.name if tmp else "."))
    try:
        for ranks, group in sorted(groups.items()):
            rec.run_stack(root, ranks, group)
    finally:
        if tmp is not None:
            tmp.cleanup()
    for pth in rec.recorded:
        print(pth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
