"""Recording drills and controls as triage scenarios: ``stepwatch drill NAMES --record DIR --suffix N``.

One command re-records the evaluation set on the current code.  Per stack, after calibration
and with the baseline traffic still running, three controls that ask triage something:

- ``control-<stack>-<suffix>``: steady traffic, nothing touched;
- ``control-knobs-<stack>-<suffix>``: the cache threshold and VAE tiling set to other values and
  restored, then steady traffic again (a knob set and restored is no change: triage must not
  blame one);
- ``control-restart-<stack>-<suffix>``: the service restarted under traffic, as a rollout does
  (counters from zero, a warm-up, the baselines published again);

then every drill, recorded as ``<drill>-<suffix>`` at the moment its alert fired, with what triage
said live.  Each scenario names the runbook revision it was recorded against (a digest of
runbooks/*.md and stepwatch/thresholds.yaml), so a case recorded before a runbook check changed
because of it can be told from one recorded after.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepwatch.fault_injection.stack import LocalStack
from stepwatch.runbooks.parse import runbooks_dir
from stepwatch.thresholds import load as load_thresholds
from stepwatch.thresholds import parse_duration
from stepwatch.triage.false_alarms import write_false_alarms
from stepwatch.triage.record import record_scenario

WINDOW_S = 420.0  # history per scenario: the steady baseline before a fault and the fault itself
BEFORE_S = 150.0  # of it, before a drill's injection
CONTROL_S = 60.0  # steady traffic before a control is recorded
StackKey = tuple[int, str, bool]  # (ranks, compile backend, the sidecar's stream probe on)


def revision() -> str:
    """A digest of the runbooks and the thresholds source: what triage's checks were when a case was recorded."""
    h = hashlib.sha256()
    th = load_thresholds()
    for p in [*sorted(runbooks_dir().glob("*.md")), Path(th.source)]:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def stack_name(key: StackKey) -> str:
    ranks, backend, stream_probe = key
    return f"{ranks}rank" + (f"-{backend}" if backend else "") + ("-stream" if stream_probe else "")


@dataclass
class Recording:
    """Where and under which suffix a campaign records; ``recorded`` lists the scenario directories."""

    out: Path
    suffix: str = "1"
    control_s: float = CONTROL_S
    recorded: list[Path] = field(default_factory=list)

    def _meta(self, stack: Any, how: str) -> dict[str, Any]:
        """``stack``: a LocalStack, or a FleetStack (its drills and control are read from central evaluator a)."""
        th = load_thresholds()
        return {"recorded": f"stepwatch drill --record (suffix {self.suffix}) on {stack.describe()}; {how}",
                "runbooks_revision": revision(), "profile": stack.profile,
                "scrape_interval_s": parse_duration(th.profiles[stack.profile].scrape_interval)}

    def save(self, stack: Any, name: str, start: float, end: float, meta: dict[str, Any]) -> Path:
        path = record_scenario(stack.prometheus_url, max(stack.started, start), end, self.out / name, meta)
        self.recorded.append(path)
        return path

    def control(self, stack: Any, progress: Callable[[str], None], name: str, description: str) -> Path:
        """``control_s`` more of steady traffic, then the last window of the stack as a control (no cause)."""
        time.sleep(self.control_s)
        return self.control_now(stack, progress, name, description,
                                f"{description}; {self.control_s:.0f}s of steady traffic")

    def control_now(self, stack: Any, progress: Callable[[str], None], name: str, description: str,
                    how: str, **extra: Any) -> Path:
        """The last window of the stack, up to now, as a control (no cause); ``extra``: more scenario fields."""
        end = time.time()
        path = self.save(stack, name, end - WINDOW_S, end, {
            "expected_cause": None, "kind": "control", "description": f"no fault: {description}",
            **extra, **self._meta(stack, how)})
        progress(f"recorded {path}")
        return path

    def quiet_drill(self, stack: Any, progress: Callable[[str], None], name: str, description: str,
                    silent: list[str], target: dict[str, str]) -> list[Path]:
        """A quiet drill (an ordinary operation) recorded as a control, and each alert it must not fire presented
        as firing on it for its ``target`` (triage/false_alarms.py): a question triage must answer with no cause."""
        path = self.control_now(stack, progress, f"{name}-{self.suffix}", description,
                                f"drill {name}, at the end of its watch", drill=name)
        written = write_false_alarms(path, self.out, silent, in_hand=True, prefer=target)
        self.recorded += written
        progress(f"recorded {', '.join(p.name for p in written)} (false alarms on it)")
        return [path, *written]

    def controls(self, stack: LocalStack, key: StackKey, progress: Callable[[str], None],
                 baselines: dict[str, Any]) -> None:
        """The stack's three controls (the caller keeps the baseline traffic running); ``baselines``: the
        calibrated ones, published again after the restart, as a rollout keeps its baseline file."""
        where = stack_name(key)
        self.control(stack, progress, f"control-{where}-{self.suffix}", "steady baseline traffic after calibration")
        before = stack.info()["knobs"]
        threshold = float(before.get("cache_threshold") or 0.5)
        stack.knobs(cache_threshold=threshold + 0.3, vae_tiling=False)
        time.sleep(2 * parse_duration(load_thresholds().profiles[stack.profile].scrape_interval))
        stack.knobs(cache_threshold=threshold, vae_tiling=bool(before.get("vae_tiling", True)))
        self.control(stack, progress, f"control-knobs-{where}-{self.suffix}",
                     "the cache threshold (+0.3) and VAE tiling (off) set for two scrapes and restored")
        progress("restarting the practice service (a control: a restart is no fault)")
        stack.restart_service()
        if baselines:
            stack.knobs(baselines={"shapes": baselines})
        self.control(stack, progress, f"control-restart-{where}-{self.suffix}",
                     "the service restarted under traffic (a rollout), warmed up, its baselines published again")

    def drill(self, stack: Any, name: str, cause: str, alert: str, injected_at: float,
              detected_at: float, end: float, live: dict[str, Any], description: str,
              fault: dict[str, Any], firing: list[dict[str, Any]]) -> Path:
        """One drill's window, evaluated when its alert fired, with triage's live verdict and the fault's values.

        ``firing``: what Prometheus' alerts API said was firing when the runner saw the alert (webhook format),
        so the scenario's notification is what fired then (empty: read back from ``ALERTS`` at that time).
        """
        return self.save(stack, f"{name}-{self.suffix}", injected_at - BEFORE_S, end, {
            **({"alerts": firing} if firing else {}),
            "expected_cause": cause, "kind": "drill", "description": description, "drill": name,
            "expected_alert": alert, "injected_at": round(injected_at, 3), "detected_at": detected_at,
            "time_to_detect_s": round(detected_at - injected_at, 1), "live": live, "fault": fault,
            **self._meta(stack, f"drill {name}, evaluated when {alert} fired (fault in place)")})
