"""The practice stack's stand-in GPUs: the sidecar reports what the state file says, through the NVML collector."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from stepwatch.exporter.sidecar.config import parse_config
from stepwatch.exporter.sidecar.nvml import NvmlCollector
from stepwatch.exporter.sidecar.practice_gpus import PracticeGpuError, PracticeGpus, write_state
from tests.promtext import scrape, value


def _scrape(path: Path) -> dict:
    registry = CollectorRegistry()
    registry.register(NvmlCollector(PracticeGpus(path)))
    return scrape(registry)


def test_no_file_is_no_gpu_and_a_written_throttle_is_reported_on_that_gpu_only(tmp_path: Path) -> None:
    state = tmp_path / "practice-gpus.json"
    d = _scrape(state)
    assert value(d, "stepwatch_nvml_up") == 0  # as on a CPU host: the practice stack's dashboards say so
    assert not any(name == "stepwatch_gpu_sm_clock_hertz" for name, _ in d)
    write_state(state, 0)
    assert value(_scrape(state), "stepwatch_nvml_up") == 1
    write_state(state, 2, {1: ["sw_thermal_slowdown"]}, {1: 1110})
    d = _scrape(state)
    assert value(d, "stepwatch_gpu_throttle_active", gpu="1", reason="sw_thermal_slowdown") == 1
    assert value(d, "stepwatch_gpu_throttle_active", gpu="0", reason="sw_thermal_slowdown") == 0
    assert value(d, "stepwatch_gpu_sm_clock_hertz", gpu="1") == 1.11e9
    assert value(d, "stepwatch_gpu_sm_clock_hertz", gpu="0") == 1.98e9
    write_state(state, 2)  # the throttle ends, the GPUs stay
    d = _scrape(state)
    assert value(d, "stepwatch_gpu_throttle_active", gpu="1", reason="sw_thermal_slowdown") == 0


def test_a_bad_state_is_refused_when_written_and_a_read_error_when_found(tmp_path: Path) -> None:
    state = tmp_path / "practice-gpus.json"
    with pytest.raises(PracticeGpuError, match="unknown throttle reason"):
        write_state(state, 2, {1: ["too_hot"]})
    assert not state.exists()
    state.write_text("{not json")
    d = _scrape(state)
    assert value(d, "stepwatch_nvml_up") == 0  # the collector's own path for a provider that raises


def test_the_sidecar_config_names_the_state_file_relative_to_itself(tmp_path: Path) -> None:
    cfg = parse_config({"practice_gpus": "gpus.json", "prober": False}, tmp_path)
    assert cfg.practice_gpus == tmp_path / "gpus.json"
    assert parse_config({}, tmp_path).practice_gpus is None
