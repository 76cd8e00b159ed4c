"""Load and validate the thresholds source (stepwatch/thresholds.yaml).

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
# Every alert name starts with this; the runbook file is the rest in kebab-case.
ALERT_PREFIX = "Stepwatch"
# The subsystems alerts belong to, in the order an on-call engineer reads them (what users see first,
# then the pipeline behind it, the output, and the monitoring itself): alert modules, board rows and
# the rule files all follow it.
SUBSYSTEMS = ("service", "pipeline", "quality", "monitoring")
# ${...} placeholders a summary or description may use (filled per profile by the generator).
TEXT_PLACEHOLDERS = ("threshold", "threshold_pct", "upper", "lower", "for", "window", "headroom")
_DURATION = re.compile(r"^(\d+)(ms|s|m|h)$")
_CAMEL = re.compile(r"^[A-Z][A-Za-z0-9]+$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")
_RESERVED_LABELS = ("alertname", "severity", "profile", "__name__")
_ALERT_KEYS = ("name", "severity", "threshold", "for", "for_reason", "window", "summary", "description", "panel",
               "labels")


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
    rate_window: str = "5m"  # the window rate-based alerts of this profile read
    group_wait: str = "30s"  # Alertmanager timings of this profile
    group_interval: str = "5m"
    repeat_interval: str = "4h"
    peer_timeout: str = "15s"  # an Alertmanager's wait per peer ahead of it before it notifies (--cluster.peer-timeout)


@dataclass(frozen=True)
class AlertSpec:
    key: str
    name: str
    severity: str
    threshold: float
    for_: dict[str, str]
    extra: dict[str, Any] = field(default_factory=dict)  # keys other parts own (e.g. missed_probes)
    summary: str = ""
    description: str = ""
    panel: str = ""  # title of the dashboard panel to open first
    labels: dict[str, str] = field(default_factory=dict)  # static routing labels
    window: dict[str, str] = field(default_factory=dict)  # per profile; only for event-counting alerts
    for_reason: str = ""

    def for_seconds(self, profile: str) -> float:
        return parse_duration(self.for_[profile], f"alerts.{self.key}.for.{profile}")

    @property
    def runbook_file(self) -> str:
        """``StepwatchRankSkew`` -> ``rank-skew.md`` (the file under runbooks/)."""
        return kebab(self.name.removeprefix(ALERT_PREFIX)) + ".md"

    @property
    def runbook_anchor(self) -> str:
        """The anchor of the runbook's title heading (``# StepwatchRankSkew``), as GitHub renders it."""
        return anchor(self.name)


CAPACITY_HEADROOM = 1.3  # the seeds' capacity formula: instances = QPS x GPU-seconds per request x 1.3


def capacity_headroom(spec: AlertSpec) -> float:
    """``headroom`` of an alert block (alerts.pool_capacity), the seeds' 1.3 when the block says none."""
    return float(spec.extra.get("headroom", CAPACITY_HEADROOM))


AGENT_JOB = "prometheus-agent"  # the central evaluators' scrape job of the fleet's node agents


def agent_job(th: Thresholds) -> str:
    """The job under which the central evaluators scrape the node agents (``alerts.node_silent.agent_job``)."""
    spec = th.alerts.get("node_silent")
    return str(spec.extra.get("agent_job", AGENT_JOB)) if spec is not None else AGENT_JOB


PROBE_JOB, BALANCER_JOB = "stepwatch-endpoint", "stepwatch-balancer"


def probe_job(th: Thresholds) -> str:
    """The job under which the central evaluators scrape the blackbox exporter (``alerts.endpoint_down``)."""
    spec = th.alerts.get("endpoint_down")
    return str(spec.extra.get("probe_job", PROBE_JOB)) if spec is not None else PROBE_JOB


