"""What changed in the service's configuration, and when: by a knob, or by a restart onto another config.

``stepwatch_service_knob_override_active`` compares the knobs with the ones the service started with, so a
configuration rolled out by restart (a raised cache threshold in the YAML, say) looks like no change at all,
and triage then blames the prompt mix.  The service therefore remembers its last configuration in a small
state file (``state_dir``; without one, only knob changes are known) and, at start and on every knob call,
compares the new configuration with the one before:

- ``by``: ``restart`` (the previous process ran another configuration), ``knob`` (an admin call), or
  ``worker_restart`` (a restarted worker is back on the start-up knobs);
- ``keys``: the knobs (and ``fingerprint`` for the deployment's identity) that differ;
- ``at``: when the change took effect (unix seconds).

A knob set and then restored is two changes, the second back to the first's configuration: the record keeps
the last one, so "did the cache threshold change" reads the latest difference, not the window's history
(Prometheus keeps that).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepwatch.metrics import ServiceMetrics

log = logging.getLogger("stepwatch.service")

STATE_FILE = "config-history.json"


@dataclass(frozen=True)
class Change:
    """The last configuration change: how, which keys, when, and the config ids on either side."""

    by: str
    keys: tuple[str, ...]
    at: float
    previous_config_id: str
    config_id: str


@dataclass
class ConfigHistory:
    """The current configuration and its last change; persisted to ``state_dir`` when one is given."""

    state_dir: Path | None = None
    clock: Callable[[], float] = time.time
    config_id: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    last: Change | None = None

    def start(self, config_id: str, settings: dict[str, Any]) -> Change | None:
        """The service's first configuration: a change ``by="restart"`` when the state file says the previous
        process ran another one (None without a state file, or when it is the same)."""
        previous = self._load()
        self.config_id, self.settings = config_id, dict(settings)
        if previous is not None and previous.get("config_id") != config_id:
            self.last = Change("restart", _differing(previous.get("settings", {}), settings), self.clock(),
                               str(previous.get("config_id")), config_id)
        elif previous is not None and previous.get("last"):
            self.last = Change(**{**previous["last"], "keys": tuple(previous["last"]["keys"])})
        self._save()
        return self.last if self.last is not None and self.last.config_id == config_id else None

    def knobs_changed(self, config_id: str, settings: dict[str, Any], by: str = "knob") -> Change | None:
        """A knob call (or a restarted worker, back on the start-up knobs: ``by="worker_restart"``) produced
        ``config_id``: the change, or None when the configuration is the same."""
        if config_id == self.config_id:
            return None
        change = Change(by, _differing(self.settings, settings), self.clock(), str(self.config_id), config_id)
        self.config_id, self.settings, self.last = config_id, dict(settings), change
        self._save()
        return change

    # ----- the state file -------------------------------------------------------------------
    def _path(self) -> Path | None:
        return None if self.state_dir is None else self.state_dir / STATE_FILE

    def _load(self) -> dict[str, Any] | None:
        path = self._path()
        if path is None or not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            log.warning("config history: %s unreadable (%s); starting a new one", path, e)
            return None
        return data if isinstance(data, dict) else None

    def _save(self) -> None:
        path = self._path()
        if path is None:
            return
        last = None if self.last is None else {**self.last.__dict__, "keys": list(self.last.keys)}
        data = {"config_id": self.config_id, "settings": self.settings, "last": last}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, sort_keys=True, default=str))
            os.replace(tmp, path)  # a crash mid-write leaves the old file, never half of one
        except OSError as e:
            log.warning("config history: cannot write %s (%s); restarts will not be compared", path, e)


def _differing(before: dict[str, Any], after: dict[str, Any]) -> tuple[str, ...]:
    return tuple(sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)))


def publish_change(m: ServiceMetrics, change: Change | None, keys: tuple[str, ...]) -> None:
    """The last change as metrics: its time (0: none known), which of ``keys`` differed, and how (an info
    series: by, previous_config_id, config_id).  ``keys`` is fixed per service (its knobs and ``fingerprint``),
    so the label stays bounded whatever a change holds."""
    m.service_config_changed_timestamp_seconds.set(change.at if change else 0.0)
    for k in keys:
        m.service_config_changed_key_active.labels(key=k).set(int(change is not None and k in change.keys))
    m.service_config_change.clear()
    if change is not None:
        m.service_config_change.info({"by": change.by, "previous_config_id": change.previous_config_id,
                                      "config_id": change.config_id})
