"""Load and validate the thresholds source (alerts/thresholds.yaml).

Everything downstream (rules, dashboards, runbooks, triage, drills) calls
``load()`` and reads values from the returned object, never from literals.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

PROFILES = ("production", "drill")
SEVERITIES = ("critical", "warning", "info")
_DURATION = re.compile(r"^(\d+)(ms|s|m|h)$")
_CAMEL = re.compile(r"^[A-Z][A-Za-z0-9]+$")


class ThresholdsError(ValueError):
    """A bad thresholds file; the message names the key and the reason."""


def parse_duration(text: str, key: str = "duration") -> float:
    """Prometheus duration ("30s", "5m", "0s") -> seconds."""
    m = _DURATION.match(str(text).strip())
    if not m:
        raise ThresholdsError(f"{key}: {text!r} is not a duration like 30s, 5m, 1h")
    n, unit = int(m.group(1)), m.group(2)
    return n * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]


@dataclass(frozen=True)
class Profile:
    name: str
    scrape_interval: str
    evaluation_interval: str


@dataclass(frozen=True)
class AlertSpec:
    key: str
    name: str
    severity: str
    threshold: float
    for_: dict[str, str]
    extra: dict[str, Any] = field(default_factory=dict)

    def for_seconds(self, profile: str) -> float:
        return parse_duration(self.for_[profile], f"alerts.{self.key}.for.{profile}")


@dataclass(frozen=True)
class Quality:
    gates_db: dict[str, float]
    default_gate: str
    alert_margin_db: float
    ssim_gate: dict[str, float]
    video_psnr_gate_db: float
    probe_budget_ratio: float

    def gate(self, kind: str | None = None) -> float:
        return self.gates_db[kind or self.default_gate]

    def alert_below(self, kind: str | None = None) -> float:
        return self.gate(kind) - self.alert_margin_db


@dataclass(frozen=True)
class Thresholds:
    profiles: dict[str, Profile]
    quality: Quality
    alerts: dict[str, AlertSpec]
    source: str

    def alert(self, key: str) -> AlertSpec:
        return self.alerts[key]

    def by_name(self, name: str) -> AlertSpec:
        for a in self.alerts.values():
            if a.name == name:
                return a
        raise KeyError(name)


def _need(d: Any, key: str, where: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise ThresholdsError(f"{where}.{key}: missing")
    return d[key]


def _num(v: Any, where: str, lo: float | None = None, hi: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ThresholdsError(f"{where}: {v!r} is not a number")
    if lo is not None and v < lo:
        raise ThresholdsError(f"{where}: {v} is below {lo}")
    if hi is not None and v > hi:
        raise ThresholdsError(f"{where}: {v} is above {hi}")
    return float(v)


def parse(data: Any, source: str = "<data>") -> Thresholds:
    if not isinstance(data, dict):
        raise ThresholdsError(f"{source}: expected a mapping at the top level")
    profiles: dict[str, Profile] = {}
    raw_profiles = _need(data, "profiles", "")
    for name in PROFILES:
        p = _need(raw_profiles, name, "profiles")
        for k in ("scrape_interval", "evaluation_interval"):
            parse_duration(_need(p, k, f"profiles.{name}"), f"profiles.{name}.{k}")
        profiles[name] = Profile(name, p["scrape_interval"], p["evaluation_interval"])
    q = _need(data, "quality", "")
    gates = {str(k): _num(v, f"quality.gates_db.{k}", 0, 100) for k, v in _need(q, "gates_db", "quality").items()}
    default_gate = _need(q, "default_gate", "quality")
    if default_gate not in gates:
        raise ThresholdsError(f"quality.default_gate: {default_gate!r} is not one of {sorted(gates)}")
    quality = Quality(
        gates_db=gates,
        default_gate=default_gate,
        alert_margin_db=_num(_need(q, "alert_margin_db", "quality"), "quality.alert_margin_db", 0, 50),
        ssim_gate={str(k): _num(v, f"quality.ssim_gate.{k}", 0, 1)
                   for k, v in _need(q, "ssim_gate", "quality").items()},
        video_psnr_gate_db=_num(_need(q, "video_psnr_gate_db", "quality"), "quality.video_psnr_gate_db", 0, 100),
        probe_budget_ratio=_num(_need(q, "probe_budget_ratio", "quality"), "quality.probe_budget_ratio", 0, 1),
    )
    alerts: dict[str, AlertSpec] = {}
    names: set[str] = set()
    for key, a in _need(data, "alerts", "").items():
        where = f"alerts.{key}"
        name = _need(a, "name", where)
        if not _CAMEL.match(str(name)):
            raise ThresholdsError(f"{where}.name: {name!r} is not CamelCase")
        if name in names:
            raise ThresholdsError(f"{where}.name: {name!r} used twice")
        names.add(name)
        sev = _need(a, "severity", where)
        if sev not in SEVERITIES:
            raise ThresholdsError(f"{where}.severity: {sev!r} is not one of {', '.join(SEVERITIES)}")
        for_ = _need(a, "for", where)
        for prof in PROFILES:
            parse_duration(_need(for_, prof, f"{where}.for"), f"{where}.for.{prof}")
        extra = {k: v for k, v in a.items() if k not in ("name", "severity", "threshold", "for")}
        alerts[key] = AlertSpec(key, name, sev, _num(_need(a, "threshold", where), f"{where}.threshold", 0),
                                {p: str(for_[p]) for p in PROFILES}, extra)
    for required in ("step_time_regression", "cache_hit_rate_shift", "queue_wait", "memory_pressure",
                     "quality_drop", "recompile", "rank_skew"):
        if required not in alerts:
            raise ThresholdsError(f"alerts.{required}: missing (one of the seven documented alerts)")
    return Thresholds(profiles, quality, alerts, source)


def default_path() -> Path:
    return Path(str(resources.files("stepwatch.alerts") / "thresholds.yaml"))


def load(path: str | Path | None = None) -> Thresholds:
    """The thresholds from ``path`` (default: the packaged alerts/thresholds.yaml)."""
    p = Path(path) if path is not None else default_path()
    try:
        text = p.read_text()
    except OSError as e:
        raise ThresholdsError(f"{p}: cannot read ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ThresholdsError(f"{p}: not valid YAML ({e})") from None
    return parse(data, str(p))
