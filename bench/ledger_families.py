"""Tiny pipelines of eight diffusers families, built offline, for the ledger's check (``bench/ledger.py``).

Each is the family's real pipeline class around its real transformer class at a tiny config (random weights
from a fixed seed).  Text arrives as ``prompt_embeds`` (and their masks where the family takes them), so no
family needs its own text encoder or tokenizer, and the output stays a latent (``output_type="latent"``):
the ledger counts the transformer only, so the encoders and the VAE would add minutes and check nothing.
The pipelines still compute their latents their own way (the VAE compression they expose, resolution
binning, frame compression, packing), which is what the ledger must read right.

Each family says how its call turns CFG on: batched (one call on a doubled batch: SD3, PixArt, Sana, LTX,
CogVideoX) or true (two calls: FLUX's ``true_cfg_scale`` with a negative prompt, Wan, QwenImage).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import diffusers
import torch

SEED = 0
TEXT_TOKENS = 16


@dataclass(frozen=True)
class Family:
    name: str
    pipeline: str
    cfg_kind: str  # "batched" or "true"
    build: Callable[[], Any]
    call: Callable[[bool], dict[str, Any]]  # the call's arguments with CFG on or off
    size: tuple[int, int, int | None]  # height, width, frames (None: an image) the request asks for


def _embeds(dim: int, n: int = TEXT_TOKENS, *, mask: str | None = None, negative: bool = True) -> dict[str, Any]:
    """Prompt embeddings (and their masks under the family's name for them), seeded, batch 1."""
    g = torch.Generator().manual_seed(SEED)
    out: dict[str, Any] = {"prompt_embeds": torch.randn(1, n, dim, generator=g)}
    if negative:  # a family's default negative prompt ("") and its embeddings may not both be given
        out.update(negative_prompt=None, negative_prompt_embeds=torch.randn(1, n, dim, generator=g))
    if mask is not None:
        out[mask] = torch.ones(1, n, dtype=torch.long)
        if negative:
            out[f"negative_{mask}"] = torch.ones(1, n, dtype=torch.long)
    return out


def _seeded(build: Callable[[], Any]) -> Any:
    torch.manual_seed(SEED)
    t = build()
    t.eval().requires_grad_(False)
    return t


def _finish(pipe: Any) -> Any:
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pixart() -> Any:
    t = _seeded(lambda: diffusers.PixArtTransformer2DModel(
        sample_size=32, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=3, caption_channels=32,
        in_channels=4, cross_attention_dim=24, out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6))
    return _finish(diffusers.PixArtSigmaPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=t,
                                                 scheduler=diffusers.DPMSolverMultistepScheduler()))


def _sana() -> Any:
    t = _seeded(lambda: diffusers.SanaTransformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=2, num_attention_heads=2, attention_head_dim=8,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=16,
        sample_size=16))
    return _finish(diffusers.SanaPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=t,
                                          scheduler=diffusers.FlowMatchEulerDiscreteScheduler()))


def _ltx() -> Any:
    t = _seeded(lambda: diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=8,
        cross_attention_dim=32, num_layers=2, caption_channels=16))
    return _finish(diffusers.LTXPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=None,
                                         text_encoder=None, tokenizer=None, transformer=t))


def _cogvideox() -> Any:
    t = _seeded(lambda: diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=16, num_layers=2, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=TEXT_TOKENS))
    return _finish(diffusers.CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=t,
                                               scheduler=diffusers.CogVideoXDDIMScheduler()))


def _qwenimage() -> Any:
    t = _seeded(lambda: diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=3,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4)))
    return _finish(diffusers.QwenImagePipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=None,
                                               text_encoder=None, tokenizer=None, transformer=t))


def _practice(family: str) -> Callable[[], Any]:
    def build() -> Any:
        from stepwatch.service.pipeline import build_pipeline

        return build_pipeline(family, seed=SEED)
    return build


def _flux_call(cfg: bool) -> dict[str, Any]:
    """FLUX embeds its guidance; CFG is true CFG: a negative prompt and ``true_cfg_scale`` > 1."""
    return {"prompt": "w1 w2 w3", "negative_prompt": "w4" if cfg else None, "true_cfg_scale": 4.0 if cfg else 1.0,
            "max_sequence_length": TEXT_TOKENS}


def _guided(extra: dict[str, Any]) -> Callable[[bool], dict[str, Any]]:
    def call(cfg: bool) -> dict[str, Any]:
        return {"guidance_scale": 5.0 if cfg else 1.0, **extra}
    return call


def _qwen_call(cfg: bool) -> dict[str, Any]:
    args = _embeds(16, mask="prompt_embeds_mask", negative=cfg)
    return {**args, "true_cfg_scale": 4.0 if cfg else 1.0}


FAMILIES: tuple[Family, ...] = (
    Family("flux", "FluxPipeline", "true", _practice("flux"), _flux_call, (64, 64, None)),
    Family("sd3", "StableDiffusion3Pipeline", "batched", _practice("sd3"),
           _guided({"prompt": "w1 w2 w3", "max_sequence_length": TEXT_TOKENS}), (64, 64, None)),
    Family("wan", "WanPipeline", "true", _practice("wan"),
           _guided({"prompt": "w1 w2 w3", "max_sequence_length": TEXT_TOKENS}), (64, 64, 9)),
    Family("pixart-sigma", "PixArtSigmaPipeline", "batched", _pixart,
           _guided(_embeds(32, mask="prompt_attention_mask")), (64, 64, None)),
    Family("sana", "SanaPipeline", "batched", _sana, _guided(_embeds(16, mask="prompt_attention_mask")),
           (64, 64, None)),
    Family("ltx-video", "LTXPipeline", "batched", _ltx, _guided(_embeds(16, mask="prompt_attention_mask")),
           (128, 128, 9)),
    Family("cogvideox", "CogVideoXPipeline", "batched", _cogvideox, _guided(_embeds(16)), (64, 64, 9)),
    Family("qwenimage", "QwenImagePipeline", "true", _qwenimage, _qwen_call, (64, 64, None)),
)
