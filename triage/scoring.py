"""Strict scores for ``stepwatch triage eval`` (issue 13): AC@1, AC@3, ITBench-style precision, a lookup baseline.

"23/23 correct" says little on its own: when every alert name maps to one cause, a
fixed alert -> cause table scores as well as the engine.  These figures make that
visible.  Each scored case is a dict as ``triage.evaluate.evaluate`` returns it:

- ``expected``: the true cause, None for a control (``control`` True);
- ``alert``: the scenario's expected alert (the only incident scored is the one holding it);
- ``got``: the cause that incident names, None when it names none or no incident holds the alert;
- ``ranked``: that incident's causes in the engine's order (``got`` first), [] when ``got`` is None;
- ``named``: [cause, confidence] for every incident of the report that names a cause;
- ``verdict``: "cause", "no_cause", "could_not_check" or "error" (the replay failed).

A case whose replay failed counts in ``cases`` and, when its scenario says it is a fault,
as a missed fault (never as "all clear": triage said nothing).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

Case = dict[str, Any]
KEYS = ("cases", "faults", "controls", "ac1", "ac3", "strict_precision", "false_causes_on_controls",
        "all_clear_during_fault", "lookup_baseline_ac1", "per_alert", "per_cause", "day_two")
# Day-two operations (a rollout, a routine restart, a paused agent, a frozen balancer, one replica's bad weights):
# the cases recorded by those drills and the restart controls, by the scenario name's prefix (the recorder names a
# case after its drill or control).  Scored apart too, since the set's headline mixes them with the faults.
DAY_TWO_PREFIXES = ("config-rollout-", "routine-restart-", "agent-paused-", "balancer-frozen-",
                    "replica-bad-weights-", "control-restart-")


def _frac(n: float, d: int) -> float:
    return round(n / d, 4) if d else 0.0


def faults(results: Sequence[Case]) -> list[Case]:
    return [r for r in results if r.get("expected") is not None]


def controls(results: Sequence[Case]) -> list[Case]:
    return [r for r in results if r.get("control")]


def ac_at(results: Sequence[Case], k: int) -> float:
    """Fraction of fault cases whose true cause is among the first ``k`` causes of the scored incident."""
    fs = faults(results)
    return _frac(sum(r["expected"] in (r.get("ranked") or [])[:k] for r in fs), len(fs))


def precision_of(r: Case) -> float:
    """ITBench-style precision of one fault case: 1/len(named) when the true cause is named, else 0.

    Every distinct cause the report names counts, whatever its confidence: a second,
    wrong incident cause is a claim an on-call person would act on.
    """
    named = sorted({c for c, _ in r.get("named") or []})
    return 1.0 / len(named) if r["expected"] in named else 0.0


def strict_precision(results: Sequence[Case]) -> float:
    """Mean ``precision_of`` over the fault cases (controls are scored by ``false_causes_on_controls``)."""
    fs = faults(results)
    return _frac(sum(precision_of(r) for r in fs), len(fs))


def names_a_cause(r: Case) -> bool:
    """A control names a cause when any incident names one above low confidence (medium or high)."""
    return any(conf not in ("low", "none") for _, conf in r.get("named") or [])


def all_clear(r: Case) -> bool:
    """Triage gave no cause for the fault's alert and did not say it could not check (nor fail to replay)."""
    return r.get("verdict") == "no_cause"


def lookup_table(results: Sequence[Case]) -> dict[str, str]:
    """The best fixed alert -> cause table: per alert, the most frequent true cause of its fault cases.

    Ties go to the cause named first in sorted order; any tie-break scores the same.
    """
    counts: dict[str, Counter[str]] = {}
    for r in faults(results):
        counts.setdefault(r.get("alert") or "", Counter())[r["expected"]] += 1
    return {a: min(c, key=lambda cause: (-c[cause], cause)) for a, c in counts.items()}


def lookup_ac1(results: Sequence[Case]) -> float:
    """AC@1 of ``lookup_table`` on the same fault cases: the trivial baseline the engine must beat."""
    table = lookup_table(results)
    fs = faults(results)
    return _frac(sum(table.get(r.get("alert") or "") == r["expected"] for r in fs), len(fs))


def per_alert(results: Sequence[Case]) -> dict[str, dict[str, Any]]:
    """{alert: {"cases", "ac1", "lookup_ac1", "causes"}} over the fault cases expecting that alert."""
    by: dict[str, list[Case]] = {}
    for r in faults(results):
        by.setdefault(r.get("alert") or "", []).append(r)
    return {a: {"cases": len(rs), "ac1": ac_at(rs, 1), "lookup_ac1": lookup_ac1(rs),
                "causes": sorted({r["expected"] for r in rs})} for a, rs in sorted(by.items())}


def per_cause(results: Sequence[Case]) -> dict[str, dict[str, Any]]:
    """{cause: {"cases", "ac1"}} over the fault cases whose true cause it is."""
    by: dict[str, list[Case]] = {}
    for r in faults(results):
        by.setdefault(r["expected"], []).append(r)
    return {c: {"cases": len(rs), "ac1": ac_at(rs, 1)} for c, rs in sorted(by.items())}


def day_two(results: Sequence[Case]) -> dict[str, Any]:
    """{"cases", "ac1", "false_causes"} over the day-two cases: AC@1 on their faults, causes named on their
    controls (a restart is no fault)."""
    rs = [r for r in results if str(r.get("name", "")).startswith(DAY_TWO_PREFIXES)]
    return {"cases": len(rs), "ac1": ac_at(rs, 1), "false_causes": sum(names_a_cause(r) for r in controls(rs))}


def summarize(results: Sequence[Case]) -> dict[str, Any]:
    """The ``--json`` object: exactly the keys of ``KEYS``."""
    return {
        "cases": len(results),
        "faults": len(faults(results)),
        "controls": len(controls(results)),
        "ac1": ac_at(results, 1),
        "ac3": ac_at(results, 3),
        "strict_precision": strict_precision(results),
        "false_causes_on_controls": sum(names_a_cause(r) for r in controls(results)),
        "all_clear_during_fault": sum(all_clear(r) for r in faults(results)),
        "lookup_baseline_ac1": lookup_ac1(results),
        "per_alert": per_alert(results),
        "per_cause": per_cause(results),
        "day_two": day_two(results),
    }


def alert_table(summary: dict[str, Any]) -> str:
    """One line per expected alert: fault cases, the engine's AC@1, the lookup's AC@1, its true causes."""
    lines = [f"{'alert':<30}{'cases':>6}{'AC@1':>7}{'lookup':>8}  causes"]
    for a, s in summary["per_alert"].items():
        lines.append(f"{a:<30}{s['cases']:>6}{s['ac1']:>7.2f}{s['lookup_ac1']:>8.2f}  {', '.join(s['causes'])}")
    return "\n".join(lines)


def headline(summary: dict[str, Any]) -> str:
    """The strict figures in one line, the lookup baseline beside AC@1."""
    s = summary
    return (f"AC@1 {s['ac1']:.2f} (alert->cause lookup baseline {s['lookup_baseline_ac1']:.2f}); "
            f"AC@3 {s['ac3']:.2f}; strict precision {s['strict_precision']:.2f}; "
            f"{s['faults']} faults, {s['controls']} controls of {s['cases']} cases")
