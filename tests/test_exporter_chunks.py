"""Chunked autoregressive video: the tiny causal FAR pipeline, instrumented, against its own KV tensors and clock."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from stepwatch.catalog import METRICS
from stepwatch.exporter import chunks, instrument, uninstrument
from stepwatch.service.pipeline import build_pipeline
from tests.conftest import need_tool
from tests.promtext import scrape, total, value

SIZE, FRAMES, STEPS = 64, 25, 4  # chunks of (1, 2, 2, 2) latent frames: 1 + 8 + 8 + 8 frames


@pytest.fixture(scope="module")
def far() -> Any:
    return build_pipeline("far", seed=0)


def _call(pipe: Any, **kw: Any) -> Any:
    return pipe("w1 w2 w3", height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=STEPS,
                generator=torch.Generator().manual_seed(0), **kw)


def _instrumented(pipe: Any) -> tuple[Any, CollectorRegistry]:
    reg = CollectorRegistry()
    return instrument(pipe, registry=reg), reg


def test_kv_bytes_read_from_the_cache_equal_the_ledger(far: Any) -> None:
    inst, _ = _instrumented(far)
    try:
        for cfg, batch in ((1.0, 1), (2.0, 2)):
            _call(far, guidance_scale=cfg, negative_prompt="w9" if cfg > 1 else None)
            s = inst.last_report.stream
            assert s is not None
            # 2 layers x (full 3 x 2 frames x 16 tokens + compressed 2 x 2 x 4) x 2 (K, V) x 24 x 4 bytes
            assert s.window_tokens == 112
            assert s.kv_ledger_bytes == 2 * 24 * 2 * 4 * 112 * batch
            assert abs(s.kv_allocated_bytes - s.kv_ledger_bytes) <= 0.01 * s.kv_ledger_bytes
            assert s.kv_allocated_bytes == 43_008 * batch  # what the tensors hold, summed independently
    finally:
        uninstrument(far)


def test_chunks_are_timed_and_published_once_each(far: Any) -> None:
    """Four chunks, each timed once (the first from the call's start), the worker's KV gauges up during the
    call and back to 0 after it, and an exposition promtool accepts."""
    inst, reg = _instrumented(far)
    seen: dict[str, float] = {}

    def mid_call(pipe: Any, i: int, t: Any, kw: dict[str, Any]) -> dict[str, Any]:
        text = scrape(reg)
        for state in ("allocated", "in_use"):
            seen[state] = max(seen.get(state, 0.0), value(text, "stepwatch_stream_kv_cache_bytes", state=state))
        seen["chunks_mid_call"] = value(text, "stepwatch_stream_chunk_duration_seconds_count")
        return kw

    try:
        _call(far, callback_on_step_end=mid_call)
        s = inst.last_report.stream
        assert len(s.chunk_seconds) == 4 and all(x > 0 for x in s.chunk_seconds)
        assert s.chunk_frames == [1, 8, 8, 8]
        assert len(s.realtime_factors) == 3
        assert s.realtime_factors[0] == pytest.approx(s.chunk_seconds[1] / (8 / chunks.DEFAULT_FPS))
        assert sum(s.chunk_seconds) <= inst.last_report.seconds
        text = scrape(reg)
        assert seen["chunks_mid_call"] == 3  # in the last chunk's steps: the first three already on the series
        assert value(text, "stepwatch_stream_chunk_duration_seconds_count") == 4
        assert value(text, "stepwatch_stream_first_chunk_seconds_count") == 1
        assert value(text, "stepwatch_stream_first_chunk_seconds_sum") == pytest.approx(s.chunk_seconds[0])
        assert value(text, "stepwatch_stream_chunk_index_duration_seconds_count", chunk_index="2-3") == 2
        assert value(text, "stepwatch_stream_realtime_factor_ratio_count") == 3
        assert value(text, "stepwatch_stream_kv_window_tokens") == 112
        # During the call the worker's gauges held the cache (read after each chunk but the last); after it, 0.
        # In use after the third chunk: chunks of 1, 2 and 2 frames at 16 tokens = 80 of the 112-token window.
        assert seen["allocated"] == 43_008
        assert seen["in_use"] == 43_008 * 80 // 112
        for state in ("allocated", "in_use"):
            assert value(text, "stepwatch_stream_kv_cache_bytes", state=state) == 0
        assert value(text, "stepwatch_stream_kv_cache_ledger_bytes") == 0
        assert total(text, "stepwatch_exporter_errors_total") == 0
    finally:
        uninstrument(far)
    need_tool("promtool")
    p = subprocess.run(["promtool", "check", "metrics"], input=generate_latest(reg), capture_output=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_call_that_fails_mid_stream_counts_its_finished_chunks_and_lets_its_cache_go(far: Any) -> None:
    inst, reg = _instrumented(far)
    calls = {"n": 0}

    def fail_in_the_third_chunk(pipe: Any, i: int, t: Any, kw: dict[str, Any]) -> dict[str, Any]:
        calls["n"] += 1
        if calls["n"] > 2 * STEPS:  # the first step of the third chunk (tiny FAR skips no steps at 4)
            raise RuntimeError("client went away")
        return kw

    try:
        with pytest.raises(RuntimeError, match="client went away"):
            _call(far, callback_on_step_end=fail_in_the_third_chunk)
        s = inst.last_report.stream
        assert inst.last_report.outcome == "error"
        assert len(s.chunk_seconds) == 2  # the two chunks whose frames were out
        text = scrape(reg)
        assert value(text, "stepwatch_stream_chunk_duration_seconds_count") == 2
        assert value(text, "stepwatch_stream_kv_cache_bytes", state="allocated") == 0
    finally:
        uninstrument(far)


def test_bench_stream_pairs_bare_and_instrumented_calls() -> None:
    from stepwatch.bench.stream import measure

    r = measure(rounds=2, steps=2)
    assert r["chunks"] == 4 and r["rounds"] == 2
    assert r["chunk_ms_bare"] > 0 and r["chunk_ms_instrumented"] > 0
    assert r["ci95"][0] <= r["ratio"] <= r["ci95"][1]
    assert r["kv_bytes"] == r["kv_ledger_bytes"] == 43_008
    assert 0 < r["hooks_us_per_chunk"] < 1000 and r["hooks_ratio"] > 1  # timed directly: a positive cost


def test_uninstrument_puts_encode_kv_cache_back(far: Any) -> None:
    original = far.encode_kv_cache
    instrument(far, registry=CollectorRegistry())
    assert far.encode_kv_cache != original
    assert uninstrument(far)
    assert "encode_kv_cache" not in far.__dict__ and far.encode_kv_cache == original


def test_an_image_pipeline_has_no_stream_series() -> None:
    reg = CollectorRegistry()
    pipe = build_pipeline("flux", seed=0)
    instrument(pipe, registry=reg)
    text = scrape(reg)
    assert [m.name for m in METRICS if m.owner == "stream"]
    assert not [name for name, _ in text if name.startswith("stepwatch_stream_")]
    assert [name for name, _ in text if name.startswith("stepwatch_pipeline_")]


def test_index_ranges_are_bounded() -> None:
    labels = {chunks.index_range(i) for i in range(10_000)}
    assert labels == {"0", "1", "2-3", "4-7", "8-15", "16+"}


def test_chunked_pipelines_on_one_registry_add_to_the_same_kv_gauges() -> None:
    """Two session slots (two pipelines, one registry): each call's cache counts once in the worker's gauges."""
    from stepwatch.metrics import MetricSet

    reg = CollectorRegistry()
    ms = MetricSet.shared(reg, "stream")
    a, b = chunks.StreamPublisher.shared(ms), chunks.StreamPublisher.shared(ms)
    assert a is b
    a.live(1, 43_008, 30_000, 43_008)
    b.live(2, 86_016, 10_000, 86_016)
    text = scrape(reg)
    assert value(text, "stepwatch_stream_kv_cache_bytes", state="allocated") == 129_024
    assert value(text, "stepwatch_stream_kv_cache_ledger_bytes") == 129_024
    a.done(1)
    assert value(scrape(reg), "stepwatch_stream_kv_cache_bytes", state="in_use") == 10_000
