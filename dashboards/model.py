"""Read generated dashboard JSON: panels, their queries, variables, and the alerts they link to.

No SDK, so the lint, the live proof, the snapshot renderer and the drill reports read the
committed JSON the same way Grafana does, without grafana-foundation-sdk.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepwatch.thresholds import Thresholds

DATASOURCE_VAR = "datasource"
DATASOURCE_UID = "${" + DATASOURCE_VAR + "}"
# Variables the dashboards filter by; everything else in a query is literal PromQL.
FILTER_VARS = ("instance", "pool", "shape")
_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def package_dir() -> Path:
    return Path(__file__).resolve().parent


def load(path: str | Path) -> dict[str, Any]:
    return dict(json.loads(Path(path).read_text()))


def dashboard_files(directory: str | Path | None = None) -> list[Path]:
    return sorted(Path(directory or package_dir()).glob("*.json"))


def panels(dashboard: Mapping[str, Any], rows: bool = False) -> Iterator[dict[str, Any]]:
    """Every panel in layout order, including those inside collapsed rows; rows only if asked."""
    for p in dashboard.get("panels") or []:
        if p.get("type") == "row":
            if rows:
                yield p
            yield from (q for q in p.get("panels") or [])
        else:
            yield p


def panel(dashboard: Mapping[str, Any], title: str) -> dict[str, Any]:
    for p in panels(dashboard):
        if p.get("title") == title:
            return p
    known = "\n  ".join(sorted(str(p.get("title")) for p in panels(dashboard)))
    raise KeyError(f"no panel titled {title!r} in {dashboard.get('title')!r}; panels:\n  {known}")


@dataclass(frozen=True)
class Query:
    panel: str
    ref_id: str
    expr: str
    legend: str
    hidden: bool
    heatmap: bool


def queries(p: Mapping[str, Any]) -> list[Query]:
    return [Query(str(p.get("title", "")), str(t.get("refId", "")), str(t.get("expr", "")),
                  str(t.get("legendFormat", "")), bool(t.get("hide")), t.get("format") == "heatmap")
            for t in p.get("targets") or []]


def variables(dashboard: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list((dashboard.get("templating") or {}).get("list") or [])


def expand(expr: str, values: Mapping[str, str]) -> str:
    """Substitute ``$name`` / ``${name}`` as Grafana does; an unknown variable is an error."""
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"variable ${name} has no value (have: {', '.join(sorted(values))})")
        return values[name]

    return _VAR.sub(sub, expr)


def used_variables(expr: str) -> set[str]:
    return {m.group(1) or m.group(2) for m in _VAR.finditer(expr)}


def legend(fmt: str, labels: Mapping[str, str]) -> str:
    """Grafana's legendFormat: ``{{label}}`` replaced by the series' value, '' when absent."""
    if not fmt:
        inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
        return f"{labels.get('__name__', '')}{{{inner}}}"
    return " ".join(_LEGEND.sub(lambda m: labels.get(m.group(1), ""), fmt).split())


def runbook_links(p: Mapping[str, Any]) -> list[str]:
    return [str(link.get("url", "")) for link in p.get("links") or [] if link.get("url")]


def linked_alerts(p: Mapping[str, Any], th: Thresholds) -> list[str]:
    """Names of the alerts whose runbook the panel links to (thresholds decide what a runbook URL is)."""
    urls = set(runbook_links(p))
    return [spec.name for key, spec in th.alerts.items() if th.runbook_url(key) in urls]
