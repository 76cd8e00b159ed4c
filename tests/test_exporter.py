"""The exporter on a real offline FLUX pipeline: values read back from /metrics."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch

from stepwatch.exporter import OTHER, InstrumentOptions, instrument, uninstrument
from tests.promtext import absent, scrape, total, value


def gen(pipe: Any, hw: int = 256, steps: int = 4, seed: int = 0, **kw: Any) -> Any:
    return pipe("w1 w2 w3", height=hw, width=hw, num_inference_steps=steps, max_sequence_length=32,
                output_type="np", generator=torch.Generator().manual_seed(seed), **kw)


def test_steps_stages_and_shape_labels(clean_flux: Any, registry: Any) -> None:
    pipe = clean_flux
    inst = instrument(pipe, registry=registry, shapes=["256x256_4s", "256x256_6s"])
    gen(pipe, steps=4)
    gen(pipe, steps=6)
    gen(pipe, steps=6)
    gen(pipe, hw=512, steps=4)
    big = inst.last_report
    gen(pipe, hw=128, steps=3)  # not on the allowlist
    data = scrape(registry)
    assert value(data, "stepwatch_pipeline_step_duration_seconds_count", shape="256x256_4s") == 4
    assert value(data, "stepwatch_pipeline_step_duration_seconds_count", shape="256x256_6s") == 12
    assert value(data, "stepwatch_pipeline_step_duration_seconds_count", shape=OTHER) == 4 + 3
    assert value(data, "stepwatch_pipeline_requests_total", shape="256x256_6s", outcome="ok") == 2
    assert value(data, "stepwatch_pipeline_requests_total", shape=OTHER, outcome="ok") == 2
    for stage in ("text_encode", "denoise", "vae_decode"):
        assert value(data, "stepwatch_pipeline_stage_duration_seconds_count", shape="256x256_4s", stage=stage) == 1
    r = inst.last_report
    assert r is not None and r.shape is not None
    assert str(r.shape) == "128x128_3s" and r.shape_label == OTHER
    assert r.stages["denoise"] == pytest.approx(sum(r.step_seconds), rel=1e-6)
    assert r.cfg_branches == 1
    # At 512^2 the three stages are nearly all of the request (the rest: latents prep, postprocess).
    assert big is not None
    stage_sum = sum(big.stages.values())
    assert 0.85 * big.seconds <= stage_sum <= big.seconds, (big.stages, big.seconds)


def test_cfg_counts_branches(clean_flux: Any, registry: Any) -> None:
    inst = instrument(clean_flux, registry=registry)
    gen(clean_flux, negative_prompt="w9", true_cfg_scale=4.0)
    r = inst.last_report
    assert r is not None and r.cfg_branches == 2 and r.shape_label == "256x256_4s_cfg"
    data = scrape(registry)
    assert value(data, "stepwatch_pipeline_step_duration_seconds_count", shape="256x256_4s_cfg") == 4
    assert value(data, "stepwatch_pipeline_cfg_branches", shape="256x256_4s_cfg") == 2


def test_unbounded_shapes_fold_into_other(clean_flux: Any, registry: Any) -> None:
    instrument(clean_flux, registry=registry, max_shapes=2)
    for hw in (64, 96, 128, 160):
        gen(clean_flux, hw=hw, steps=2)
    data = scrape(registry)
    shapes = {dict(ls)["shape"] for (n, ls) in data if n == "stepwatch_pipeline_requests_total"}
    assert shapes == {"64x64_2s", "96x96_2s", OTHER}
    assert value(data, "stepwatch_pipeline_requests_total", shape=OTHER, outcome="ok") == 2


def test_first_block_cache_hits_match_hook_decisions(clean_flux: Any, registry: Any) -> None:
    from stepwatch.service.cache import apply_cache

    pipe = clean_flux
    apply_cache(pipe, "first_block_cache", 1.0)
    # Spy on the hook's own decisions, independently of the exporter.
    hook = next(m._diffusers_hook.hooks["fbc_leader_block_hook"] for m in pipe.transformer.modules()
                if "fbc_leader_block_hook" in getattr(getattr(m, "_diffusers_hook", None), "hooks", {}))
    inner = hook._should_compute_remaining_blocks
    own: list[bool] = []

    def spy(residual: Any) -> bool:
        decision = inner(residual)
        own.append(bool(decision))
        return decision

    hook._should_compute_remaining_blocks = spy
    inst = instrument(pipe, registry=registry)
    steps = 8
    for seed in range(3):
        gen(pipe, steps=steps, seed=seed)
    data = scrape(registry)
    hits = value(data, "stepwatch_cache_decisions_total", shape="256x256_8s", cache="first_block_cache",
                 decision="hit")
    misses = value(data, "stepwatch_cache_decisions_total", shape="256x256_8s", cache="first_block_cache",
                   decision="miss")
    assert len(own) == 3 * steps
    assert hits == own.count(False) and misses == own.count(True)
    assert hits > 0
    # Never at the first or the last step, per request.
    for i in range(3):
        per_req = own[i * steps:(i + 1) * steps]
        assert per_req[0] and per_req[-1]
    assert value(data, "stepwatch_cache_hit_position_ratio_count") == hits
    # Positions are step/steps: none in the first decile bucket, all below 1.
    assert value(data, "stepwatch_cache_hit_position_ratio_bucket", le="0.1") == 0
    assert value(data, "stepwatch_cache_hit_position_ratio_bucket", le="0.9") == hits
    r = inst.last_report
    assert r is not None and r.cache == "first_block_cache"
    assert [not h for _, _, h in r.cache_decisions] == own[-steps:]


@pytest.mark.parametrize("kind,value_", [("mag_cache", 0.5), ("taylorseer", 2)])
def test_other_cache_hooks_are_read(clean_flux: Any, registry: Any, kind: str, value_: float) -> None:
    from stepwatch.service.cache import apply_cache

    apply_cache(clean_flux, kind, value_, steps=8)
    inst = instrument(clean_flux, registry=registry)
    gen(clean_flux, steps=8)
    r = inst.last_report
    assert r is not None and r.cache == kind
    assert len(r.cache_decisions) == 8
    assert r.hits > 0 and r.cache_decisions[0][2] is False
    data = scrape(registry)
    assert total(data, "stepwatch_cache_decisions_total", cache=kind, decision="hit") == r.hits


def test_uninstrument_restores_bit_identical_outputs(clean_flux: Any, registry: Any) -> None:
    from stepwatch.service.pipeline import build_pipeline

    never = build_pipeline("flux", seed=0)
    ref = gen(never, seed=3).images
    inst = instrument(clean_flux, registry=registry)
    assert instrument(clean_flux, registry=registry) is inst  # idempotent
    during = gen(clean_flux, seed=3).images
    assert uninstrument(clean_flux) is True
    assert uninstrument(clean_flux) is False
    after = gen(clean_flux, seed=3).images
    assert np.array_equal(ref, during) and np.array_equal(ref, after)
    assert type(clean_flux) is type(never)
    for obj, attr in ((clean_flux, "encode_prompt"), (clean_flux.scheduler, "step"),
                      (clean_flux.scheduler, "set_timesteps"), (clean_flux.vae, "decode"),
                      (clean_flux.transformer, "cache_context")):
        assert attr not in vars(obj), attr
    assert "_stepwatch" not in vars(clean_flux)


def test_hook_errors_never_reach_the_pipeline(clean_flux: Any, registry: Any, caplog: Any) -> None:
    inst = instrument(clean_flux, registry=registry)
    ref = gen(clean_flux, seed=1).images

    def boom(*a: Any, **k: Any) -> None:
        raise RuntimeError("injected")

    inst._denoise_start = boom  # type: ignore[method-assign]
    inst._stage_enter = boom  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="stepwatch.exporter"):
        out1 = gen(clean_flux, seed=1).images
        out2 = gen(clean_flux, seed=1).images
    assert np.array_equal(ref, out1) and np.array_equal(ref, out2)
    data = scrape(registry)
    assert value(data, "stepwatch_exporter_errors_total", component="scheduler.set_timesteps") == 2
    assert value(data, "stepwatch_exporter_errors_total", component="te.enter") == 2  # one encode per call
    assert value(data, "stepwatch_exporter_errors_total", component="vae.enter") == 2
    logged = [r for r in caplog.records if "scheduler.set_timesteps" in r.getMessage()]
    assert len(logged) == 1  # logged once, counted every time


def test_request_begin_failure_is_guarded(clean_flux: Any, registry: Any) -> None:
    inst = instrument(clean_flux, registry=registry)

    def boom(*a: Any, **k: Any) -> None:
        raise ValueError("begin broke")

    inst._begin = boom  # type: ignore[method-assign]
    out = gen(clean_flux)
    assert out.images.shape == (1, 256, 256, 3)
    assert value(scrape(registry), "stepwatch_exporter_errors_total", component="request.begin") == 1


def test_pipeline_exceptions_pass_through_unchanged(clean_flux: Any, registry: Any) -> None:
    instrument(clean_flux, registry=registry)
    with pytest.raises(ValueError) as err:
        clean_flux("w1", height=256, width=256, num_inference_steps=2, max_sequence_length=32, output_type="np",
                   prompt_embeds=torch.zeros(1, 4, 32))  # both prompt and embeds: diffusers refuses
    assert "prompt" in str(err.value)
    data = scrape(registry)
    assert total(data, "stepwatch_pipeline_requests_total", outcome="error") == 1
    # The next call is clean.
    gen(clean_flux)
    assert total(scrape(registry), "stepwatch_pipeline_requests_total", outcome="ok") == 1


def test_ledger_and_mfu(clean_flux: Any, registry: Any) -> None:
    peak = 1e11
    inst = instrument(clean_flux, registry=registry, peak_flops=peak)
    gen(clean_flux, hw=256, steps=4)
    r = inst.last_report
    assert r is not None and r.step_flops is not None and r.mfu is not None
    lm = inst._ledger
    # Three blocks of width 32, all attending over one joint sequence; 256^2 is 16 x 16 packed tokens.
    assert lm is not None and lm.family == "flux" and dict(lm.attention) == {"joint": 3 * 32}
    n_img, n_txt = (256 // 16) ** 2, 32
    w = lm.weights
    expected = (2 * (w["img"] * n_img + w["txt"] * n_txt + w["joint"] * (n_img + n_txt) + w["once"])
                + 4 * 3 * 32 * (n_img + n_txt) ** 2)
    assert r.step_flops == pytest.approx(expected)
    mean_step = sum(r.step_seconds) / len(r.step_seconds)
    assert r.mfu == pytest.approx(expected / mean_step / peak)
    data = scrape(registry)
    assert value(data, "stepwatch_ledger_step_flops", shape="256x256_4s") == pytest.approx(expected)
    assert value(data, "stepwatch_ledger_flops_total", shape="256x256_4s") == pytest.approx(4 * expected)
    assert value(data, "stepwatch_device_peak_flops_per_second", device="cpu") == peak


def test_ledger_matches_the_seeds_for_flux_dev() -> None:
    from diffusers import FluxTransformer2DModel

    from stepwatch.exporter.ledger import ledger_model, mfu, peak_flops_for

    with torch.device("meta"):
        t = FluxTransformer2DModel(guidance_embeds=True)  # FLUX.1-dev's config
    lm = ledger_model(t)
    assert dict(lm.attention) == {"joint": 57 * 3072}
    # P_tok, the weights an image token passes through: its own stream's and the single blocks' (joint).
    assert lm.weights["img"] + lm.weights["joint"] == pytest.approx(6.45e9, rel=0.01)
    assert lm.tokens(1024, 1024, None, 8, 4) == 4096
    assert lm.forward_flops(4096, 512) == pytest.approx(74.3e12, rel=0.01)
    assert peak_flops_for("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for("Some CPU") is None
    # Seeds: compiled FLUX at 1024^2 on an H100 reaches MFU ~0.49 -> ~0.31 s per CFG-free step.
    assert mfu(74.3e12, 74.3e12 / (0.49 * 989e12), 989e12) == pytest.approx(0.49)


def test_memory_gauges(clean_flux: Any, registry: Any) -> None:
    inst = instrument(clean_flux, registry=registry)
    gen(clean_flux, hw=512)
    r = inst.last_report
    assert r is not None
    data = scrape(registry)
    cap = value(data, "stepwatch_memory_capacity_bytes", device="cpu")
    req_peak = value(data, "stepwatch_memory_peak_bytes", device="cpu", stage="request")
    assert cap > 0 and 0 < req_peak <= cap
    for stage in ("text_encode", "denoise", "vae_decode"):
        assert 0 < value(data, "stepwatch_memory_peak_bytes", device="cpu", stage=stage) <= req_peak
    assert req_peak == max(v for k, v in r.memory_peak_bytes.items())
    assert value(data, "stepwatch_memory_peak_ratio_count", device="cpu") == 1
    assert value(data, "stepwatch_memory_peak_ratio_sum", device="cpu") == pytest.approx(req_peak / cap)


def test_wan_video_family(wan_pipe: Any, registry: Any) -> None:
    from stepwatch.service.cache import apply_cache

    apply_cache(wan_pipe, "first_block_cache", 0.2)
    inst = instrument(wan_pipe, registry=registry)
    try:
        out = wan_pipe("w1 w2", negative_prompt="w3", height=128, width=128, num_frames=9, num_inference_steps=4,
                       guidance_scale=5.0, max_sequence_length=32, output_type="np")
    finally:
        uninstrument(wan_pipe)
        apply_cache(wan_pipe, "none")
    assert out.frames.shape == (1, 9, 128, 128, 3)
    r = inst.last_report
    assert r is not None and r.shape_label == "128x128x9_4s_cfg" and r.cfg_branches == 2
    assert len(r.step_seconds) == 4 and set(r.stages) == {"text_encode", "denoise", "vae_decode"}
    assert r.cache == "first_block_cache" and len(r.cache_decisions) == 8
    assert {b for _, b, _ in r.cache_decisions} == {"cond", "uncond"}
    lm = inst._ledger
    assert lm is not None and lm.family == "wan" and set(lm.attention) == {"self", "cross"}
    # 9 frames -> 3 latent frames; 128/16 = 8 -> 3*8*8 = 192 tokens, 32 text tokens by cross-attention.
    assert r.step_flops == pytest.approx(2 * lm.forward_flops(192, 32))
    data = scrape(registry)
    assert value(data, "stepwatch_pipeline_step_duration_seconds_count", shape="128x128x9_4s_cfg") == 4


def _span_exporter() -> tuple[Any, Any]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, provider


def test_spans_follow_the_genai_conventions(clean_flux: Any, registry: Any) -> None:
    from stepwatch import __version__

    exporter, provider = _span_exporter()
    instrument(clean_flux, registry=registry, tracer_provider=provider)
    gen(clean_flux, steps=5)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"generate_content FluxPipeline", "diffusion.text_encode", "diffusion.denoise",
                          "diffusion.vae_decode"}
    root = spans["generate_content FluxPipeline"]
    assert root.instrumentation_scope.name == "stepwatch.exporter"
    assert root.instrumentation_scope.version == __version__
    a = root.attributes
    assert (a["gen_ai.operation.name"], a["gen_ai.provider.name"], a["gen_ai.request.model"]) == (
        "generate_content", "diffusers", "FluxPipeline")
    assert a["gen_ai.output.type"] == "image" and a["gen_ai.request.seed"] == 0
    assert a["stepwatch.shape"] == "256x256_5s" and a["stepwatch.ledger.step_flops"] > 0
    assert "error.type" not in a and not [e for e in root.events if e.name == "exception"]
    for name in ("diffusion.text_encode", "diffusion.denoise", "diffusion.vae_decode"):
        child = spans[name]
        assert child.parent is not None and child.parent.span_id == root.context.span_id
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time
        assert child.attributes["stepwatch.stage"] == name.split(".")[1]
        assert child.attributes["stepwatch.stage.seconds"] == pytest.approx((child.end_time - child.start_time) / 1e9,
                                                                             abs=1e-6)
        assert child.attributes["stepwatch.memory.peak_bytes"] > 0
    assert spans["diffusion.denoise"].attributes["stepwatch.steps"] == 5
    events = [e for e in root.events if e.name == "step"]
    assert [e.attributes["stepwatch.step.index"] for e in events] == [0, 1, 2, 3, 4]


def test_a_failed_request_span_has_an_error_type_and_an_exception_event(clean_flux: Any, registry: Any) -> None:
    from opentelemetry.trace import StatusCode

    exporter, provider = _span_exporter()
    instrument(clean_flux, registry=registry, tracer_provider=provider)

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("the scheduler broke")

    with pytest.raises(ValueError):
        gen(clean_flux, steps=3, callback_on_step_end=boom)
    root = next(s for s in exporter.get_finished_spans() if s.name.startswith("generate_content"))
    assert root.attributes["error.type"] == "ValueError" and root.status.status_code is StatusCode.ERROR
    event = next(e for e in root.events if e.name == "exception")
    assert event.attributes["exception.type"] == "ValueError"
    assert event.attributes["exception.message"] == "the scheduler broke"


def test_a_model_directory_names_the_span_by_its_last_part() -> None:
    from types import SimpleNamespace

    from stepwatch.exporter.spans import model_name, request_attributes

    assert model_name(SimpleNamespace(name_or_path="/srv/models/FLUX.1-dev/")) == "FLUX.1-dev"
    assert model_name(SimpleNamespace(config={"_name_or_path": "black-forest-labs/FLUX.1-schnell"})) == \
        "FLUX.1-schnell"
    assert model_name(SimpleNamespace(name_or_path="")) == "SimpleNamespace"
    attrs = request_attributes("wan", {"num_videos_per_prompt": 2, "generator": [torch.Generator().manual_seed(7)]},
                               video=True)
    assert attrs["gen_ai.output.type"] == "video" and attrs["gen_ai.request.choice.count"] == 2
    assert attrs["gen_ai.request.seed"] == 7


def test_no_spans_without_an_sdk(clean_flux: Any, registry: Any) -> None:
    from opentelemetry import trace

    from stepwatch.exporter import spans

    # No SDK configured: the global provider is the API's default (a proxy to a no-op), and the exporter's
    # tracer resolves to nothing, so no span is built.
    assert isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))
    tracer = spans.make_tracer(None)
    assert isinstance(tracer, spans._LazyTracer) and tracer.get() is None
    inst = instrument(clean_flux, registry=registry)
    gen(clean_flux)
    data = scrape(registry)
    assert value(data, "stepwatch_pipeline_requests_total", shape="256x256_4s", outcome="ok") == 1
    assert total(data, "stepwatch_exporter_errors_total") == 0  # emit.spans (or anything else) never failed
    assert inst.last_report is not None and inst.last_report.outcome == "ok"


def test_baselines_are_published(clean_flux: Any, registry: Any, tmp_path: Any) -> None:
    f = tmp_path / "baselines.yaml"
    f.write_text("shapes:\n  1024x1024_4s: {step_seconds: 0.35, cache_hit_ratio: 0.4}\n")
    inst = instrument(clean_flux, registry=registry, baselines=str(f))
    data = scrape(registry)
    assert value(data, "stepwatch_baseline_step_duration_seconds", shape="1024x1024_4s") == 0.35
    assert value(data, "stepwatch_baseline_cache_hit_ratio", shape="1024x1024_4s") == 0.4
    with pytest.raises(ValueError, match="bad shape key"):
        inst.set_baselines({"shapes": {"huge": {"step_seconds": 1}}})


def test_deferred_device_timings_resolve_after_the_request(clean_flux: Any, registry: Any) -> None:
    """A device clock whose marks complete later (as CUDA events do) is resolved off the request path."""
    import threading

    gate = threading.Event()

    class DeferredClock:
        device_kind = "fake"

        def mark(self) -> float:
            import time

            return time.perf_counter()

        def seconds(self, a: float, b: float) -> float:
            return b - a

        def ready(self, m: float) -> bool:
            return gate.is_set()

        def host(self, m: float) -> float:
            return m

    inst = instrument(clean_flux, InstrumentOptions(registry=registry, clock=DeferredClock()))
    gen(clean_flux)
    assert inst.last_report is None  # not resolved: the "device" has not finished
    # Not counted yet: no request series at all until the timings resolve.
    assert total(scrape(registry), "stepwatch_pipeline_requests_total") == 0
    assert absent(scrape(registry), "stepwatch_pipeline_requests_total", shape="256x256_4s", outcome="ok")
    gate.set()
    import time

    deadline = time.time() + 5
    while inst.last_report is None and time.time() < deadline:
        time.sleep(0.01)
    assert inst.last_report is not None
    assert value(scrape(registry), "stepwatch_pipeline_requests_total", shape="256x256_4s", outcome="ok") == 1
