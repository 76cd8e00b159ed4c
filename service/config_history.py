"""Configuration rolled out by restart: which start-up configuration the service runs, and since when.

``stepwatch_service_knob_override_active`` compares the knobs with the ones this process started with, so a
configuration rolled out by restart (a raised cache threshold in the YAML, say) looks like no change at all,
and triage then blamed the prompt mix and advised capturing a new baseline, which would bake the bad
setting in.  The service therefore keeps its start-up configuration in a small state file (``state_dir``,
a directory that outlives the process) and, at start, compares it with the previous process's:

- another start-up configuration: a rollout, with the keys that differ (the knobs, and ``fingerprint`` for
  the deployment itself: model, weights, dtype) and the time it took effect;
- the same one (a routine restart): no rollout, and the last one stays what it was, at its own time, so a
  restart neither hides a recent rollout nor looks like one.

Knob calls are not rollouts: they are runtime overrides, and the knob gauge reports them against the start-up
value (a knob set and restored reads unchanged); a restart that drops an override is no rollout either, since
the start-up configuration is the same.  Without a state directory nothing is compared: a rollout onto a
fresh pod is known only from Prometheus' own history of ``stepwatch_service_config_info``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stepwatch.files import write_atomically
from stepwatch.metrics import ServiceMetrics

log = logging.getLogger("stepwatch.service")

STATE_FILE = "config-history.json"


@dataclass(frozen=True)
class Rollout:
    """A restart onto another start-up configuration: which keys differ, when, and the config ids."""

    keys: tuple[str, ...]
    at: float
    previous_config_id: str
    config_id: str


@dataclass
class ConfigHistory:
    """The start-up configuration and the last rollout; persisted to ``state_dir`` when one is given."""

    state_dir: Path | None = None
    clock: Callable[[], float] = time.time
    last: Rollout | None = None

    def start(self, config_id: str, settings: dict[str, Any]) -> Rollout | None:
        """This process's start-up configuration: the rollout it is (None when it is the previous process's
        configuration, or when nothing is known of one); ``last`` is then the latest rollout known."""
        previous = self._load()
        if previous is not None and previous.get("config_id") != config_id:
            self.last = Rollout(_differing(previous.get("settings", {}), settings), self.clock(),
                                str(previous.get("config_id")), config_id)
            self._save(config_id, settings)
            return self.last
        if previous is not None and isinstance(previous.get("last"), dict):
            try:
                self.last = Rollout(**{**previous["last"], "keys": tuple(previous["last"]["keys"])})
            except (TypeError, KeyError):
                log.warning("config history: the last rollout in the state file is malformed; dropped")
        self._save(config_id, settings)
        return None

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

    def _save(self, config_id: str, settings: dict[str, Any]) -> None:
        path = self._path()
        if path is None:
            return
        last = None if self.last is None else {**asdict(self.last), "keys": list(self.last.keys)}
        data = {"config_id": config_id, "settings": settings, "last": last}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, json.dumps(data, sort_keys=True, default=str))
        except OSError as e:
            log.warning("config history: cannot write %s (%s); restarts will not be compared", path, e)


def _differing(before: dict[str, Any], after: dict[str, Any]) -> tuple[str, ...]:
    return tuple(sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)))


def publish_rollout(m: ServiceMetrics, rollout: Rollout | None, keys: tuple[str, ...]) -> None:
    """The last rollout as metrics: its time (0: none known), which of ``keys`` differed, and the config ids on
    either side (an info series).  ``keys`` is fixed per service (its knobs and ``fingerprint``), so the label
    stays bounded whatever a rollout holds."""
    m.service_config_rollout_timestamp_seconds.set(rollout.at if rollout else 0.0)
    for k in keys:
        m.service_config_rollout_key_active.labels(key=k).set(int(rollout is not None and k in rollout.keys))
    m.service_config_rollout.clear()
    if rollout is not None:
        m.service_config_rollout.info({"previous_config_id": rollout.previous_config_id,
                                       "config_id": rollout.config_id})