def balancer_job(th: Thresholds) -> str:
    """The job under which a node agent scrapes the load balancer's exporter (``alerts.endpoint_down``)."""
    spec = th.alerts.get("endpoint_down")
    return str(spec.extra.get("balancer_job", BALANCER_JOB)) if spec is not None else BALANCER_JOB


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
    runbook_base_url: str = ""
    job_regex: str = "stepwatch.*"
    diagnosis: dict[str, float | str] = field(default_factory=dict)  # numbers only runbook checks use
    # A request of at most this many steps with one CFG branch is few-step (a distilled model's): ``few_step``
    few_step_max_steps: int = 4

    def alert(self, key: str) -> AlertSpec:
        try:
            return self.alerts[key]
        except KeyError:
            raise KeyError(f"alerts.{key}: no such alert in {self.source}") from None

    def runbook_url(self, key: str) -> str:
        a = self.alert(key)
        return f"{self.runbook_base_url}/{a.runbook_file}#{a.runbook_anchor}"

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
    """Validate a thresholds mapping (the parsed YAML); every error names the key at fault."""
    if not isinstance(data, dict):
        raise ThresholdsError(f"{source}: expected a mapping at the top level")
    profiles = _profiles(_need(data, "profiles", ""))
    quality = _quality(_need(data, "quality", ""))
    alerts = _alerts(_need(data, "alerts", ""))
    qd = alerts["quality_drop"]
    if qd.threshold != quality.alert_margin_db:
        raise ThresholdsError(f"alerts.quality_drop.threshold: {qd.threshold:g} differs from "
                              f"quality.alert_margin_db {quality.alert_margin_db:g}; they are one number")
    base = str(data.get("runbook_base_url", ""))
    if not re.match(r"^https?://\S+[^/]$", base):
        raise ThresholdsError(f"runbook_base_url: {base!r} is not an http(s) URL without a trailing slash")
    job_regex = str(data.get("job_regex", "stepwatch.*"))
    try:
        re.compile(job_regex)
    except re.error as e:
        raise ThresholdsError(f"job_regex: {job_regex!r} is not a regular expression ({e})") from None
    return Thresholds(profiles, quality, alerts, source, base, job_regex, _diagnosis(data.get("diagnosis") or {}),
                      _few_step(data.get("few_step")))


def _few_step(raw: Any) -> int:
    """``few_step.max_steps``: the most steps a few-step (distilled) request runs; absent: 4 (FLUX.1-schnell)."""
    if raw is None:
        return 4
    steps = _need(raw, "max_steps", "few_step")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 100:
        raise ThresholdsError(f"few_step.max_steps: {steps!r} is not a whole number of steps in 1..100")
    return steps


def _profiles(raw: Any) -> dict[str, Profile]:
    """Both profiles; a rate window shorter than 4 scrapes is refused (rate() would be noise)."""
    profiles: dict[str, Profile] = {}
    for name in PROFILES:
        p = _need(raw, name, "profiles")
        for k in ("scrape_interval", "evaluation_interval"):
            parse_duration(_need(p, k, f"profiles.{name}"), f"profiles.{name}.{k}")
        optional = {k: str(p[k]) for k in ("rate_window", "group_wait", "group_interval", "repeat_interval",
                                           "peer_timeout") if k in p}
        for k, v in optional.items():
            parse_duration(v, f"profiles.{name}.{k}")
        profiles[name] = Profile(name, str(p["scrape_interval"]), str(p["evaluation_interval"]), **optional)
        window = parse_duration(profiles[name].rate_window)
        if window < 4 * parse_duration(profiles[name].scrape_interval):
            raise ThresholdsError(f"profiles.{name}.rate_window: {profiles[name].rate_window} is shorter than "
                                  "4 scrape intervals; rate() would be noise")
        _check_notification_timing(profiles[name])
    return profiles


def _check_notification_timing(p: Profile) -> None:
    """Alertmanager's timings against each other and the evaluation interval, as an HA pair needs them.

    The second Alertmanager of a pair waits ``peer_timeout`` before it checks what its peer notified; a wait as
    long as ``group_interval`` makes its flushes overlap and send alert sets older than its peer's last
    notification (a "firing" after the "resolved", upstream alertmanager#4008).  A group flushed more often than
    alerts are evaluated only re-sends what it had; a repeat sooner than a flush never happens.  A flush that
    falls on the evaluation which sends a resolution races it: one Alertmanager flushes just before the
    resolution arrives, its peer just after, and the pair notifies firing, resolved, firing, resolved."""
    seconds = {k: parse_duration(getattr(p, k)) for k in ("evaluation_interval", "group_wait", "group_interval",
                                                          "repeat_interval", "peer_timeout")}
    evaluation = seconds["evaluation_interval"]
    if seconds["group_interval"] % evaluation:
        raise ThresholdsError(f"profiles.{p.name}.group_interval: {p.group_interval} is not a whole number of "
                              f"evaluation intervals ({p.evaluation_interval}): its flushes would drift onto the "
                              "evaluations that send the alerts")
    offset = seconds["group_wait"] % evaluation
    if not evaluation / 5 <= offset <= evaluation * 4 / 5:
        raise ThresholdsError(f"profiles.{p.name}.group_wait: {p.group_wait} puts a group's flushes {offset:g} s "
                              f"after the evaluations that send its alerts (every {p.evaluation_interval}); "
                              "keep it between 1/5 and 4/5 of an interval, or the pair notifies a resolution "
                              "twice")
    rules = [("peer_timeout", "group_interval", "shorter than"),
             ("evaluation_interval", "group_interval", "at most"),
             ("group_interval", "repeat_interval", "at most")]
    for short, long, relation in rules:
        ok = seconds[short] < seconds[long] if relation == "shorter than" else seconds[short] <= seconds[long]
        if not ok:
            raise ThresholdsError(f"profiles.{p.name}.{short}: {getattr(p, short)} must be {relation} "
                                  f"{long} ({getattr(p, long)})")


