"""Read the runbooks into structured checks a triage agent can run against Prometheus.

The format is documented at the top of runbooks/README.md.  In short: one markdown file
per alert, titled with the alert name; sections Meaning, Impact, Diagnosis, Mitigation,
Dashboard; every numbered item under Diagnosis carries one fenced ``check`` block::

    1. **Is one rank slower than the others?** Prose for people ...

       ```check
       id: rank_skew
       query: |
         max(instance_rank:stepwatch_rank_step_duration_seconds:ratio_to_fastest{instance="{{ $labels.instance }}"}) - 1
       healthy: <= ${threshold.rank_skew}
       if_unhealthy: straggler_rank
       if_healthy: next
       empty: unknown
       ```

People and the agent read the same text.  Usage::

    rb = load_for_alert("StepwatchRankSkew")
    for check in rb.checks:
        promql = check.render(alert_labels, profile="production")
        ...  # run it; outcome = check.judge(values)
    cause, trail = follow(rb, lambda check: outcome_of(check))
"""

from __future__ import annotations

import functools
import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from stepwatch import causes
from stepwatch.thresholds import Thresholds, anchor
from stepwatch.thresholds import load as load_thresholds

# Causes whose one incident spans more than one place (triage groups by it; any other cause: one pod or host).
CAUSE_SCOPE: dict[str, str] = {"under_provisioned": "pool", "node_down": "node", "agent_down": "node"}

