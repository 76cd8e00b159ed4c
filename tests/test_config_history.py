"""The service's configuration history: a knob change, a restart onto another config, a restart onto the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from stepwatch.service.config_history import STATE_FILE, ConfigHistory


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_restart_onto_a_raised_threshold_is_a_change_naming_the_key(tmp_path: Path) -> None:
    clock = Clock()
    first = ConfigHistory(tmp_path, clock)
    assert first.start("aaa", {"cache": "fbc", "cache_threshold": 0.7}) is None  # nothing before it
    clock.t = 2000.0
    second = ConfigHistory(tmp_path, clock)  # the next process, on a rolled-out YAML
    change = second.start("bbb", {"cache": "fbc", "cache_threshold": 1.2})
    assert change is not None and (change.by, change.keys, change.at) == ("restart", ("cache_threshold",), 2000.0)
    assert (change.previous_config_id, change.config_id) == ("aaa", "bbb")


def test_a_routine_restart_is_no_change_and_keeps_the_last_one(tmp_path: Path) -> None:
    clock = Clock()
    ConfigHistory(tmp_path, clock).start("aaa", {"cache_threshold": 0.7})
    clock.t = 2000.0
    ConfigHistory(tmp_path, clock).start("bbb", {"cache_threshold": 1.2})
    clock.t = 3000.0
    third = ConfigHistory(tmp_path, clock)
    change = third.start("bbb", {"cache_threshold": 1.2})  # restarted, same config: the rollout is still the last
    assert change is not None and change.by == "restart" and change.at == 2000.0


def test_a_knob_then_its_restore_are_two_changes_the_last_one_back(tmp_path: Path) -> None:
    clock = Clock()
    h = ConfigHistory(tmp_path, clock)
    h.start("aaa", {"cache_threshold": 0.7})
    clock.t = 1100.0
    up = h.knobs_changed("ccc", {"cache_threshold": 2.0})
    assert up is not None and (up.by, up.keys, up.previous_config_id) == ("knob", ("cache_threshold",), "aaa")
    assert h.knobs_changed("ccc", {"cache_threshold": 2.0}) is None  # the same again: no change
    clock.t = 1200.0
    back = h.knobs_changed("aaa", {"cache_threshold": 0.7})
    assert back is not None and back.config_id == "aaa" and back.at == 1200.0


def test_without_a_state_dir_only_knob_changes_are_known(tmp_path: Path) -> None:
    assert ConfigHistory(None).start("aaa", {"k": 1}) is None
    assert ConfigHistory(None).start("bbb", {"k": 2}) is None  # a restart cannot be told apart
    assert not (tmp_path / STATE_FILE).exists()


def test_an_unreadable_state_file_starts_a_new_history(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_text("{not json")
    h = ConfigHistory(tmp_path)
    assert h.start("aaa", {"k": 1}) is None
    assert '"config_id": "aaa"' in (tmp_path / STATE_FILE).read_text()


# ----- the service's metrics, on the engine (its worker stood in for by ready messages) ---------------------
def _service(state_dir: Path, threshold: float) -> tuple[Any, CollectorRegistry]:
    from stepwatch.service.config import parse
    from stepwatch.service.engine import Service

    registry = CollectorRegistry()
    svc = Service(parse({"warmup": [], "state_dir": str(state_dir),
                         "cache": {"kind": "first_block_cache", "threshold": threshold}}), registry)
    knobs = {"cache": "first_block_cache", "cache_threshold": threshold, "vae_tiling": True, "compile": False,
             "attention_backend": "native"}
    svc.on_worker_ready({"fingerprint": {"model": "practice"}, "knobs": knobs})  # type: ignore[typeddict-item]
    return svc, registry


def _changed(registry: CollectorRegistry) -> tuple[float | None, list[str], dict[str, str]]:
    at = registry.get_sample_value("stepwatch_service_config_changed_timestamp_seconds")
    keys = sorted(s.labels["key"] for fam in registry.collect() for s in fam.samples
                  if s.name == "stepwatch_service_config_changed_key_active" and s.value == 1)
    info = next((s.labels for fam in registry.collect() for s in fam.samples
                 if s.name == "stepwatch_service_config_change_info"), {})
    return at, keys, info


def test_the_service_exports_a_rollout_by_restart_and_not_a_routine_restart(tmp_path: Path) -> None:
    first, reg = _service(tmp_path, 0.7)
    assert _changed(reg) == (0.0, [], {})  # nothing known before the first start
    rolled, reg = _service(tmp_path, 1.2)  # the next process, on a YAML with the threshold raised
    at, keys, info = _changed(reg)
    assert at is not None and at > 0 and keys == ["cache_threshold"], (at, keys)
    assert info["by"] == "restart" and info["previous_config_id"] == first.config_id() != rolled.config_id()
    _, reg = _service(tmp_path, 1.2)  # a routine restart: the rollout stays the last change, at its time
    assert _changed(reg) == (at, ["cache_threshold"], info)


def test_a_knob_call_is_exported_with_its_key(tmp_path: Path) -> None:
    svc, reg = _service(tmp_path, 0.7)
    svc.knobs = {**svc.knobs, "cache": "mag_cache"}
    svc._note_config("knob")
    svc.publish_config()
    at, keys, info = _changed(reg)
    assert keys == ["cache"] and info["by"] == "knob" and at is not None and at > 0
