"""The numbers the drills are judged by, read from the ``drill-criteria`` block of runbooks/drills.md.

The goal (the alert within 60 s of the fault), the seeds' bar, how long the runner
watches, and the ratios the drills' own checks compare against live in the page people
follow by hand, so the runner and the page cannot disagree.  A missing or malformed
key is an error naming the key.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from stepwatch.runbooks.parse import runbooks_dir
from stepwatch.thresholds import ThresholdsError, parse_duration

_BLOCK = re.compile(r"^```drill-criteria[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
DURATIONS = ("goal", "seeds_bar", "detect_deadline", "resolve_deadline", "quiet_deadline", "leftover_deadline",
             "steady", "calibration")
RATIOS = ("step_time_at_most", "p99_rises_above", "p50_stays_below", "rss_back_within")


class CriteriaError(ValueError):
    """The drill-criteria block is missing or malformed; the message names the file and the key."""


@dataclass(frozen=True)
class Criteria:
    goal_s: float
    seeds_bar_s: float
    detect_deadline_s: float
    resolve_deadline_s: float
    quiet_deadline_s: float
    leftover_deadline_s: float
    steady_s: float
    calibration_s: float
    step_time_at_most: float
    p99_rises_above: float
    p50_stays_below: float
    rss_back_within: float


def parse(text: str, where: str = "drills.md") -> Criteria:
    blocks = _BLOCK.findall(text)
    if len(blocks) != 1:
        raise CriteriaError(f"{where}: needs exactly one ```drill-criteria block, found {len(blocks)}")
    data = yaml.safe_load(blocks[0])
    if not isinstance(data, dict) or not isinstance(data.get("checks"), dict):
        raise CriteriaError(f"{where}: drill-criteria must be a mapping with a checks mapping")
    values = {f"{k}_s": _duration(data, k, where) for k in DURATIONS}
    values |= {k: _ratio(data["checks"], k, where) for k in RATIOS}
    return Criteria(**values)


def _duration(data: dict[str, Any], key: str, where: str) -> float:
    if key not in data:
        raise CriteriaError(f"{where}: drill-criteria.{key}: missing")
    try:
        return float(parse_duration(str(data[key]), f"{where}: drill-criteria.{key}"))
    except ThresholdsError as e:
        raise CriteriaError(str(e)) from None


def _ratio(checks: dict[str, Any], key: str, where: str) -> float:
    v = checks.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise CriteriaError(f"{where}: drill-criteria.checks.{key}: {v!r} is not a positive number")
    return float(v)


@functools.cache
def load(file: str | Path | None = None) -> Criteria:
    """The criteria of the packaged runbooks/drills.md (or of ``file``)."""
    p = Path(file) if file is not None else runbooks_dir() / "drills.md"
    return parse(p.read_text(), p.name)
