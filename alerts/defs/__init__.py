"""Every alert as one object: the registry the rules, the promtool tests and triage read.

One module per subsystem (``labels.subsystem`` in stepwatch/thresholds.yaml) holds the
AlertDefs of its alerts; :data:`ALERTS` is all of them in the order of ``SUBSYSTEMS``.
Adding an alert = its block in thresholds.yaml, its AlertDef in the module of its
subsystem, its runbook and its panel (docs/adding-a-signal.md).
"""

from __future__ import annotations

from types import ModuleType

from stepwatch.alerts.defs import monitoring, pipeline, quality, service
from stepwatch.alerts.defs.base import AlertDef, Case, Expect, Series, Timing
from stepwatch.thresholds import SUBSYSTEMS, AlertSpec, Thresholds, ThresholdsError

__all__ = ["ALERTS", "MODULES", "SUBSYSTEM_OF", "AlertDef", "Case", "Expect", "Series", "Timing", "alert_def",
           "defined", "module_file", "problems", "refers_to", "validate"]

_BY_NAME = {m.SUBSYSTEM: m for m in (service, pipeline, quality, monitoring)}
MODULES: dict[str, ModuleType] = {sub: _BY_NAME[sub] for sub in SUBSYSTEMS}  # KeyError: a subsystem lacks its module
ALERTS: dict[str, AlertDef] = {d.key: d for m in MODULES.values() for d in m.ALERTS}
SUBSYSTEM_OF: dict[str, str] = {d.key: sub for sub, m in MODULES.items() for d in m.ALERTS}


def module_file(subsystem: str) -> str:
    """Where the AlertDefs of a subsystem live, as a person finds it in the repository."""
    return f"alerts/defs/{subsystem}.py"


def alert_def(spec: AlertSpec) -> AlertDef:
    """The AlertDef of an alert, or a ThresholdsError saying where to add it."""
    try:
        return ALERTS[spec.key]
    except KeyError:
        raise ThresholdsError(_no_def(spec)) from None


def _no_def(spec: AlertSpec) -> str:
    return (f"alerts.{spec.key}: no AlertDef; add one to {module_file(spec.labels.get('subsystem', ''))} "
            "(its expression, labels and promtool cases)")


def problems(th: Thresholds) -> list[str]:
    """Every mismatch between the thresholds' alerts and the AlertDefs, each naming the alert and the piece."""
    out = []
    for key, spec in th.alerts.items():
        sub = spec.labels.get("subsystem", "")
        if key not in ALERTS:
            out.append(_no_def(spec))
        elif SUBSYSTEM_OF[key] != sub:
            out.append(f"alerts.{key}.labels.subsystem: {sub!r}, but its AlertDef is in "
                       f"{module_file(SUBSYSTEM_OF[key])}; move it to {module_file(sub)} or fix the label")
    for key, sub in SUBSYSTEM_OF.items():
        if key not in th.alerts:
            out.append(f"{module_file(sub)}: AlertDef {key!r} has no block alerts.{key} in {th.source}")
    return out


def validate(th: Thresholds) -> None:
    """Raise a ThresholdsError naming every alert without its AlertDef (or the other way round)."""
    found = problems(th)
    if found:
        raise ThresholdsError("; ".join(found))


def defined(th: Thresholds) -> list[tuple[AlertSpec, AlertDef]]:
    """(spec, definition) of every alert, in the thresholds' order (the rule files' order); validated first."""
    validate(th)
    return [(spec, ALERTS[key]) for key, spec in th.alerts.items()]


def refers_to(th: Thresholds) -> dict[str, tuple[str, ...]]:
    """{runbook cause: names of the alerts whose incident absorbs it} (triage's grouping)."""
    out: dict[str, tuple[str, ...]] = {}
    for key, d in ALERTS.items():
        if key in th.alerts:
            for cause in d.explains:
                out[cause] = (*out.get(cause, ()), th.alerts[key].name)
    return out
