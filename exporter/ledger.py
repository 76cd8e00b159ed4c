"""The FLOPs ledger: nominal FLOPs per denoising step, and MFU from it.

A diffusion request is compute-bound, so GPU-Util reads ~100% whether the
kernels are good or bad; only FLOPs / (seconds x peak) says how well the
device is used.  Per DiT forward:  2 * P_tok * N  +  4 * L * N^2 * d
(P_tok: parameters a token passes through; L blocks; d hidden size), plus
4 * L * N * N_txt * d for models with text cross-attention; times g CFG
branches per step (``request.branch_count``: separate calls, or the two
halves of a doubled batch).  FLUX.1 at 1024^2: P_tok 6.45e9, N 4608 -> 74.3 TFLOP.

Joint-attention models (FLUX, SD3's MMDiT) put the text tokens in N and count
the image stream's per-token weights for them too (the text stream's weights
are taken to be the same size).  SD3: N = image tokens + CLIP's 77 + T5's max_sequence_length
(``request.StepFlops``); SD3.5's dual-attention blocks (``attn2``, a second
self-attention over the image tokens only) add their weights to P_tok and
4 * L2 * N_img^2 * d.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# Dense bf16 tensor-core peaks, FLOP/s, matched against the device name (first match wins).
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("MI300X", 1307e12),
)

_BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks", "layers", "temporal_transformer_blocks")
# Linear layers a token does not pass through per token: adaLN modulation (computed once per
# sample from the timestep), the text stream of joint blocks, and cross-attention K/V (text tokens).
_NOT_PER_TOKEN = re.compile(
    r"(^|\.)(norm[^.]*|.*modulation.*|add_[qkv]_proj|to_add_out|ff_context|attn2\.to_[kv]|attn2\.add_[kv]_proj)(\.|$)"
)
# SD3's attn2 is self-attention over the image tokens (dual attention), not cross-attention: all per token.
_NOT_PER_TOKEN_SD3 = re.compile(r"(^|\.)(norm[^.]*|add_[qkv]_proj|to_add_out|ff_context)(\.|$)")


def peak_flops_for(device_name: str) -> float | None:
    for key, flops in PEAK_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None


@dataclass(frozen=True)
class LedgerModel:
    """What the formula needs from one transformer."""

    family: str
    p_tok: float  # parameters a token passes through
    layers: int
    hidden: int
    patch: tuple[int, int, int]  # (frames, height, width) patch sizes in latent units
    cross_attention: bool  # text tokens attended through cross-attention, not in the sequence
    image_attention_layers: int = 0  # blocks with a second self-attention over the image tokens (SD3.5)

    def tokens(self, height: int, width: int, frames: int | None, vae_spatial: int, vae_temporal: int,
               text_tokens: int) -> tuple[int, int]:
        """(N in the self-attention sequence, N_txt attended by cross-attention)."""
        pf, ph, pw = self.patch
        img = (height // (vae_spatial * ph)) * (width // (vae_spatial * pw))
        if frames:
            img *= ((frames - 1) // vae_temporal + 1) // pf
        if self.cross_attention:
            return img, text_tokens
        return img + text_tokens, 0

    def forward_flops(self, n: int, n_txt: int, n_img: int = 0) -> float:
        """One forward; ``n_img`` (image tokens alone) only matters with ``image_attention_layers``."""
        flops = 2.0 * self.p_tok * n + 4.0 * self.layers * n * n * self.hidden
        if n_txt:
            flops += 4.0 * self.layers * n * n_txt * self.hidden
        if self.image_attention_layers:
            flops += 4.0 * self.image_attention_layers * n_img * n_img * self.hidden
        return flops


    def request_flops(self, height: int, width: int, frames: int | None, vae_spatial: int, vae_temporal: int,
                      text_tokens: int, steps: int, branches: int = 1) -> float:
        """Nominal denoising FLOPs of one request: steps x CFG branches x one forward.

        What distillation changes is in the two factors: a guidance-distilled model (FLUX.1-dev embeds the
        guidance scale) runs one branch per step (g = 1), a few-step model (FLUX.1-schnell) 4 steps instead of
        28.  At 1024^2: FLUX.1-dev 28 x 1 x 74.3 T = 2.08 PFLOP, schnell 4 x 74.3 T = 0.30 PFLOP.
        """
        n, n_txt = self.tokens(height, width, frames, vae_spatial, vae_temporal, text_tokens)
        n_img = self.tokens(height, width, frames, vae_spatial, vae_temporal, 0)[0]
        return steps * branches * self.forward_flops(n, n_txt, n_img)


def _cfg(transformer: Any) -> dict[str, Any]:
    cfg = getattr(transformer, "config", None)
    return dict(cfg) if cfg is not None else {}


def ledger_model(transformer: Any) -> LedgerModel:
    """Read the ledger's inputs from a diffusers transformer (config plus its per-token Linears)."""
    import torch  # lazy: importing stepwatch.exporter (the sidecar does) must not import torch

    cfg = _cfg(transformer)
    name = type(transformer).__name__
    sd3 = name.startswith("SD3")
    not_per_token = _NOT_PER_TOKEN_SD3 if sd3 else _NOT_PER_TOKEN
    heads = int(cfg.get("num_attention_heads") or 0)
    head_dim = int(cfg.get("attention_head_dim") or 0)
    hidden = heads * head_dim or int(cfg.get("hidden_size") or cfg.get("inner_dim") or 0)
    p_tok = 0
    layers = 0
    image_attention = 0
    for list_name, child in transformer.named_children():
        if list_name not in _BLOCK_LISTS or not isinstance(child, torch.nn.ModuleList):
            continue
        layers += len(child)
        for block in child:
            if sd3 and getattr(block, "attn2", None) is not None:
                image_attention += 1
            for mod_name, mod in block.named_modules():
                if isinstance(mod, torch.nn.Linear) and not not_per_token.search(mod_name):
                    p_tok += mod.weight.numel() + (mod.bias.numel() if mod.bias is not None else 0)
    patch = cfg.get("patch_size", 1)
    if isinstance(patch, (list, tuple)):
        pt = tuple(int(p) for p in patch)
        patch3 = (pt[0], pt[1], pt[2]) if len(pt) == 3 else (1, pt[0], pt[-1])
    else:
        patch3 = (1, int(patch), int(patch))
    if name.startswith("Flux"):
        # Flux packs 2x2 latent patches in the pipeline (patch_size=1 in the config).
        return LedgerModel("flux", float(p_tok), layers, hidden, (1, 2, 2), False)
    if sd3:  # MMDiT: joint attention over image + text tokens, no cross-attention
        return LedgerModel("sd3", float(p_tok), layers, hidden, patch3, False, image_attention)
    cross = any(n.split(".")[-1] == "attn2" for n, _ in transformer.named_modules())
    family = "wan" if name.startswith("Wan") else name
    return LedgerModel(family, float(p_tok), layers, hidden, patch3, cross)


def mfu(step_flops: float, step_seconds: float, peak: float | None) -> float | None:
    if not peak or step_seconds <= 0:
        return None
    return step_flops / step_seconds / peak
