"""Rollouts by restart: a restart onto another start-up configuration is one, a routine restart is not."""

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


def test_a_restart_onto_a_raised_threshold_is_a_rollout_naming_the_key(tmp_path: Path) -> None:
    clock = Clock()
    first = ConfigHistory(tmp_path, clock)
    assert first.start("aaa", {"cache": "fbc", "cache_threshold": 0.7}) is None  # nothing before it
    clock.t = 2000.0
    second = ConfigHistory(tmp_path, clock)  # the next process, on a rolled-out YAML
    rollout = second.start("bbb", {"cache": "fbc", "cache_threshold": 1.2})
    assert rollout is not None and (rollout.keys, rollout.at) == (("cache_threshold",), 2000.0)
    assert (rollout.previous_config_id, rollout.config_id) == ("aaa", "bbb")


def test_a_routine_restart_is_no_rollout_and_keeps_the_last_one_at_its_time(tmp_path: Path) -> None:
    clock = Clock()
    ConfigHistory(tmp_path, clock).start("aaa", {"cache_threshold": 0.7})
    clock.t = 2000.0
    ConfigHistory(tmp_path, clock).start("bbb", {"cache_threshold": 1.2})
    clock.t = 3000.0
    third = ConfigHistory(tmp_path, clock)
    assert third.start("bbb", {"cache_threshold": 1.2}) is None
    assert third.last is not None and third.last.at == 2000.0 and third.last.keys == ("cache_threshold",)


def test_without_a_state_dir_nothing_is_compared(tmp_path: Path) -> None:
    assert ConfigHistory(None).start("aaa", {"k": 1}) is None
    assert ConfigHistory(None).start("bbb", {"k": 2}) is None  # a restart cannot be told apart
    assert not (tmp_path / STATE_FILE).exists()


def test_an_unreadable_state_file_starts_a_new_history(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_text("{not json")
    h = ConfigHistory(tmp_path)
    assert h.start("aaa", {"k": 1}) is None
    assert '"config_id": "aaa"' in (tmp_path / STATE_FILE).read_text()
    (tmp_path / STATE_FILE).write_text('{"config_id": "aaa", "settings": {}, "last": {"keys": 3}}')
    assert ConfigHistory(tmp_path).start("aaa", {"k": 1}) is None  # a malformed last rollout is dropped


# ----- the service's metrics, on the engine (its worker stood in for by ready messages) ---------------------
KNOBS = {"cache": "first_block_cache", "vae_tiling": True, "compile": False, "attention_backend": "native"}


def _service(state_dir: Path, threshold: float, shape_cache: dict[str, Any] | None = None,
             ) -> tuple[Any, CollectorRegistry]:
    from stepwatch.service.config import parse
    from stepwatch.service.engine import Service

    registry = CollectorRegistry()
    svc = Service(parse({"warmup": [], "state_dir": str(state_dir), "shape_cache": shape_cache,
                         "pools": {"small": {"sizes": ["512x512"]}},
                         "cache": {"kind": "first_block_cache", "threshold": threshold}}), registry)
    ready = {"fingerprint": {"model": "practice"}, "knobs": {**KNOBS, "cache_threshold": threshold}}
    svc.on_worker_ready(ready)  # type: ignore[arg-type]
    return svc, registry


def _rollout(registry: CollectorRegistry) -> tuple[float | None, list[str], dict[str, str]]:
    at = registry.get_sample_value("stepwatch_service_config_rollout_timestamp_seconds")
    keys = sorted(s.labels["key"] for fam in registry.collect() for s in fam.samples
                  if s.name == "stepwatch_service_config_rollout_key_active" and s.value == 1)
    info = next((dict(s.labels) for fam in registry.collect() for s in fam.samples
                 if s.name == "stepwatch_service_config_rollout_info"), {})
    return at, keys, info


def test_the_service_exports_a_rollout_and_not_a_routine_restart(tmp_path: Path) -> None:
    first, reg = _service(tmp_path, 0.7)
    assert _rollout(reg) == (0.0, [], {})  # nothing known before the first start
    rolled, reg = _service(tmp_path, 1.2)  # the next process, on a YAML with the threshold raised
    at, keys, info = _rollout(reg)
    assert at is not None and at > 0 and keys == ["cache_threshold"], (at, keys)
    assert info == {"previous_config_id": first.config_id(), "config_id": rolled.config_id()}
    _, reg = _service(tmp_path, 1.2)  # a routine restart: the rollout stays the last, at its time
    assert _rollout(reg) == (at, ["cache_threshold"], info)


def test_a_knob_call_and_a_worker_restart_are_no_rollout(tmp_path: Path) -> None:
    svc, reg = _service(tmp_path, 0.7)
    svc.knobs = {**svc.knobs, "cache": "mag_cache"}
    svc.publish_config()
    svc.on_worker_ready({"fingerprint": {"model": "practice"}, "knobs": {**KNOBS, "cache_threshold": 0.7}})
    assert _rollout(reg) == (0.0, [], {})
    assert reg.get_sample_value("stepwatch_service_knob_override_active", {"knob": "cache"}) == 0  # restored


def test_a_state_dir_that_is_not_a_path_is_refused() -> None:
    import pytest

    from stepwatch.service.config import ConfigError, parse

    with pytest.raises(ConfigError, match="state_dir"):
        parse({"state_dir": 3})


def test_a_rollout_of_per_shape_thresholds_alone_is_named(tmp_path: Path) -> None:
    """`stepwatch sweep --write-config` rolls out per-shape thresholds with the global one unchanged: the cache
    runbooks read key shape_cache as a change, and the config id moves."""
    first, _ = _service(tmp_path, 0.7)
    _, reg = _service(tmp_path, 0.7, {"512x512_8s": {"threshold": 0.9}})
    _, keys, info = _rollout(reg)
    assert keys == ["shape_cache"] and info["config_id"] != info["previous_config_id"] == first.config_id()
    _, reg = _service(tmp_path, 0.7, {"512x512_8s": {"threshold": 0.9}})
    assert _rollout(reg)[1] == ["shape_cache"]  # a routine restart keeps the last rollout