SECTIONS = ("Meaning", "Impact", "Diagnosis", "Mitigation", "Dashboard")
NEXT, END = "next", "end"
Outcome = Literal["healthy", "unhealthy", "unknown"]
EMPTY = ("healthy", "unhealthy", "unknown")
CHECK_KEYS = {"id", "query", "healthy", "if_unhealthy", "if_healthy", "empty", "explained_by"}
# Derived placeholders: the instance without its port; the shape's resolution without its steps and CFG
# ("512x512_8s" -> "512x512"), which is all a compiled graph depends on (warm-up runs fewer steps).
PSEUDO_LABELS = {"instance_host": "instance", "shape_resolution": "shape"}

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<": operator.lt, ">": operator.gt,
}
_COND = re.compile(r"^\s*(<=|>=|==|!=|<|>)\s*(\S+)\s*$")
_LABEL_PH = re.compile(r"\{\{\s*\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")
_VALUE_PH = re.compile(r"\$\{([a-z_]+(?:\.[a-z_]+)?)\}")
_ID = re.compile(r"^[a-z][a-z0-9_]*$")
_ALERT_NAME = re.compile(r"^Stepwatch[A-Z][A-Za-z0-9]*$")
_ITEM = re.compile(r"^(\d+)\.\s", re.M)
_FENCE = re.compile(r"^[ \t]*```check[ \t]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
_TITLE = re.compile(r"\*\*(.+?)\*\*")


class RunbookError(ValueError):
    """A runbook breaks the format; the message names the file and the check."""


@dataclass(frozen=True)
class Condition:
    """``<op> <value>``: the value is a number or a ${threshold.KEY} / ${diagnosis.NAME} placeholder."""

    op: str
    value: str

    @classmethod
    def parse(cls, text: str, where: str) -> Condition:
        m = _COND.match(str(text))
        if m is None:
            raise RunbookError(f"{where}: healthy {text!r} is not '<op> <number or ${{placeholder}}>' "
                               f"(ops: {', '.join(_OPS)})")
        value = m.group(2)
        if not _VALUE_PH.fullmatch(value):
            try:
                float(value)
            except ValueError:
                raise RunbookError(f"{where}: healthy value {value!r} is not a number or ${{placeholder}}") from None
        return cls(m.group(1), value)

    def threshold(self, thresholds: Thresholds | None = None, profile: str = "production") -> float:
        return float(_value_placeholders(self.value, thresholds, profile, None, "healthy"))

    def holds(self, x: float, thresholds: Thresholds | None = None, profile: str = "production") -> bool:
        return _OPS[self.op](x, self.threshold(thresholds, profile))

    def __str__(self) -> str:
        return f"{self.op} {self.value}"


@dataclass(frozen=True)
class Check:
    number: int
    id: str
    title: str  # the bold question that opens the item
    text: str  # the item's prose without the block, for the report
    query: str  # PromQL with placeholders
    healthy: Condition
    if_unhealthy: str  # a cause, a check id, "next" or "end"
    if_healthy: str
    empty: Outcome = "unknown"  # the outcome when the query returns no samples
    alert: str = ""  # the runbook's alert name (for ${window} and error messages)
    # Another alert whose incident this one is a symptom of, when the walk leaves this check unhealthy
    # (the probe failing because the worker stalled): triage names it and joins that alert's incident.
    explained_by: str = ""

    def labels_needed(self) -> set[str]:
        """Alert labels the query reads (pseudo labels resolved to their source)."""
        return {PSEUDO_LABELS.get(n, n) for n in _LABEL_PH.findall(self.query)}

    def render(self, labels: Mapping[str, str] | None = None, thresholds: Thresholds | None = None,
               profile: str = "production") -> str:
        """The PromQL to run: alert labels and ${...} values filled in.

        A label the alert does not carry renders as "" (in PromQL, ``label=""`` matches
        series without that label).
        """
        labels = dict(labels or {})
        if "instance" in labels and "instance_host" not in labels:
            labels["instance_host"] = labels["instance"].rsplit(":", 1)[0]
        if "shape" in labels and "shape_resolution" not in labels:
            labels["shape_resolution"] = labels["shape"].split("_", 1)[0]

        def label(m: re.Match[str]) -> str:
            return str(labels.get(m.group(1), "")).replace("\\", "\\\\").replace('"', '\\"')

        q = _LABEL_PH.sub(label, self.query)
        return _value_placeholders(q, thresholds, profile, self.alert, f"check {self.id}").strip()

    def judge(self, values: Iterable[float], thresholds: Thresholds | None = None,
              profile: str = "production") -> Outcome:
        """healthy when every returned sample satisfies ``healthy``; ``empty`` when none came back.

        A NaN sample is no answer, not a bad one: it is what a ratio of two zero rates gives
        (OOM errors among no errors, 0/0), so it is left out, and a check that returned only
        NaN has the outcome of an empty one.
        """
        vals = [v for v in values if not math.isnan(v)]
        if not vals:
            return self.empty
        ok = all(self.healthy.holds(v, thresholds, profile) for v in vals)
        return "healthy" if ok else "unhealthy"

    def next_step(self, outcome: Outcome) -> str:
        """Where an outcome leads; unknown follows the healthy branch (the check cannot confirm its cause)."""
        return self.if_unhealthy if outcome == "unhealthy" else self.if_healthy


@dataclass(frozen=True)
class Runbook:
    alert: str
    file: str
    title: str
    sections: dict[str, str]
    checks: tuple[Check, ...]
    anchors: frozenset[str] = field(default_factory=frozenset)

    @property
    def anchor(self) -> str:
        return anchor(self.title)

    def check(self, check_id: str) -> Check:
        for c in self.checks:
            if c.id == check_id:
                return c
        raise KeyError(f"{self.file}: no check {check_id!r}")

    def causes(self) -> set[str]:
        return {t for c in self.checks for t in (c.if_healthy, c.if_unhealthy) if t in CAUSES}


@functools.lru_cache(maxsize=1)
def _packaged_thresholds() -> Thresholds:
    return load_thresholds()


def _value_placeholders(text: str, thresholds: Thresholds | None, profile: str, alert: str | None,
                        where: str) -> str:
    if not _VALUE_PH.search(text):
        return text
    th = thresholds or _packaged_thresholds()

    def value(m: re.Match[str]) -> str:
        name = m.group(1)
        head, _, tail = name.partition(".")
        try:
            if head == "threshold" and tail:
                return format(th.alert(tail).threshold, ".12g")
            if head == "diagnosis" and tail:
                v = th.diagnosis[tail]
                return v if isinstance(v, str) else format(v, ".12g")
            if name == "rate_window":
                return str(th.profiles[profile].rate_window)
            if name == "window" and alert:
                spec = th.by_name(alert)
                return str(spec.window.get(profile, th.profiles[profile].rate_window))
            if name == "job_regex":
                return str(th.job_regex)
            if name == "scrape_interval":
                return str(th.profiles[profile].scrape_interval)
            if tail and head in th.alert(tail).extra:
                return _extra_value(th.alert(tail).extra[head], profile)
        except KeyError:
            pass
        raise RunbookError(f"{where}: unknown placeholder ${{{name}}} (known: ${{threshold.<alert key>}}, "
                           "${<alert setting>.<alert key>}, ${diagnosis.<name>}, ${rate_window}, ${window}, "
                           "${scrape_interval}, ${job_regex})")

    return _VALUE_PH.sub(value, text)


def _extra_value(raw: Any, profile: str) -> str:
    """An alert's own setting (``min_seconds: {production: 300, drill: 20}``), this profile's when per profile.

    A check that restates an alert's condition (the stall limit) must read the same numbers the rule was
    generated from, or triage and the alert would disagree about the same series.
    """
    value = raw.get(profile) if isinstance(raw, dict) else raw
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise KeyError(profile)
    return value if isinstance(value, str) else format(value, ".12g")


def _sections(text: str, where: str) -> tuple[str, dict[str, str], set[str]]:
    lines = text.splitlines()
    title = ""
    anchors: set[str] = set()
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    in_fence = False
    for line in lines:
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        if not in_fence and (m := re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)):
            level, heading = len(m.group(1)), m.group(2)
            anchors.add(anchor(heading))
            if level == 1 and not title:
                title = heading
                current = None
                continue
            if level == 2:
                current = sections.setdefault(heading, [])
                continue
        if current is not None:
            current.append(line)
    if not title:
        raise RunbookError(f"{where}: no '# <alert name>' title")
    return title, {k: "\n".join(v).strip() for k, v in sections.items()}, anchors