def _quality(q: Any) -> Quality:
    gates = {str(k): _num(v, f"quality.gates_db.{k}", 0, 100) for k, v in _need(q, "gates_db", "quality").items()}
    default_gate = _need(q, "default_gate", "quality")
    if default_gate not in gates:
        raise ThresholdsError(f"quality.default_gate: {default_gate!r} is not one of {sorted(gates)}")
    return Quality(
        gates_db=gates,
        default_gate=default_gate,
        alert_margin_db=_num(_need(q, "alert_margin_db", "quality"), "quality.alert_margin_db", 0, 50),
        ssim_gate={str(k): _num(v, f"quality.ssim_gate.{k}", 0, 1)
                   for k, v in _need(q, "ssim_gate", "quality").items()},
        video_psnr_gate_db=_num(_need(q, "video_psnr_gate_db", "quality"), "quality.video_psnr_gate_db", 0, 100),
        probe_budget_ratio=_num(_need(q, "probe_budget_ratio", "quality"), "quality.probe_budget_ratio", 0, 1),
    )


def _alerts(raw: Any) -> dict[str, AlertSpec]:
    """Every alert block, names and panels unique, the documented alerts all present."""
    if not isinstance(raw, dict):
        raise ThresholdsError("alerts: expected a mapping of alert key -> settings")
    alerts: dict[str, AlertSpec] = {}
    names: set[str] = set()
    panels: dict[str, str] = {}
    for key, a in raw.items():
        spec = _alert(str(key), a, names, panels)
        alerts[spec.key] = spec
    for required in REQUIRED_ALERTS:
        if required not in alerts:
            raise ThresholdsError(f"alerts.{required}: missing (one of the seven documented alerts)")
    return alerts


def _diagnosis(raw: Any) -> dict[str, float | str]:
    """Numbers, durations or label-value lists (a list becomes the regex ``a|b|c``) only the runbooks' checks use."""
    diagnosis: dict[str, float | str] = {}
    for k, v in raw.items():
        if isinstance(v, list):
            if not v or not all(isinstance(x, str) and re.fullmatch(r"[a-z_][a-z0-9_]*", x) for x in v):
                raise ThresholdsError(f"diagnosis.{k}: a list of label values (lower_case names), got {v!r}")
            diagnosis[str(k)] = "|".join(v)
        elif isinstance(v, str):
            parse_duration(v, f"diagnosis.{k}")
            diagnosis[str(k)] = v
        else:
            diagnosis[str(k)] = _num(v, f"diagnosis.{k}")
    return diagnosis


REQUIRED_ALERTS = ("step_time_regression", "cache_hit_rate_shift", "queue_wait", "memory_pressure",
                   "quality_drop", "recompile", "rank_skew")


def _text(a: dict[str, Any], k: str, where: str) -> str:
    v = _need(a, k, where)
    if not isinstance(v, str) or not v.strip():
        raise ThresholdsError(f"{where}.{k}: expected a non-empty string")
    for m in _PLACEHOLDER.finditer(v):
        if m.group(1) not in TEXT_PLACEHOLDERS:
            raise ThresholdsError(f"{where}.{k}: unknown placeholder ${{{m.group(1)}}}; "
                                  f"known: {', '.join(TEXT_PLACEHOLDERS)}")
    return " ".join(v.split())


