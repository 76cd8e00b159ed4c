"""The exporter on diffusers families that run CFG as one transformer call on a doubled batch.

SD3 (built offline, tiny) calls no cache_context at all; LTX, Mochi and CogVideoX call one, ``cond_uncond``
(a stub here), and CogVideoX and PixArt have no ``do_classifier_free_guidance`` property.  Branches are
counted from what the transformer receives: the samples of a step's calls over the prompt batch.  The
eight families' labels, branches and ledger against FlopCounterMode: ``stepwatch bench ledger``
(tests/test_bench_ledger.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from stepwatch.bench.overhead import StubPipeline
from stepwatch.exporter import instrument, uninstrument
from stepwatch.exporter.request import (
    RequestMarks,
    ResolveContext,
    branch_count,
    cfg_hint,
    prompt_batch,
    resolve,
    usual_samples,
)
from stepwatch.exporter.shapes import ShapeLabeler
from tests.promtext import scrape, total, value

STAGES = ("text_encode", "denoise", "vae_decode")


@pytest.fixture(scope="module")
def sd3_pipe() -> Iterator[Any]:
    from stepwatch.service.pipeline import build_pipeline

    pipe = build_pipeline("sd3", seed=0)
    yield pipe
    uninstrument(pipe)


def _sd3(pipe: Any, guidance_scale: float) -> Any:
    return pipe("w1 w2 w3", height=64, width=64, num_inference_steps=3, guidance_scale=guidance_scale,
                max_sequence_length=32, output_type="np", generator=torch.Generator().manual_seed(0))


def test_sd3_counts_the_doubled_batch(sd3_pipe: Any, registry: CollectorRegistry) -> None:
    inst = instrument(sd3_pipe, registry=registry)
    try:
        out = _sd3(sd3_pipe, 5.0)
        guided = inst.last_report
        _sd3(sd3_pipe, 1.0)
        plain = inst.last_report
    finally:
        uninstrument(sd3_pipe)
    assert out.images.shape == (1, 64, 64, 3)
    assert guided is not None and guided.shape_label == "64x64_3s_cfg" and guided.cfg_branches == 2
    assert plain is not None and plain.shape_label == "64x64_3s" and plain.cfg_branches == 1
    data = scrape(registry)
    assert value(data, "stepwatch_pipeline_cfg_branches", shape="64x64_3s_cfg") == 2
    assert value(data, "stepwatch_pipeline_cfg_branches", shape="64x64_3s") == 1
    for shape in ("64x64_3s_cfg", "64x64_3s"):
        assert value(data, "stepwatch_pipeline_requests_total", shape=shape, outcome="ok") == 1
        assert value(data, "stepwatch_pipeline_step_duration_seconds_count", shape=shape) == 3
        for stage in STAGES:
            assert value(data, "stepwatch_pipeline_stage_duration_seconds_count", shape=shape, stage=stage) == 1
    # The ledger knows SD3's MMDiT: per image token its stream's Linears (q, k, v, out, ff) plus the patch
    # embedding and output projection; two joint attentions of width 32 over image + text tokens.
    lm = inst._ledger
    assert lm is not None and lm.family == "sd3" and dict(lm.attention) == {"joint": 2 * 32} and lm.patch == (1, 2, 2)
    assert lm.weights["img"] == 2 * (4 * 32 * 32 + 32 * 128 + 128 * 32) + 32 * 16 * 4 + 32 * 16 * 4
    n_img, n_txt = (64 // 16) ** 2, 77 + 32  # CLIP's padded 77 + T5's max_sequence_length, as the call received
    assert guided.step_flops is not None and plain.step_flops is not None
    one = lm.forward_flops(n_img, n_txt)
    assert value(data, "stepwatch_ledger_step_flops", shape="64x64_3s") == pytest.approx(one)
    assert value(data, "stepwatch_ledger_step_flops", shape="64x64_3s_cfg") == pytest.approx(2 * one)
    assert value(data, "stepwatch_ledger_flops_total", shape="64x64_3s_cfg") == pytest.approx(3 * 2 * one)


def test_ledger_on_sd3_5_medium_dual_attention() -> None:
    """SD3.5 Medium's attn2 is a second self-attention over the image tokens, not text cross-attention."""
    from diffusers import SD3Transformer2DModel

    from stepwatch.exporter.ledger import ledger_model

    with torch.device("meta"):
        t = SD3Transformer2DModel(
            sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
            num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
            pooled_projection_dim=2048, pos_embed_max_size=384, dual_attention_layers=tuple(range(13)),
            qk_norm="rms_norm")
    lm = ledger_model(t)
    d = 1536
    attn, ff = 4 * d * d, 2 * 4 * d * d
    assert lm.family == "sd3" and dict(lm.attention) == {"joint": 24 * d, "self": 13 * d}
    patch_io = d * 16 * 4 + 16 * 4 * d  # the patch embedding in, the output projection out
    assert lm.weights["img"] == 24 * (attn + ff) + 13 * attn + patch_io
    n_img = lm.tokens(1024, 1024, None, 8, 4)
    assert n_img == (1024 // 16) ** 2
    # The 13 second attentions are self-attention over the image tokens alone: text tokens grow only the
    # 24 joint attentions' term.
    joint_growth = 4.0 * 24 * d * ((n_img + 333) ** 2 - n_img ** 2)
    assert lm.attention_flops(n_img, 333) - lm.attention_flops(n_img, 0) == joint_growth


@pytest.mark.parametrize(("samples", "prompts", "logged", "hint", "expected"), [
    (2, 1, 2, True, 2),  # separate calls (FLUX true CFG, Wan): two calls of one sample
    (2, 1, 1, False, 2),  # one call on a doubled batch under one cache_context (LTX, Mochi)
    (2, 1, 0, False, 2),  # no cache_context at all (SD3, PixArt, CogVideoX)
    (1, 1, 0, True, 1),  # what the transformer received beats the parameters (an LCM-distilled SDXL)
    (3, 1, 1, False, 3),  # PAG with CFG: a tripled batch
    (8, 4, 0, False, 2),  # 2 prompts x 2 images per prompt, doubled
    (4, 4, 0, True, 1),
    (None, 1, 2, False, 2),  # no call seen (the hook missing): the most cache_context branches in a step
    (None, None, 0, True, 2),  # nothing seen at all (failed before its first step): the call's parameters
    (None, None, 0, False, 1),
    (2, None, 0, False, 1),  # calls seen, prompt batch unknown: falls back to the parameters
])
def test_branch_count(samples: int | None, prompts: int | None, logged: int, hint: bool, expected: int) -> None:
    assert branch_count(samples, prompts, logged, hint) == expected


def test_usual_samples_leave_a_chunks_extra_pass_out() -> None:
    assert usual_samples([]) is None
    assert usual_samples([2, 2, 3, 2, 2, 3]) == 2  # a KV-cache pass added to one step per chunk
    assert usual_samples([1, 2]) == 2  # a tie: the larger


def test_prompt_batch_from_the_call() -> None:
    assert prompt_batch({"prompt": "a cat"}) == 1
    assert prompt_batch({"prompt": ["a", "b"], "num_images_per_prompt": 3}) == 6
    assert prompt_batch({"prompt": None, "prompt_embeds": torch.zeros(2, 7, 4), "num_videos_per_prompt": 2}) == 4
    assert prompt_batch({"prompt": None}) is None
    assert prompt_batch({"prompt": "a", "num_images_per_prompt": 0}) is None


def test_a_doubled_batch_doubles_the_ledger() -> None:
    """Three steps of one cond_uncond call on a batch of 2 from one prompt: 2 branches, twice the forward."""
    req = RequestMarks(start=10.0, start_unix=1000.0, height=256, width=256, frames=None, steps_hint=3,
                       cfg_hint=False, text_tokens=32, parent_ctx=None, cache=None, denoise_start=10.4,
                       planned_steps=3, end=11.2, prompt_batch=1,
                       log=[2, "cond_uncond", 10.6, 2, "cond_uncond", 10.8, 2, "cond_uncond", 11.0])
    ctx = ResolveContext(seconds=lambda a, b: b - a, labeler=ShapeLabeler(["256x256_3s_cfg"]), device="cpu",
                         step_flops=lambda marks, samples: 4.0 * samples)
    rep = resolve(req, "serving", ctx).report
    assert rep.cfg_branches == 2 and rep.shape_label == "256x256_3s_cfg" and rep.step_flops == 8.0
    req.log = [1, "cond_uncond", 10.6, 1, "cond_uncond", 10.8, 1, "cond_uncond", 11.0]
    rep = resolve(req, "serving", ctx).report
    assert rep.cfg_branches == 1 and str(rep.shape) == "256x256_3s" and rep.step_flops == 4.0


class _BatchedCfgStub(StubPipeline):
    """CFG as one call on a doubled batch under one cache_context, and no property that says so."""

    def __init__(self) -> None:
        super().__init__()
        self._branches = ("cond_uncond",)
        self._guidance_scale = 1.0

    def latents(self) -> Any:
        return SimpleNamespace(shape=(2 if self._guidance_scale > 1 else 1, 256, 64))

    def __call__(self, prompt: str, height: int = 256, width: int = 256, num_inference_steps: int = 4,
                 guidance_scale: float = 5.0) -> Any:
        self._guidance_scale = guidance_scale
        return super().__call__(prompt, height, width, num_inference_steps)


def test_the_batch_is_read_for_the_call_just_made(registry: CollectorRegistry) -> None:
    pipe = _BatchedCfgStub()
    inst = instrument(pipe, registry=registry)
    pipe("p", num_inference_steps=3, guidance_scale=1.0)
    assert inst.last_report is not None and inst.last_report.cfg_branches == 1
    pipe("p", num_inference_steps=3)
    assert inst.last_report.cfg_branches == 2 and inst.last_report.shape_label == "256x256_3s_cfg"
    data = scrape(registry)
    assert value(data, "stepwatch_pipeline_cfg_branches", shape="256x256_3s") == 1
    assert value(data, "stepwatch_pipeline_cfg_branches", shape="256x256_3s_cfg") == 2
    assert total(data, "stepwatch_exporter_errors_total") == 0
    uninstrument(pipe)
    assert type(pipe.transformer).__name__ == "_StubTransformer"
    assert not hasattr(type(pipe.transformer), "_stepwatch_original_class")


def test_the_parameters_hint_knows_flux_guidance_is_embedded() -> None:
    """Without a logged branch or the property, the call's parameters decide.  FLUX.2 embeds guidance_scale
    (4.0 by default) and its config has no guidance_embeds: one call per step.  PixArt doubles the batch."""
    def pipe(transformer_class: str) -> Any:
        return SimpleNamespace(transformer=type(transformer_class, (), {"config": {}})())

    assert not cfg_hint(pipe("Flux2Transformer2DModel"), {"guidance_scale": 4.0})
    assert cfg_hint(pipe("PixArtTransformer2DModel"), {"guidance_scale": 4.5})
    assert not cfg_hint(pipe("PixArtTransformer2DModel"), {"guidance_scale": 1.0})


def test_a_unet_has_no_ledger_rather_than_a_wrong_one() -> None:
    """A UNet's resolution halves level by level: the per-token ledger would count every convolution at the
    latent's full size, so a UNet gets no FLOPs (and no MFU)."""
    from diffusers import UNet2DConditionModel

    from stepwatch.exporter.ledger import ledger_model

    with torch.device("meta"):
        unet = UNet2DConditionModel()
    assert ledger_model(unet) is None


def test_a_call_without_text_counts_the_requests_text_length() -> None:
    from stepwatch.exporter.ledger import LedgerModel
    from stepwatch.exporter.request import StepFlops

    model = LedgerModel("x", {"img": 10.0, "txt": 3.0}, {"cross": 4.0})
    req = RequestMarks(start=0.0, start_unix=0.0, height=64, width=64, frames=None, steps_hint=2, cfg_hint=False,
                       text_tokens=32, parent_ctx=None, cache=None, call_shape=((2, 16, 8), None))
    assert StepFlops(model)(req, 2) == 2 * model.forward_flops(16, 32)
    req.call_shape = ((2, 16, 8), 7)
    assert StepFlops(model)(req, 2) == 2 * model.forward_flops(16, 7)
