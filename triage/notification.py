"""Triage one Alertmanager notification and write its reports: what ``triage serve`` does per webhook.

The notified firing alerts are triaged together with the other alerts firing on
the same hosts (Prometheus' alerts API), so alerts that share a cause form one
incident even when Alertmanager notifies them apart; only the incidents holding
a notified alert are kept.  A notification with no firing alert (resolved only)
is recorded as "resolved", not triaged.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepwatch.files import write_atomically
from stepwatch.promapi import PromError, Prometheus
from stepwatch.triage.alert import Alert, alerts_from_webhook
from stepwatch.triage.engine import Engine, firing_at
from stepwatch.triage.incidents import Report
from stepwatch.triage.render import markdown, terminal


@dataclass
class Reports:
    """The three forms of one notification's report; ``base`` names its files (``<time>-<id>``)."""

    base: str
    data: dict[str, Any]
    text: str
    md: str
    summary: str  # for the log: "<alerts> -> <causes>"


def triage_notification(prom: Prometheus, payload: Mapping[str, Any], received: float,
                        at: float | None = None, context: bool = True) -> Reports:
    """The reports of one notification (nothing is written yet); ``at`` is a replay's fixed time."""
    notified = alerts_from_webhook(payload)
    keys = {a.key for a in notified}
    extra = _firing_on_same_hosts(prom, notified, at) if context else []
    report = Engine(prom, at=at).run(notified + extra)
    report.incidents = [i for i in report.incidents if any(a.key in keys for a in i.alerts)]
    data = report.to_json()
    if notified:
        text, md = terminal(report), markdown(report)
    else:
        text, md = _resolved(payload)
        data["status"] = "resolved"
    base = _base_name(received, keys)
    data.update({"notification": {"status": payload.get("status"), "groupKey": payload.get("groupKey"),
                                  "receiver": payload.get("receiver"),
                                  "alerts": [a.short() for a in notified]},
                 "received_at_unix": received, "files": [f"{base}.txt", f"{base}.md", f"{base}.json"]})
    return Reports(base, data, text, md, _summary(notified, report))


def write_reports(out: Path, reports: Reports) -> str:
    """Write ``<base>.txt/.md/.json`` and ``latest.*`` atomically; returns the JSON text.

    ``latency_s`` (received to written) is stamped into the JSON once the text and
    markdown are on disk, so it measures what an on-call person waits for.
    """
    data = reports.data
    write_atomically(out / f"{reports.base}.txt", reports.text)
    write_atomically(out / f"{reports.base}.md", reports.md)
    data["latency_s"] = round(time.time() - data["received_at_unix"], 3)
    body = json.dumps(data, indent=2)
    write_atomically(out / f"{reports.base}.json", body)
    for ext, content in (("txt", reports.text), ("md", reports.md), ("json", body)):
        write_atomically(out / f"latest.{ext}", content)
    return body


def _firing_on_same_hosts(prom: Prometheus, notified: list[Alert], at: float | None) -> list[Alert]:
    """Other alerts firing on the notified alerts' hosts; none when Prometheus does not answer."""
    if not notified:
        return []
    keys = {a.key for a in notified}
    hosts = {a.host for a in notified}
    try:
        return [a for a in firing_at(prom, at) if a.key not in keys and a.host in hosts]
    except PromError:
        return []


def _resolved(payload: Mapping[str, Any]) -> tuple[str, str]:
    names = sorted({str((a.get("labels") or {}).get("alertname", "")) for a in payload.get("alerts", [])})
    text = f"RESOLVED: {', '.join(names) or 'nothing'} (no firing alert in this notification)\n"
    return text, f"# stepwatch triage: resolved\n\n{text}"


def _base_name(received: float, keys: set[str]) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(received))
    ident = hashlib.sha256(json.dumps(sorted(keys)).encode()).hexdigest()[:8]
    return f"{stamp}-{ident}"


def _summary(notified: list[Alert], report: Report) -> str:
    alerts = ", ".join(a.name for a in notified) or "resolved"
    return f"{alerts} -> {', '.join(str(i.cause) for i in report.incidents) or '-'}"