def _check(item: str, number: int, alert: str, where: str) -> Check:
    blocks = _FENCE.findall(item)
    if len(blocks) != 1:
        raise RunbookError(f"{where}: diagnosis item {number} needs exactly one ```check block (found {len(blocks)})")
    body = "\n".join(line for line in blocks[0].splitlines())
    indent = min((len(x) - len(x.lstrip()) for x in body.splitlines() if x.strip()), default=0)
    body = "\n".join(x[indent:] for x in body.splitlines())
    try:
        data = yaml.safe_load(body)
    except yaml.YAMLError as e:
        raise RunbookError(f"{where}: check {number} is not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise RunbookError(f"{where}: check {number} must be a YAML mapping")
    unknown = set(data) - CHECK_KEYS
    if unknown:
        raise RunbookError(f"{where}: check {number} has unknown key(s) {', '.join(sorted(unknown))}")
    for k in ("id", "query", "healthy", "if_unhealthy", "if_healthy"):
        if k not in data or data[k] in (None, ""):
            raise RunbookError(f"{where}: check {number} is missing {k}")
    cid = str(data["id"])
    if not _ID.match(cid):
        raise RunbookError(f"{where}: check {number} id {cid!r} is not snake_case")
    empty = str(data.get("empty", "unknown"))
    if empty not in EMPTY:
        raise RunbookError(f"{where}: check {cid}: empty {empty!r} is not one of {', '.join(EMPTY)}")
    explained_by = str(data.get("explained_by") or "")
    if explained_by and not _ALERT_NAME.match(explained_by):
        raise RunbookError(f"{where}: check {cid}: explained_by {explained_by!r} is not an alert name "
                           "(Stepwatch + CamelCase)")
    tm = _TITLE.search(item)
    prose = _FENCE.sub("", item)
    prose = re.sub(r"^\d+\.\s*", "", prose).strip()
    return Check(number=number, id=cid, title=tm.group(1).strip() if tm else cid, text=" ".join(prose.split()),
                 query=str(data["query"]).strip(), healthy=Condition.parse(str(data["healthy"]), f"{where}: {cid}"),
                 if_unhealthy=str(data["if_unhealthy"]), if_healthy=str(data["if_healthy"]),
                 empty=empty,  # type: ignore[arg-type]
                 alert=alert, explained_by=explained_by)


def parse_runbook(text: str, file: str = "<text>") -> Runbook:
    """Parse and validate one runbook (sections, checks, flow targets, causes)."""
    title, sections, anchors = _sections(text, file)
    missing = [s for s in SECTIONS if s not in sections]
    if missing:
        raise RunbookError(f"{file}: missing section(s) {', '.join('## ' + s for s in missing)}")
    diag = sections["Diagnosis"]
    starts = list(_ITEM.finditer(diag))
    if not starts:
        raise RunbookError(f"{file}: ## Diagnosis has no numbered checks")
    checks = []
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(diag)
        checks.append(_check(diag[m.start():end], int(m.group(1)), title, file))
    ids = [c.id for c in checks]
    if len(set(ids)) != len(ids):
        raise RunbookError(f"{file}: check ids must be unique ({', '.join(ids)})")
    for i, c in enumerate(checks):
        if c.number != i + 1:
            raise RunbookError(f"{file}: checks must be numbered 1, 2, 3, ... ({c.id} is {c.number})")
        for branch, target in (("if_unhealthy", c.if_unhealthy), ("if_healthy", c.if_healthy)):
            if target in CAUSES or target == END or (target == NEXT and i + 1 < len(checks)):
                continue
            if target in ids and ids.index(target) > i:
                continue
            raise RunbookError(f"{file}: check {c.id}: {branch} {target!r} is not a cause, a later check id, "
                               f"'next' (not on the last check) or 'end'")
    return Runbook(alert=title, file=Path(file).name, title=title, sections=sections, checks=tuple(checks),
                   anchors=frozenset(anchors))


def runbooks_dir() -> Path:
    return Path(str(resources.files("stepwatch.runbooks")))


def load(file: str | Path) -> Runbook:
    """One runbook by path, or by file name under the packaged runbooks/."""
    p = Path(file)
    if not p.is_absolute() and not p.exists():
        p = runbooks_dir() / p
    return parse_runbook(p.read_text(), str(p))


def load_for_alert(alertname: str, thresholds: Thresholds | None = None) -> Runbook:
    """The runbook of an alert, found the way its runbook_url points to it."""
    th = thresholds or load_thresholds()
    return load(th.by_name(alertname).runbook_file)


def load_for_url(url: str) -> Runbook:
    """The runbook a runbook_url annotation points to (the file name and anchor are what count)."""
    path, _, anchor = url.partition("#")
    rb = load(Path(path.rsplit("/", 1)[-1]).name)
    if anchor and anchor not in rb.anchors:
        raise RunbookError(f"{url}: {rb.file} has no heading with anchor #{anchor}")
    return rb


def load_all(directory: str | Path | None = None) -> dict[str, Runbook]:
    """Every alert runbook, by alert name (README, fault-table and drills are not runbooks)."""
    d = Path(directory) if directory is not None else runbooks_dir()
    out = {}
    for p in sorted(d.glob("*.md")):
        if p.name in NOT_RUNBOOKS:
            continue
        rb = parse_runbook(p.read_text(), str(p))
        out[rb.alert] = rb
    return out


NOT_RUNBOOKS = causes.NOT_RUNBOOKS  # README, the fault table and the drills are no runbooks


def declared_causes(text: str, file: str = "<text>") -> dict[str, str]:
    """The causes a runbook's ```causes blocks declare (stepwatch.causes); a malformed block is a RunbookError."""
    try:
        return causes.declared_causes(text, file)
    except causes.CausesError as e:
        raise RunbookError(str(e)) from None


def load_causes(directory: str | Path | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """The cause vocabulary of the runbooks in ``directory`` (default: the packaged ones); see stepwatch.causes."""
    try:
        return causes.load_causes(Path(directory) if directory is not None else runbooks_dir())
    except causes.CausesError as e:
        raise RunbookError(str(e)) from None


# The shared cause vocabulary: what triage may name, one line each for people; declared by the runbooks.
CAUSES, CAUSE_RUNBOOK = load_causes()


@dataclass(frozen=True)
class Step:
    check: Check
    outcome: Outcome
    goes_to: str


def follow(runbook: Runbook, outcome_of: Callable[[Check], Outcome]) -> tuple[str | None, list[Step]]:
    """Walk the checks from the first: (the cause reached or None at 'end', the steps taken)."""
    trail: list[Step] = []
    i = 0
    while i < len(runbook.checks):
        c = runbook.checks[i]
        outcome = outcome_of(c)
        target = c.next_step(outcome)
        trail.append(Step(c, outcome, target))
        if target in CAUSES:
            return target, trail
        if target == END:
            return None, trail
        i = i + 1 if target == NEXT else [x.id for x in runbook.checks].index(target)
    return None, trail


# ----- drills ---------------------------------------------------------------------------------

DRILL_KEYS = {"id", "alerts", "cause", "within", "inject", "traffic", "restore", "variants", "also"}


@dataclass(frozen=True)
class Drill:
    id: str
    title: str
    alerts: tuple[str, ...]  # alert names that must fire (none: a quiet drill, where nothing may page)
    cause: str  # what triage must name ("" for a quiet drill)
    within: str  # e.g. 60s: from the fault to the alert firing
    inject: dict[str, Any]
    traffic: dict[str, Any]
    restore: dict[str, Any]
    # Other values of the same fault, for recordings that must not all reuse one (a variant's ``inject`` and
    # ``traffic`` keys replace the drill's): variant k of n is the k-th, cycling.
    variants: tuple[dict[str, Any], ...] = ()
    # Other alerts the fault raises, each with its true cause: a page for any of them is a question for triage,
    # so a recording also scores each one that fires with the drill's alert (triage/in_hand.py).
    also: dict[str, str] = field(default_factory=dict)

    def variant(self, k: int) -> Drill:
        """This drill with variant ``k`` applied (``k`` 0 and no variants: the drill as written)."""
        if not self.variants or k == 0:
            return self
        v = self.variants[(k - 1) % len(self.variants)]
        return replace(self, inject={**self.inject, **(v.get("inject") or {})},
                       traffic={**self.traffic, **(v.get("traffic") or {})})


_DRILL_FENCE = re.compile(r"^```drill[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


def _also(where: str, also: Any) -> dict[str, str]:
    if also is None:
        return {}
    if not isinstance(also, dict) or not all(isinstance(k, str) and k.startswith("Stepwatch") for k in also):
        raise RunbookError(f"{where}: also maps alert names (Stepwatch...) to their causes")
    bad = sorted(str(c) for c in also.values() if c not in CAUSES)
    if bad:
        raise RunbookError(f"{where}: also names causes not in the cause vocabulary: {', '.join(bad)}")
    return {str(k): str(v) for k, v in also.items()}


def load_drills(file: str | Path | None = None) -> list[Drill]:
    """The drills of runbooks/drills.md: each ``## title`` section has one ```drill YAML block."""
    p = Path(file) if file is not None else runbooks_dir() / "drills.md"
    text = p.read_text()
    out = []
    titles = list(re.finditer(r"^## (.+)$", text, re.M))
    for i, t in enumerate(titles):
        end = titles[i + 1].start() if i + 1 < len(titles) else len(text)
        blocks = _DRILL_FENCE.findall(text[t.end():end])
        if not blocks:
            continue
        where = f"{p.name}: {t.group(1)}"
        if len(blocks) > 1:
            raise RunbookError(f"{where}: one ```drill block per section")
        data = yaml.safe_load(blocks[0])
        if not isinstance(data, dict) or set(data) - DRILL_KEYS or not {"id", "alerts", "cause", "within"} <= set(data):
            raise RunbookError(f"{where}: a drill block has id, alerts, cause, within (and inject, traffic, restore)")
        if not data["alerts"] and data["cause"] is None:
            data["cause"] = ""  # a quiet drill: an ordinary operation that must page nobody (Drill.quiet)
        elif not data["alerts"] or data["cause"] is None:
            raise RunbookError(f"{where}: alerts and cause are both given, or both empty (a quiet drill: [] and null)")
        elif data["cause"] not in CAUSES:
            raise RunbookError(f"{where}: cause {data['cause']!r} is not in the cause vocabulary")
        variants = data.get("variants") or []
        if not isinstance(variants, list) or not all(isinstance(v, dict) and set(v) <= {"inject", "traffic"}
                                                     for v in variants):
            raise RunbookError(f"{where}: variants is a list of {{inject: ..., traffic: ...}}")
        out.append(Drill(str(data["id"]), t.group(1).strip(), tuple(data["alerts"]), str(data["cause"]),
                         str(data["within"]), dict(data.get("inject") or {}), dict(data.get("traffic") or {}),
                         dict(data.get("restore") or {}), tuple(variants), _also(where, data.get("also"))))
    return out
