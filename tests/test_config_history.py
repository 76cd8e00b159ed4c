"""The service's configuration history: a knob change, a restart onto another config, a restart onto the same."""

from __future__ import annotations

from pathlib import Path

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
