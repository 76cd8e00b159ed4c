"""A firing alert as triage reads it, in any of the three formats it arrives in, and as a webhook sends it.

Alertmanager's webhook, Alertmanager's API and Prometheus' API each spell an
alert's state differently; ``Alert.parse`` reads all three, and
``webhook_payload`` writes the webhook's form back for recordings and tests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any


@dataclass(frozen=True)
class Alert:
    """A firing alert, from an Alertmanager webhook, Alertmanager's API or Prometheus' API."""

    name: str
    labels: dict[str, str]
    annotations: dict[str, str] = field(default_factory=dict)
    starts_at: str = ""
    status: str = "firing"

    @classmethod
    def parse(cls, d: Mapping[str, Any]) -> Alert:
        labels = {str(k): str(v) for k, v in (d.get("labels") or {}).items()}
        status: Any = d.get("status")
        if isinstance(status, dict):  # Alertmanager API v2: {"state": "active" | "unprocessed" | "suppressed"}
            # "unprocessed": received, not yet through silences and inhibitions: it fires until they say otherwise.
            state = status.get("state")
            status = "firing" if state in ("active", "unprocessed", None) else str(state)
        if status is None:  # Prometheus API: state pending | firing
            status = d.get("state", "firing")
        return cls(name=labels.get("alertname", ""), labels=labels,
                   annotations={str(k): str(v) for k, v in (d.get("annotations") or {}).items()},
                   starts_at=str(d.get("startsAt") or d.get("activeAt") or ""), status=str(status))

    @property
    def key(self) -> str:
        """Identity: name and labels, as Alertmanager fingerprints an alert."""
        return self.name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(self.labels.items())
                                          if k != "alertname") + "}"

    @property
    def severity(self) -> str:
        return self.labels.get("severity", "warning")

    @property
    def host(self) -> str:
        """The instance's host: the sidecar and the service it watches share it (another port)."""
        inst = self.labels.get("instance", "")
        return inst.rsplit(":", 1)[0] if ":" in inst else inst

    @property
    def place(self) -> str:
        """Where the alert is: its pod where targets carry one (a fleet: many pods share a node's address, and a
        replica's service and sidecar share its pod), else its instance's host."""
        return self.labels.get("pod") or self.host

    def short(self) -> str:
        """``Name{the labels that say where}`` for one line of a report."""
        skip = {"alertname", "severity", "subsystem", "profile", "job", "stat"}
        parts = [f"{k}={v}" for k, v in sorted(self.labels.items()) if k not in skip and v]
        return f"{self.name}{{{', '.join(parts)}}}" if parts else self.name

    def to_webhook(self) -> dict[str, Any]:
        """This alert as Alertmanager's webhook sends it."""
        fp = hashlib.sha256(self.key.encode()).hexdigest()[:16]
        return {"status": self.status, "labels": dict(self.labels), "annotations": dict(self.annotations),
                "startsAt": self.starts_at, "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "",
                "fingerprint": fp}


def alerts_from_webhook(payload: Mapping[str, Any]) -> list[Alert]:
    """The firing alerts of one Alertmanager webhook notification (resolved ones are dropped)."""
    return [a for a in (Alert.parse(x) for x in payload.get("alerts") or []) if a.status == "firing"]


def webhook_payload(alerts: Sequence[Alert], receiver: str = "stepwatch-triage") -> dict[str, Any]:
    """A version-4 Alertmanager webhook payload carrying ``alerts`` (for recordings and tests)."""
    common = dict(set.intersection(*(set(a.labels.items()) for a in alerts))) if alerts else {}
    return {"version": "4", "groupKey": "{}:{}", "truncatedAlerts": 0, "status": "firing", "receiver": receiver,
            "groupLabels": {}, "commonLabels": common, "commonAnnotations": {}, "externalURL": "",
            "alerts": [a.to_webhook() for a in alerts]}


def iso_utc(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
