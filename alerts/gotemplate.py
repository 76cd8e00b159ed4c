"""The small subset of Go templates that alert descriptions may use, rendered in Python.

Alertmanager renders descriptions with Go's text/template.  Keeping descriptions to
this subset lets the generator validate them and lets the promtool tests state the
exact annotation each firing alert must carry (promtool then proves Prometheus
renders the same string from the real ``$value``).

Supported actions: ``{{ $labels.NAME }}``, ``{{ $value | printf "%.Nf" }}``,
``{{ $value | humanizePercentage }}``, ``{{ if $labels.NAME }}`` ... ``{{ end }}``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

_ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.S)
_LABEL = re.compile(r"^\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)$")
_PRINTF = re.compile(r'^\$value\s*\|\s*printf\s+"%\.(\d)f"$')
_PCT = re.compile(r"^\$value\s*\|\s*humanizePercentage$")
_IF = re.compile(r"^if\s+\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)$")


class TemplateError(ValueError):
    """A description uses a construct outside the supported subset."""


def _go_float(v: float, text: str) -> str:
    """Go prints infinities and NaN as +Inf, -Inf, NaN where Python prints inf, nan."""
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return text


def render(template: str, labels: Mapping[str, str] | None = None, value: float = 0.0) -> str:
    """Render ``template`` as Prometheus would for an alert with these labels and value."""
    labels = labels or {}
    out: list[str] = []
    show: list[bool] = []
    pos = 0
    for m in _ACTION.finditer(template):
        if all(show):
            out.append(template[pos:m.start()])
        pos = m.end()
        action = m.group(1)
        if (lm := _LABEL.match(action)) is not None:
            if all(show):
                out.append(labels.get(lm.group(1), ""))
        elif (pm := _PRINTF.match(action)) is not None:
            if all(show):
                out.append(_go_float(value, f"{value:.{int(pm.group(1))}f}"))
        elif _PCT.match(action):
            if all(show):
                out.append(_go_float(value * 100, f"{value * 100:.4g}") + "%")
        elif (im := _IF.match(action)) is not None:
            show.append(bool(labels.get(im.group(1), "")))
        elif action == "end":
            if not show:
                raise TemplateError(f"{{{{ end }}}} without {{{{ if }}}} in {template!r}")
            show.pop()
        else:
            raise TemplateError(f"unsupported template action {{{{ {action} }}}} in {template!r}; "
                                "see stepwatch.alerts.gotemplate for the subset")
    if show:
        raise TemplateError(f"{{{{ if }}}} without {{{{ end }}}} in {template!r}")
    out.append(template[pos:])
    return "".join(out)


def labels_used(template: str) -> set[str]:
    """Label names a template reads (so the generator can check the alert carries them)."""
    names = set()
    for m in _ACTION.finditer(template):
        for rx in (_LABEL, _IF):
            if (lm := rx.match(m.group(1))) is not None:
                names.add(lm.group(1))
    return names