def _per_profile(v: Any, where: str) -> dict[str, str]:
    if not isinstance(v, dict):
        raise ThresholdsError(f"{where}: expected {{production: ..., drill: ...}}")
    for prof in PROFILES:
        parse_duration(_need(v, prof, where), f"{where}.{prof}")
    return {p: str(v[p]) for p in PROFILES}


def _alert(key: str, a: Any, names: set[str], panels: dict[str, str]) -> AlertSpec:
    where = f"alerts.{key}"
    if not isinstance(a, dict):
        raise ThresholdsError(f"{where}: expected a mapping")
    name = str(_need(a, "name", where))
    if not _CAMEL.match(name):
        raise ThresholdsError(f"{where}.name: {name!r} is not CamelCase")
    if not name.startswith(ALERT_PREFIX) or name == ALERT_PREFIX:
        raise ThresholdsError(f"{where}.name: {name!r} must start with {ALERT_PREFIX!r}")
    if name in names:
        raise ThresholdsError(f"{where}.name: {name!r} used twice")
    names.add(name)
    sev = _need(a, "severity", where)
    if sev not in SEVERITIES:
        raise ThresholdsError(f"{where}.severity: {sev!r} is not one of {', '.join(SEVERITIES)}")
    for_ = _per_profile(_need(a, "for", where), f"{where}.for")
    window = _per_profile(a["window"], f"{where}.window") if "window" in a else {}
    summary = _text(a, "summary", where)
    if "{{" in summary:
        raise ThresholdsError(f"{where}.summary: must be static (no {{{{ }}}} templates)")
    if not summary.endswith("."):
        raise ThresholdsError(f"{where}.summary: one sentence ending with a full stop")
    description = _text(a, "description", where)
    panel = _text(a, "panel", where)
    if panel in panels:
        raise ThresholdsError(f"{where}.panel: {panel!r} is already the panel of alerts.{panels[panel]}")
    panels[panel] = key
    labels = a.get("labels") or {}
    if not isinstance(labels, dict):
        raise ThresholdsError(f"{where}.labels: expected a mapping")
    for lk, lv in labels.items():
        if not _LABEL.match(str(lk)) or lk in _RESERVED_LABELS:
            raise ThresholdsError(f"{where}.labels.{lk}: not a label name a rule may set")
        if not isinstance(lv, str):
            raise ThresholdsError(f"{where}.labels.{lk}: {lv!r} is not a string")
    subsystem = labels.get("subsystem")
    if subsystem not in SUBSYSTEMS:
        raise ThresholdsError(f"{where}.labels.subsystem: {subsystem!r} is not one of {', '.join(SUBSYSTEMS)}")
    for_reason = str(a.get("for_reason") or "")
    if not for_reason:
        raise ThresholdsError(f"{where}.for_reason: missing (say why the production for: is what it is)")
    extra = {k: v for k, v in a.items() if k not in _ALERT_KEYS}
    return AlertSpec(key, name, sev, _num(_need(a, "threshold", where), f"{where}.threshold", 0), for_, extra,
                     summary=summary, description=description, panel=panel,
                     labels={str(k): str(v) for k, v in labels.items()}, window=window, for_reason=for_reason)


def kebab(camel: str) -> str:
    """``QueueWaitHigh`` -> ``queue-wait-high``; ``GPUMemory`` -> ``gpu-memory``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "-", camel).lower()


def anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def default_path() -> Path:
    return Path(str(resources.files("stepwatch") / "thresholds.yaml"))


def load(path: str | Path | None = None) -> Thresholds:
    """The thresholds from ``path`` (default: the packaged stepwatch/thresholds.yaml)."""
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


def stall_floor(spec: AlertSpec, profile: str) -> float:
    """``alerts.worker_stalled.min_seconds`` of ``profile``: the stall limit never goes below it (the service
    reads it too).  Per profile because production must ride out a cold shape's first compile (minutes on a
    large model) while a drill must see a frozen worker within a minute."""
    raw = spec.extra.get("min_seconds", 300)
    value = raw.get(profile) if isinstance(raw, dict) else raw
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ThresholdsError(f"alerts.{spec.key}.min_seconds: {raw!r} must be seconds > 0, one number or one "
                              f"per profile ({{production: 300, drill: 20}}); {profile!r} has none")
    return float(value)
