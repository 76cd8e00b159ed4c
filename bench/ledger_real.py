"""The ledger of the published configs, on the meta device (no weights), at a representative shape.

``stepwatch bench ledger --real`` prints one forward's FLOPs per family beside the seeds' own figures where they
give one (seed 000: FLUX.1-dev at 1024^2, 74.3 TFLOP per step; Wan2.1-14B at 720p x 81 frames, 6.5 PFLOP per
step of which 4.7 attention, 72%).  Each config is the transformer class's defaults where those are the
published flagship (FLUX.1-dev, Wan2.1-14B, Sana 1600M, LTX-Video 2B, CogVideoX-2b, Qwen-Image), else the
published values written here (SD3-medium, PixArt-Sigma-XL-2-1024).  Tokens come from the size over the
published VAE compression (spatial, temporal) and the model's patch; the text length is the family's usual
padded prompt.  One sample, one CFG branch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RealConfig:
    model: str
    transformer: str
    overrides: dict[str, Any] = field(default_factory=dict)
    size: tuple[int, int, int | None] = (1024, 1024, None)
    vae: tuple[int, int] = (8, 4)  # spatial, temporal compression
    text_tokens: int = 512
    seed_flops: float | None = None  # the seeds' figure for one forward at this shape
    seed_attention_share: float | None = None


_PIXART_SIGMA = {"caption_channels": 4096, "cross_attention_dim": 1152, "norm_type": "ada_norm_single",
                 "num_embeds_ada_norm": 1000, "out_channels": 8, "attention_bias": True,
                 "activation_fn": "gelu-approximate", "norm_elementwise_affine": False, "norm_eps": 1e-6}
_SD3_MEDIUM = {"num_layers": 24, "num_attention_heads": 24, "caption_projection_dim": 1536,
               "pos_embed_max_size": 192}

REAL_CONFIGS: tuple[RealConfig, ...] = (
    RealConfig("FLUX.1-dev", "FluxTransformer2DModel", {"guidance_embeds": True}, seed_flops=74.3e12),
    RealConfig("SD3-medium", "SD3Transformer2DModel", _SD3_MEDIUM, text_tokens=77 + 256),
    RealConfig("Wan2.1-T2V-14B", "WanTransformer3DModel", size=(720, 1280, 81), seed_flops=6.5e15,
               seed_attention_share=0.72),
    RealConfig("PixArt-Sigma-XL-2-1024", "PixArtTransformer2DModel", _PIXART_SIGMA, text_tokens=300),
    RealConfig("Sana-1600M-1024", "SanaTransformer2DModel", vae=(32, 1), text_tokens=300),
    RealConfig("LTX-Video-2B", "LTXVideoTransformer3DModel", size=(512, 768, 121), vae=(32, 8), text_tokens=128),
    RealConfig("CogVideoX-2b", "CogVideoXTransformer3DModel", size=(480, 720, 49), text_tokens=226),
    RealConfig("Qwen-Image", "QwenImageTransformer2DModel", text_tokens=256),
)


def real_row(rc: RealConfig) -> dict[str, Any]:
    import diffusers
    import torch

    from stepwatch.exporter.ledger import ledger_model

    # The class first, outside the meta device: its lazy import would make module-level tensors (MagCache's
    # ratios) meta tensors for the rest of the process.
    cls = getattr(diffusers, rc.transformer)
    with torch.device("meta"):
        transformer = cls(**rc.overrides)
    lm = ledger_model(transformer)
    assert lm is not None, rc.transformer  # every family here is a transformer
    h, w, frames = rc.size
    n_img = lm.tokens(h, w, frames, *rc.vae)
    flops = lm.forward_flops(n_img, rc.text_tokens)
    attention = lm.attention_flops(n_img, rc.text_tokens)
    params = sum(p.numel() for p in transformer.parameters())
    return {"model": rc.model, "params": params, "size": f"{h}x{w}{f'x{frames}' if frames else ''}",
            "image_tokens": n_img, "text_tokens": rc.text_tokens, "ledger_flops": flops,
            "attention_share": round(attention / flops, 3), "seed_flops": rc.seed_flops,
            "seed_attention_share": rc.seed_attention_share,
            "vs_seed": round(flops / rc.seed_flops, 3) if rc.seed_flops else None}


def real_configs() -> list[dict[str, Any]]:
    return [real_row(rc) for rc in REAL_CONFIGS]


def show(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'model':<24}{'params':>8}  {'size':<14}{'tokens':>8}{'TFLOP/fwd':>11}{'attn':>7}  seeds")
    for r in rows:
        seed = ""
        if r["seed_flops"]:
            seed = f"{r['seed_flops'] / 1e12:.1f} TFLOP (x{r['vs_seed']:.3f})"
            if r["seed_attention_share"]:
                seed += f", attention {r['seed_attention_share']:.0%}"
        print(f"{r['model']:<24}{r['params'] / 1e9:>7.2f}B  {r['size']:<14}{r['image_tokens']:>8}"
              f"{r['ledger_flops'] / 1e12:>11.1f}{r['attention_share']:>7.0%}  {seed}")
