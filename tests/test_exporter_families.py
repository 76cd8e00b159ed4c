"""The exporter on diffusers families that run CFG as one transformer call on a doubled batch.

SD3 (built offline, tiny) calls no cache_context at all; LTX, Mochi and CogVideoX call one, ``cond_uncond``
(a stub here).  Their branches come from the pipeline's ``do_classifier_free_guidance``, read once per request.
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
    batch_cfg,
    branch_count,
    cfg_hint,
    resolve,
)
from stepwatch.exporter.shapes import ShapeLabeler
from tests.promtext import scrape, value

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
    # The ledger knows SD3's MMDiT: the image stream's Linears per token (q, k, v, out, ff; not the text
    # stream, not adaLN), two blocks of width 32, 2x2 patches, the text joined to the sequence.
    lm = inst._ledger
    assert lm is not None and lm.family == "sd3" and not lm.cross_attention and lm.image_attention_layers == 0
    assert (lm.layers, lm.hidden, lm.patch) == (2, 32, (1, 2, 2))
    assert lm.p_tok == 2 * (4 * (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32))
    n = (64 // 16) ** 2 + 77 + 32  # image tokens + CLIP's padded 77 + T5's max_sequence_length
    one = lm.forward_flops(n, 0)
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
    attn, ff = 4 * (d * d + d), (d * 4 * d + 4 * d) + (4 * d * d + d)
    assert (lm.family, lm.cross_attention, lm.layers, lm.hidden) == ("sd3", False, 24, d)
    assert lm.image_attention_layers == 13
    assert lm.p_tok == 24 * (attn + ff) + 13 * attn
    n_img = (1024 // 16) ** 2
    n, n_txt = lm.tokens(1024, 1024, None, 8, 4, 77 + 256)
    assert (n, n_txt) == (n_img + 333, 0)
    assert lm.forward_flops(n, n_txt, n_img) - lm.forward_flops(n, n_txt) == 4.0 * 13 * n_img * n_img * d


@pytest.mark.parametrize(("logged", "batch", "hint", "expected"), [
    (2, True, True, 2),  # separate calls seen (FLUX true CFG, Wan): the property does not double them again
    (2, None, False, 2),
    (3, True, True, 3),
    (1, True, False, 2),  # one cond_uncond call on a doubled batch (LTX, Mochi)
    (1, False, True, 1),
    (0, True, False, 2),  # no cache_context at all (SD3, SDXL)
    (0, False, True, 1),  # the pipeline's own word beats the parameters (an LCM-distilled SDXL)
    (1, None, True, 1),  # no property: what was logged
    (0, None, True, 2),  # nothing logged, no property: the call's parameters, as before
    (0, None, False, 1),
])
def test_branch_count(logged: int, batch: bool | None, hint: bool, expected: int) -> None:
    assert branch_count(logged, batch, hint) == expected


def test_a_doubled_batch_under_one_cache_context_doubles_the_ledger() -> None:
    req = RequestMarks(start=10.0, start_unix=1000.0, height=256, width=256, frames=None, steps_hint=3,
                       cfg_hint=False, text_tokens=32, parent_ctx=None, cache=None, denoise_start=10.4,
                       planned_steps=3, end=11.2, batch_cfg=True,
                       log=["cond_uncond", 10.6, "cond_uncond", 10.8, "cond_uncond", 11.0])
    ctx = ResolveContext(seconds=lambda a, b: b - a, labeler=ShapeLabeler(["256x256_3s_cfg"]), device="cpu",
                         step_flops=lambda marks, branches: 4.0 * branches)
    rep = resolve(req, "serving", ctx).report
    assert rep.cfg_branches == 2 and rep.shape_label == "256x256_3s_cfg" and rep.step_flops == 8.0
    req.batch_cfg = False
    rep = resolve(req, "serving", ctx).report
    assert rep.cfg_branches == 1 and str(rep.shape) == "256x256_3s" and rep.step_flops == 4.0


class _BatchedCfgStub(StubPipeline):
    """CFG as one call on a doubled batch under one cache_context, with the property diffusers defines."""

    def __init__(self) -> None:
        super().__init__()
        self._branches = ("cond_uncond",)
        self._guidance_scale = 1.0

    @property
    def do_classifier_free_guidance(self) -> bool:
        return self._guidance_scale > 1

    def __call__(self, prompt: str, height: int = 256, width: int = 256, num_inference_steps: int = 4,
                 guidance_scale: float = 5.0) -> Any:
        self._guidance_scale = guidance_scale
        return super().__call__(prompt, height, width, num_inference_steps)


def test_the_property_is_read_for_the_call_just_made(registry: CollectorRegistry) -> None:
    pipe = _BatchedCfgStub()
    inst = instrument(pipe, registry=registry)
    pipe("p", num_inference_steps=3, guidance_scale=1.0)
    assert inst.last_report is not None and inst.last_report.cfg_branches == 1
    pipe("p", num_inference_steps=3)
    assert inst.last_report.cfg_branches == 2 and inst.last_report.shape_label == "256x256_3s_cfg"
    data = scrape(registry)
    assert value(data, "stepwatch_pipeline_cfg_branches", shape="256x256_3s") == 1
    assert value(data, "stepwatch_pipeline_cfg_branches", shape="256x256_3s_cfg") == 2


def test_batch_cfg_is_only_the_pipelines_own_property() -> None:
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    # Bare instances (no components); the guidance a call would set goes straight into the instance dict.
    flux = FluxPipeline.__new__(FluxPipeline)  # true CFG is two logged calls: nothing to double
    flux.__dict__["_guidance_scale"] = 3.5
    assert batch_cfg(flux) is None
    sd3 = StableDiffusion3Pipeline.__new__(StableDiffusion3Pipeline)
    assert batch_cfg(sd3) is None  # never called: the property raises, read as unknown
    sd3.__dict__["_guidance_scale"] = 7.0
    assert batch_cfg(sd3) is True
    sd3.__dict__["_guidance_scale"] = 1.0
    assert batch_cfg(sd3) is False


def test_the_parameters_hint_knows_flux_guidance_is_embedded() -> None:
    """Without a logged branch or the property, the call's parameters decide.  FLUX.2 embeds guidance_scale
    (4.0 by default) and its config has no guidance_embeds: one call per step.  PixArt doubles the batch."""
    def pipe(transformer_class: str) -> Any:
        return SimpleNamespace(transformer=type(transformer_class, (), {"config": {}})())

    assert not cfg_hint(pipe("Flux2Transformer2DModel"), {"guidance_scale": 4.0})
    assert cfg_hint(pipe("PixArtTransformer2DModel"), {"guidance_scale": 4.5})
    assert not cfg_hint(pipe("PixArtTransformer2DModel"), {"guidance_scale": 1.0})
