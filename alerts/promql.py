"""Read the series names out of a PromQL expression (no full parser: enough to check names).

Used by the tests, and by anything that wants to prove a query reads only series that
stepwatch emits.  Syntax errors are promtool's job (``promtool check rules``).
"""

from __future__ import annotations

import re

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_OFFSET = re.compile(r"\boffset\s+-?[0-9a-z]+")
_NUMBER = re.compile(r"(?<![A-Za-z_:0-9])(?:0x[0-9a-fA-F]+|[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
KEYWORDS = {"and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left", "group_right", "offset",
            "inf", "nan", "Inf", "NaN", "atan2"}


def metric_names(expr: str) -> set[str]:
    """Series names an expression selects (``foo{...}``, ``foo[5m]``, bare ``foo``)."""
    text = _STRING.sub('""', expr)
    text = _BRACES.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _OFFSET.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        word = m.group(0)
        rest = text[m.end():].lstrip()
        if word in KEYWORDS or rest.startswith("("):
            continue
        names.add(word)
    return names


_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^{}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")


def selector_labels(expr: str) -> dict[str, set[str]]:
    """{series name: label names its matchers use} for every ``name{...}`` selector."""
    out: dict[str, set[str]] = {}
    for m in _SELECTOR.finditer(_STRING.sub(lambda s: s.group(0).replace("{", "(").replace("}", ")"), expr)):
        out.setdefault(m.group(1), set()).update(_MATCHER.findall(_STRING.sub('""', m.group(2))))
    return out


def known_labels(name: str) -> set[str] | None:
    """Label names a series can carry (None: any, e.g. an info metric's free labels)."""
    from stepwatch.catalog import METRICS

    base = {"job", "instance"}
    if name == "up":
        return base
    if ":" in name:  # a recording rule: level:metric:operations, job always kept
        return {"job", *name.split(":", 1)[0].split("_")}
    for m in METRICS:
        if name in m.series_names():
            if m.kind == "info":
                return None
            return base | set(m.labels) | ({"le"} if name.endswith("_bucket") else set())
    return set()
