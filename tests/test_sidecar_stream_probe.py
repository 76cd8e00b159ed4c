"""The drift probe against the real service: a baseline session captured, the same session again reads every chunk
identical, the later chunks' steps cut reads chunks 0-3 identical and chunks 4-7 below the video gate, the knob put
back reads identical again; and the pieces (chunk ranges, slope, probe-set parsing) on their own."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from stepwatch.exporter.sidecar.capture import capture_baseline
from stepwatch.exporter.sidecar.config import ConfigError, default_stream_probe_set, parse_config
from stepwatch.exporter.sidecar.stream_probe import StreamProber, slope, worst_by_range
from tests.promtext import scrape, value
from tests.servicefixture import ServiceProc
from tests.test_exposition_lint import assert_lint_clean

OVERRIDES = {"compile": {"enabled": False}, "warmup": ["256x256"], "video": {"enabled": False},
             "stream": {"enabled": True, "max_sessions": 2, "sizes": ["64x64"]}}
CHUNK = "stepwatch_quality_stream_chunk_psnr_decibels"
GATE_DB = 24.0


def test_chunk_ranges_and_slope() -> None:
    psnr = [math.inf, math.inf, math.inf, math.inf, 24.6, 21.8, 21.2, 21.9]
    assert worst_by_range(psnr) == {"0": math.inf, "1": math.inf, "2-3": math.inf, "4-7": 21.2}
    assert slope([math.inf] * 8) == 0.0  # identical everywhere: capped, flat
    assert slope(psnr) < -4.0  # 60 dB for four chunks, then ~22: steeply down
    assert slope([30.0]) == 0.0


def test_stream_probe_set_config() -> None:
    cfg = parse_config({"target": "http://127.0.0.1:1", "stream_probe_set": "default"})
    assert cfg.stream_probe_set == default_stream_probe_set()
    assert cfg.stream_probe_set.items[0].expected_frames == 8
    with pytest.raises(ConfigError, match="streaming session"):
        parse_config({"stream_probe_set": {"name": "x", "items": [{"prompt": "p", "seed": 1}]}})
    with pytest.raises(ConfigError, match="not both"):
        parse_config({"probe_set": {"name": "x", "items": [{"prompt": "p", "seed": 1, "frames": 5, "chunks": 4}]}})


@pytest.mark.heavy
def test_drift_probe_sees_late_chunks_fall_when_their_steps_are_cut_or_the_window_grows(tmp_path: Path) -> None:
    svc = ServiceProc(tmp_path, OVERRIDES)
    try:
        probes = default_stream_probe_set()
        capture_baseline(svc.url, probes, tmp_path / "baselines")
        registry = CollectorRegistry()
        prober = StreamProber(svc.url, registry=registry, baseline_dir=tmp_path / "baselines", probe_set=probes)
        try:
            assert prober.run_once().status == "ok"
            m = scrape(registry)
            for r in ("0", "1", "2-3", "4-7"):
                assert value(m, CHUNK, probe_set="stream", chunk_index=r) == math.inf
            assert value(m, "stepwatch_quality_stream_psnr_slope_decibels", probe_set="stream") == 0.0
            assert not [k for k in m if k[0] == "stepwatch_quality_psnr_decibels"]  # no quantiles for a stream set

            assert svc.knobs(stream_late_steps=1)[0] == 200
            assert prober.run_once().status == "ok"
            m = scrape(registry)
            for r in ("0", "1", "2-3"):
                assert value(m, CHUNK, probe_set="stream", chunk_index=r) == math.inf
            assert value(m, CHUNK, probe_set="stream", chunk_index="4-7") < GATE_DB
            assert value(m, "stepwatch_quality_stream_psnr_slope_decibels", probe_set="stream") < -1.0
            assert value(svc.metrics(), "stepwatch_service_knob_override_active", knob="stream_late_steps") == 1
            assert_lint_clean(generate_latest(registry).decode(), "the drift prober's series")

            assert svc.knobs(stream_late_steps=0)[0] == 200
            assert prober.run_once().status == "ok"
            assert value(scrape(registry), CHUNK, probe_set="stream", chunk_index="4-7") == math.inf

            # The other cause: a window past the model's 3 chunks.  The later chunks read their context (the
            # practice model's attention, service/pipeline.py _sharpen_far): chunk 3 changes but passes, 4-7 fall.
            assert svc.knobs(stream_window_chunks=6)[0] == 200
            assert prober.run_once().status == "ok"
            m = scrape(registry)
            assert value(m, CHUNK, probe_set="stream", chunk_index="1") == math.inf
            assert GATE_DB <= value(m, CHUNK, probe_set="stream", chunk_index="2-3") < math.inf
            assert value(m, CHUNK, probe_set="stream", chunk_index="4-7") < GATE_DB
            assert value(svc.metrics(), "stepwatch_service_knob_override_active", knob="stream_window_chunks") == 1
            assert svc.knobs(stream_window_chunks=3)[0] == 200
            assert prober.run_once().status == "ok"
            assert value(scrape(registry), CHUNK, probe_set="stream", chunk_index="4-7") == math.inf
        finally:
            prober.close()
    finally:
        svc.close()
