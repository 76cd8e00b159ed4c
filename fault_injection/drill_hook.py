"""The drill runner's triage step: triage what fires on the drill's stack, return the drill alert's incident.

``stepwatch drill`` imports ``triage_for_drill`` and calls it once the drill's
expected alert fires (fault still in place); the verdict lands in the drill
report, and the drill checks its ``cause`` against runbooks/drills.md.
"""

from __future__ import annotations

import time
from typing import Any

from stepwatch.fault_injection.drill import DrillResult
from stepwatch.fault_injection.stack import LocalStack
from stepwatch.triage.engine import Engine, firing_at
from stepwatch.triage.render import incident_terminal, terminal


def triage_for_drill(stack: LocalStack, result: DrillResult) -> dict[str, Any] | None:
    """Triage every alert firing on ``stack.prom`` now; the incident holding ``result.expected_alert``."""
    t0 = time.time()
    engine = Engine(stack.prom)
    alerts = firing_at(stack.prom)
    report = engine.run(alerts)
    inc = report.incident_for(result.expected_alert)
    base = {"status": report.status, "seconds": round(time.time() - t0, 3),
            "firing": sorted(a.short() for a in alerts), "report": report.to_json()}
    if inc is None:
        return {**base, "cause": None, "confidence": "none", "incident": None, "alerts": [], "evidence": [],
                "text": f"{result.expected_alert} was not firing when triage ran.\n" + terminal(report)}
    return {**base, "cause": inc.cause, "confidence": inc.confidence, "incident": inc.to_json(),
            "alerts": [a.name for a in inc.alerts],
            "evidence": [{"check": c.id, "runbook": c.runbook, "title": c.title, "query": c.query,
                          "value": c.value_text(), "healthy_when": c.condition, "outcome": c.outcome}
                         for c in inc.evidence(4)],
            "path": [{"check": c.id, "value": c.value_text(), "outcome": c.outcome}
                     for c in inc.primary.checks if c.on_path],
            "next_step": inc.primary.next_step(), "runbook_url": inc.primary.runbook_url,
            "panel": inc.primary.panel, "text": incident_terminal(inc)}
