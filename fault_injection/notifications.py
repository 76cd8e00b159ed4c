"""What the receiver got, alert by alert: each alert of a fleet drill notified once firing and once resolved.

The fleet's two evaluators send every alert to both Alertmanagers, which gossip what they notified so that only
one of them notifies.  When that goes wrong the on-call sees it as noise: a "firing" after the "resolved", the
same page twice, a resolution never sent.  So the fleet drills count, at the receiver, for every alert that
started during the drill: exactly one firing and one resolved notification, or the drill fails.

An alert is its labels (``group_by: ['...']`` in the drill profile: one alert per notification group).  A later
firing notification of the same labels that *started* after the last resolution is a new episode of the alert
(it fired again); one that started before is a stale copy of the old one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stepwatch.fault_injection.webhook import Notification, starts_at


@dataclass
class Episode:
    """One life of one alert (from its start to its resolution) and the notifications it got."""

    alert: str
    started: float
    firing: int = 0
    resolved: int = 0
    ended: float | None = None
    trail: list[str] = field(default_factory=list)  # "resolved +41.2 s by <Alertmanager>": who sent what, when

    @property
    def once_each(self) -> bool:
        return self.firing == 1 and self.resolved == 1

    def describe(self) -> str:
        counts = f"{self.alert}: {self.firing} firing, {self.resolved} resolved"
        return counts if self.once_each else f"{counts} ({'; '.join(self.trail)})"


def alert_name(alert: dict[str, Any]) -> str:
    """``Name{label="value",...}``: the alert's identity, as its notifications spell it."""
    labels = dict(alert.get("labels", {}))
    name = labels.pop("alertname", "")
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def episodes(notes: Sequence[Notification], since: float) -> list[Episode]:
    """Every episode of every alert that started at ``since`` or later, with its firing and resolved counts."""
    by_alert: dict[str, list[Episode]] = {}
    for note in sorted(notes, key=lambda n: n.received):
        for alert in note.alerts:
            started = starts_at(alert.get("startsAt"))
            if note.received < since or started is None or started < since - 1.0:
                continue  # an alert of an earlier drill, still notified
            key = alert_name(alert)
            own = by_alert.setdefault(key, [])
            current = own[-1] if own else None
            if current is None or (current.ended is not None and started >= current.ended):
                current = Episode(key, started)
                own.append(current)
            status = "firing" if alert.get("status") == "firing" else "resolved"
            current.trail.append(f"{status} +{note.received - since:.1f} s by {note.raw.get('externalURL', '?')}")
            if status == "firing":
                current.firing += 1
                continue
            current.resolved += 1
            ended = starts_at(alert.get("endsAt")) or note.received
            current.ended = ended if current.ended is None else max(current.ended, ended)
    return [e for own in by_alert.values() for e in own]


def settled(notes: Callable[[], list[Notification]], since: float, tail_s: float, deadline: float,
            sleep: Callable[[float], None] = time.sleep) -> list[Episode]:
    """The episodes once every one is resolved and nothing has arrived for ``tail_s``, or at ``deadline`` as they
    are then.  A stale copy trails the resolution by at most a group interval and the peer's wait: the peer's
    flush in flight, or the next flush of an alert an evaluator sent firing again."""
    while True:
        seen = notes()
        found = episodes(seen, since)
        last = max((n.received for n in seen if n.received >= since), default=since)
        quiet = time.time() - last >= tail_s
        if (quiet and all(e.resolved for e in found)) or time.time() >= deadline:
            return found
        sleep(1.0)
