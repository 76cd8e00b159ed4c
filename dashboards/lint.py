"""The dashboard-linter rules that apply to stepwatch's dashboards, on the generated JSON.

Rules (each problem names the panel and the rule):

- panel-title, panel-description, panel-units: every panel has them
- panel-datasource: the panel and each of its queries use the ``$datasource`` variable
- panel-targets: no panel without queries
- template-datasource: the dashboard has the datasource variable, and the instance/pool/shape ones
- target-rate-interval: every range selector (``[...]`` of rate/increase/...) and ``offset`` is
  ``$__rate_interval``
- target-counter-agg: counters (catalog kind counter, ``*_total``, histogram ``_bucket/_count/_sum``)
  appear only inside ``rate()``/``increase()``, or in the first-event idiom
  ``X unless last_over_time(X[$__rate_interval] offset $__rate_interval)`` (counters born at 1 on
  their first event; see
  ``stepwatch.alerts.promql.events``); rate/increase are applied to nothing else
- target-metric-known: every series a query names is in ``stepwatch/catalog.py``, a recording rule of
  ``alerts/rulegen.recorded_names``, or ``up`` / ``ALERTS``
- target-variables: a query uses only variables the dashboard defines (and ``$__rate_interval``)
- alert-panel: every alert's ``panel`` title exists, and links to that alert's runbook
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from stepwatch import catalog
from stepwatch.alerts.rulegen import recorded_names
from stepwatch.dashboards.model import (
    DATASOURCE_UID,
    DATASOURCE_VAR,
    FILTER_VARS,
    panels,
    queries,
    used_variables,
    variables,
)
from stepwatch.thresholds import Thresholds

GRAFANA_VARS = {"__rate_interval", "__interval", "__range"}
RANGE_FUNCS = {"rate", "increase"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_IDENT = re.compile(r"(?<![\w:.$])[A-Za-z_:][\w:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left", "group_right",
             "offset", "inf", "nan", "Inf", "NaN"}
# Aggregation operators may put their `by (...)` before the parentheses: `sum by (x) (...)`.
_AGGREGATIONS = {"sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk", "bottomk", "quantile",
                 "count_values"}
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(")
_RANGE = re.compile(r"\[([^\]]*)\]")
_OFFSET = re.compile(r"\boffset\s+(\S+?)(?=[\s)]|$)")
_BORN = re.compile(r"(?P<sel>[A-Za-z_:][\w:]*(?:\{[^{}]*\})?)\s+unless\s+last_over_time\((?P=sel)"
                   r"\[\$__rate_interval\]\s+offset\s+\$__rate_interval\)")


def _blank(text: str, start: int, end: int) -> str:
    return text[:start] + " " * (end - start) + text[end:]


def _skeleton(expr: str) -> str:
    """The expression with strings, label matchers and grouping label lists blanked, same length."""
    text = _STRING.sub(lambda m: '"' + " " * (len(m.group(0)) - 2) + '"', expr)
    out, depth = list(text), 0
    for i, ch in enumerate(text):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth:
            out[i] = " "
    text = "".join(out)
    for m in list(_GROUPING.finditer(text)):
        close = text.index(")", m.end())
        text = _blank(text, m.end(), close)
    return text


def metric_refs(expr: str) -> list[tuple[str, int]]:
    """(series name, position) of every series selector in a PromQL expression."""
    text = _skeleton(expr)
    text = _RANGE.sub(lambda m: "[" + " " * (len(m.group(0)) - 2) + "]", text)
    text = _OFFSET.sub(lambda m: "offset" + " " * (len(m.group(0)) - 6), text)
    refs = []
    for m in _IDENT.finditer(text):
        word = m.group(0)
        if word in _KEYWORDS or word in _AGGREGATIONS or text[m.end():].lstrip().startswith("("):
            continue
        refs.append((word, m.start()))
    return refs


def _enclosing_call(text: str, pos: int) -> str:
    """Name of the innermost function call whose parentheses contain ``pos`` ('' if none)."""
    depth = 0
    for i in range(pos - 1, -1, -1):
        ch = text[i]
        if ch == ")":
            depth += 1
        elif ch == "(":
            if depth == 0:
                m = re.search(r"([A-Za-z_]\w*)\s*$", text[:i])
                return m.group(1) if m else ""
            depth -= 1
    return ""


def is_counter(name: str, kinds: Mapping[str, str]) -> bool:
    if kinds.get(name) == "counter" or name.endswith("_total"):
        return True
    for suffix in ("_bucket", "_count", "_sum"):
        if name.endswith(suffix) and kinds.get(name[: -len(suffix)]) in ("histogram", "summary"):
            return True
    return False


def lint_expr(expr: str, known: set[str], kinds: Mapping[str, str], defined_vars: set[str]) -> list[str]:
    """Problems of one query expression (rule ids in brackets)."""
    problems: list[str] = []
    for m in _RANGE.finditer(_skeleton(expr)):
        if m.group(1).strip() != "$__rate_interval":
            problems.append(f"[target-rate-interval] range [{m.group(1)}] is not [$__rate_interval]")
    for m in _OFFSET.finditer(_skeleton(expr)):
        if m.group(1) != "$__rate_interval":
            problems.append(f"[target-rate-interval] offset {m.group(1)} is not $__rate_interval")
    for var in sorted(used_variables(expr) - defined_vars - GRAFANA_VARS):
        problems.append(f"[target-variables] ${var} is not a variable of the dashboard")
    # The first-event idiom is the one place a counter may appear bare; blank it out before the check.
    checked = _BORN.sub(lambda m: " " * len(m.group(0)), expr)
    skeleton = _skeleton(checked)
    for name, _ in metric_refs(expr):
        if name not in known:
            problems.append(f"[target-metric-known] {name} is neither in the catalog nor a recording rule")
    for name, pos in metric_refs(checked):
        call = _enclosing_call(skeleton, pos)
        counter = is_counter(name, kinds)
        if counter and call not in RANGE_FUNCS:
            problems.append(f"[target-counter-agg] counter {name} is used outside rate()/increase()"
                            + (f" (inside {call}())" if call else ""))
        if not counter and call in RANGE_FUNCS:
            problems.append(f"[target-counter-agg] {call}() of {name}, which is not a counter")
    return problems


def _known(th: Thresholds) -> tuple[set[str], dict[str, str]]:
    kinds: dict[str, str] = {m.name: m.kind for m in catalog.METRICS}
    return catalog.readable_names() | recorded_names(th), kinds


Check = Callable[[str], list[str]]


def lint(dashboard: Mapping[str, Any], th: Thresholds, all_alert_panels: bool = True) -> list[str]:
    """Every problem of one dashboard; empty when it passes.

    ``all_alert_panels``: require every alert's panel here (False when alerts spread over dashboards;
    use ``lint_alert_panels`` on the set).
    """
    known, kinds = _known(th)
    defined = {str(n) for n in (v.get("name") for v in variables(dashboard)) if n}

    def check(expr: str) -> list[str]:
        return lint_expr(expr, known, kinds, defined)

    problems = _template_problems(dashboard, check)
    titles: dict[str, int] = {}
    for p in panels(dashboard):
        title = str(p.get("title") or "")
        titles[title] = titles.get(title, 0) + 1
        problems += _panel_problems(p, check)
    problems += [f"[panel-title] title {t!r} is used by {n} panels" for t, n in titles.items() if n > 1]
    if all_alert_panels:
        problems += lint_alert_panels([dashboard], th)
    return problems


def _template_problems(dashboard: Mapping[str, Any], check: Check) -> list[str]:
    """The variables (datasource, filters, their queries) and the annotation queries."""
    problems: list[str] = []
    names = {v.get("name") for v in variables(dashboard)}
    ds_vars = [v for v in variables(dashboard) if v.get("name") == DATASOURCE_VAR]
    if not ds_vars or ds_vars[0].get("type") != "datasource" or ds_vars[0].get("query") != "prometheus":
        problems.append(f"[template-datasource] no ${DATASOURCE_VAR} variable of type datasource (prometheus)")
    problems += [f"[template-datasource] no ${var} variable" for var in FILTER_VARS if var not in names]
    for v in variables(dashboard):
        if v.get("type") != "query":
            continue
        q = v.get("query")
        expr = str(q.get("query", "") if isinstance(q, dict) else q or "")
        m = re.match(r"^label_values\((.*),\s*\w+\)$", expr)
        if m is None:
            problems.append(f"variable {v.get('name')}: query {expr!r} is not label_values(selector, label)")
        else:
            problems += [f"variable {v.get('name')}: {p}" for p in check(m.group(1))]
        if (v.get("datasource") or {}).get("uid") != DATASOURCE_UID:
            problems.append(f"[panel-datasource] variable {v.get('name')} does not use ${DATASOURCE_VAR}")
    for a in (dashboard.get("annotations") or {}).get("list") or []:
        if a.get("expr"):
            problems += [f"annotation {a.get('name')}: {p}" for p in check(a["expr"])]
    return problems


def _panel_problems(p: Mapping[str, Any], check: Check) -> list[str]:
    """One panel: title, description, unit, datasource, and each of its queries."""
    title = str(p.get("title") or "")
    where = f"panel {title or p.get('id')!r}"
    problems: list[str] = []
    if not title.strip():
        problems.append(f"[panel-title] {where} has no title")
    if not str(p.get("description") or "").strip():
        problems.append(f"[panel-description] {where} has no description")
    if not str(((p.get("fieldConfig") or {}).get("defaults") or {}).get("unit") or "").strip():
        problems.append(f"[panel-units] {where} has no unit")
    if (p.get("datasource") or {}).get("uid") != DATASOURCE_UID:
        problems.append(f"[panel-datasource] {where} does not use ${DATASOURCE_VAR}")
    targets = p.get("targets") or []
    if not targets:
        problems.append(f"[panel-targets] {where} has no queries")
    for t in targets:
        if (t.get("datasource") or {}).get("uid") != DATASOURCE_UID:
            problems.append(f"[panel-datasource] {where} query {t.get('refId')} does not use ${DATASOURCE_VAR}")
    for q in queries(p):
        if not q.expr.strip():
            problems.append(f"[panel-targets] {where} query {q.ref_id} is empty")
        problems += [f"{where} query {q.ref_id}: {e}" for e in check(q.expr)]
    return problems


def lint_alert_panels(dashboards: Iterable[Mapping[str, Any]], th: Thresholds) -> list[str]:
    """Every alert's "open this panel first" resolves to exactly one panel that links its runbook."""
    problems = []
    found: dict[str, list[dict[str, Any]]] = {}
    for d in dashboards:
        for p in panels(d):
            found.setdefault(str(p.get("title")), []).append(p)
    for key, spec in th.alerts.items():
        hits = found.get(spec.panel, [])
        if len(hits) != 1:
            problems.append(f"[alert-panel] alert {spec.name}: panel {spec.panel!r} found {len(hits)} times")
            continue
        urls = {str(link.get("url")) for link in hits[0].get("links") or []}
        if th.runbook_url(key) not in urls:
            problems.append(f"[alert-panel] panel {spec.panel!r} does not link {spec.name}'s runbook "
                            f"{th.runbook_url(key)}")
    return problems
