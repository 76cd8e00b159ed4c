"""Exporter edge cases on the real FLUX pipeline: re-instrumenting, skipped stages, learned shapes, compiled
transformers."""

from __future__ import annotations

from typing import Any

import torch

from stepwatch.exporter import instrument, uninstrument
from tests.promtext import scrape, value


def gen(pipe: Any, hw: int = 256, steps: int = 4, **kw: Any) -> Any:
    kw.setdefault("output_type", "np")
    return pipe("w1 w2 w3", height=hw, width=hw, num_inference_steps=steps, max_sequence_length=32,
                generator=torch.Generator().manual_seed(0), **kw)


def test_instrument_again_on_the_same_registry_keeps_counting(clean_flux: Any, registry: Any) -> None:
    first = instrument(clean_flux, registry=registry)
    gen(clean_flux)
    uninstrument(clean_flux)
    second = instrument(clean_flux, registry=registry)  # prometheus_client would refuse a second registration
    gen(clean_flux)
    assert second is not first and second.metrics is first.metrics
    assert value(scrape(registry), "stepwatch_pipeline_requests_total", shape="256x256_4s", outcome="ok") == 2


def test_a_skipped_stage_reads_zero_not_the_previous_peak(clean_flux: Any, registry: Any) -> None:
    instrument(clean_flux, registry=registry)
    gen(clean_flux)
    assert value(scrape(registry), "stepwatch_memory_peak_bytes", device="cpu", stage="vae_decode") > 0
    gen(clean_flux, output_type="latent")  # no VAE decode in this request
    data = scrape(registry)
    assert value(data, "stepwatch_memory_peak_bytes", device="cpu", stage="vae_decode") == 0
    assert value(data, "stepwatch_memory_peak_bytes", device="cpu", stage="denoise") > 0


def test_a_learned_shape_gets_zeroed_event_counters(clean_flux: Any, registry: Any) -> None:
    instrument(clean_flux, registry=registry)  # no allowlist: shapes are learned as they come
    gen(clean_flux, hw=192, steps=3)
    data = scrape(registry)
    assert value(data, "stepwatch_oom_total", shape="192x192_3s", stage="vae_decode") == 0
    assert value(data, "stepwatch_compile_total", shape="192x192_3s", phase="serving") == 0


def test_a_compiled_transformer_still_feeds_the_ledger(clean_flux: Any, registry: Any) -> None:
    original = clean_flux.transformer
    clean_flux.transformer = torch.compile(original, backend="eager")
    try:
        inst = instrument(clean_flux, registry=registry)
        gen(clean_flux)
        r = inst.last_report
        assert r is not None and r.step_flops is not None and r.step_flops > 0
        assert value(scrape(registry), "stepwatch_ledger_step_flops", shape="256x256_4s") == r.step_flops
        # The wrapper's class is swapped, the module it wraps is untouched (its setattr forwards: none is used).
        assert type(clean_flux.transformer).__name__ == "OptimizedModule" and type(original).__name__ == \
            "FluxTransformer2DModel" and not hasattr(type(original), "_stepwatch_original_class")
        uninstrument(clean_flux)
        assert not hasattr(type(clean_flux.transformer), "_stepwatch_original_class")
    finally:
        uninstrument(clean_flux)
        clean_flux.transformer = original
        torch._dynamo.reset()


def test_a_removed_component_is_let_go(clean_flux: Any, registry: Any) -> None:
    instrument(clean_flux, registry=registry)
    gen(clean_flux)
    old = clean_flux.vae
    assert "decode" in old.__dict__  # patched on the instance
    clean_flux.vae = None
    try:
        gen(clean_flux, output_type="latent")  # runs without a VAE
        assert "decode" not in old.__dict__  # unpatched: nothing of ours keeps the old weights alive
        data = scrape(registry)
        assert value(data, "stepwatch_pipeline_requests_total", shape="256x256_4s", outcome="ok") == 2
    finally:
        uninstrument(clean_flux)
        clean_flux.vae = old
