"""The FLOPs ledger: nominal FLOPs per denoising step, and MFU from it.

A diffusion request is compute-bound, so GPU-Util reads ~100% whether the
kernels are good or bad; only FLOPs / (seconds x peak) says how well the
device is used.  One forward of one sample costs

    2 * (W_img * N_img + W_txt * N_txt + W_joint * (N_img + N_txt) + W_once)
  + 4 * (A_self * N_img^2 + A_cross * N_img * N_txt + A_joint * (N_img + N_txt)^2) + 4 * A_lin * N_img

W_x: the weights (multiply-accumulates) a token of class x passes through, every Linear and convolution of
the transformer counted once in the class of the tokens it sees (``token_class``): the image stream
(patch embedding, image-stream blocks, the output projection), the text stream (caption projection,
cross-attention keys and values, the text stream of joint blocks), blocks that run on the joined sequence
(FLUX's single blocks, CogVideoX), and once per sample (timestep embedding, adaLN modulation).
A_x: the summed inner width (heads x head dim) of the attentions of each kind (``attention_kind``):
softmax attention costs 4 N_q N_kv d (QK^T and AV), linear attention (Sana) 4 N d (d_head + 1).

N_img and N_txt are what the transformer really receives (``tokens_of_call``: the first call's
hidden_states and encoder_hidden_states), so VAE compression, patching, resolution binning and padded
text need no model of their own.  A step costs the forward times the samples of its calls (CFG branches
x the prompt batch).  FLUX.1-dev at 1024^2 (4096 + 512 tokens): 74.3 TFLOP per step, as the seeds give.
The ledger is checked against torch's FlopCounterMode per family (``stepwatch bench ledger``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
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

TOKEN_CLASSES = ("img", "txt", "joint", "once")
ATTENTION_KINDS = ("self", "cross", "joint", "linear")

# Once per sample: the timestep (and pooled-text, guidance) embeddings and every adaLN modulation.
_ONCE = re.compile(r"(^|\.)(norm\w*|\w*time\w*|guidance\w*|adaln\w*|\w*modulation\w*|\w+_mod|pooled\w*|ofs_\w*)\.")
# Per text token: caption projections, the text stream of joint blocks.
_TEXT = re.compile(r"(^|\.)(context_embedder|caption_projection|text_embedder|text_proj|txt_in|ff_context|txt_mlp"
                   r"|add_[qkv]_proj|to_add_out)(\.|$)")
# Block lists that run on the joined image + text sequence with one set of weights.
_JOINED_LISTS: Mapping[str, tuple[str, ...]] = {
    "Flux": ("single_transformer_blocks",),
    "AuraFlow": ("single_transformer_blocks",),
    "HunyuanVideo": ("single_transformer_blocks",),
    "CogVideoX": ("transformer_blocks",),
}
# hidden_states laid out (batch, frames, channels, height, width) instead of (batch, channels, frames, ...).
_FRAMES_FIRST = ("CogVideoX",)


def peak_flops_for(device_name: str) -> float | None:
    for key, flops in PEAK_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None


@dataclass(frozen=True)
class LedgerModel:
    """What the formula needs from one transformer: weights per token class, attention width per kind, and
    how its hidden_states hold the image tokens.  Plain numbers (``as_dict``): the service's queue predictor
    rebuilds it without torch."""

    family: str
    weights: Mapping[str, float]  # multiply-accumulates per token, by TOKEN_CLASSES
    attention: Mapping[str, float] = field(default_factory=dict)  # summed inner width, by ATTENTION_KINDS
    patch: tuple[int, int, int] = (1, 1, 1)  # (frames, height, width) patch sizes in latent units
    frames_first: bool = False

    def forward_flops(self, n_img: int, n_txt: int) -> float:
        """One forward of one sample over ``n_img`` image and ``n_txt`` text tokens."""
        w = self.weights
        macs = (w.get("img", 0.0) * n_img + w.get("txt", 0.0) * n_txt + w.get("joint", 0.0) * (n_img + n_txt)
                + w.get("once", 0.0))
        return 2.0 * macs + self.attention_flops(n_img, n_txt)

    def attention_flops(self, n_img: int, n_txt: int) -> float:
        """The attention term alone: what grows as N^2 (seed 000's 72% of a Wan step at 720p)."""
        a, n_joint = self.attention, n_img + n_txt
        return 4.0 * (a.get("self", 0.0) * n_img * n_img + a.get("cross", 0.0) * n_img * n_txt
                      + a.get("joint", 0.0) * n_joint * n_joint + a.get("linear", 0.0) * n_img)

    def image_tokens(self, hidden_shape: tuple[int, ...]) -> int:
        """The image tokens of one sample in a call's hidden_states: packed (batch, tokens, channels), an
        image latent (batch, channels, h, w) or a video latent, patched by the model's own patch sizes."""
        pf, ph, pw = self.patch
        if len(hidden_shape) == 3:
            return int(hidden_shape[1])
        if len(hidden_shape) == 4:
            return (hidden_shape[2] // ph) * (hidden_shape[3] // pw)
        frames = hidden_shape[1] if self.frames_first else hidden_shape[2]
        return (frames // pf) * (hidden_shape[3] // ph) * (hidden_shape[4] // pw)

    def tokens(self, height: int, width: int, frames: int | None, vae_spatial: int, vae_temporal: int) -> int:
        """Image tokens predicted from a request's geometry (the queue's predictor, the real-config check):
        the latent is the image over the VAE's compression, then patched."""
        pf, ph, pw = self.patch
        n = (height // (vae_spatial * ph)) * (width // (vae_spatial * pw))
        if frames:
            n *= ((frames - 1) // vae_temporal + 1) // pf
        return n

    def as_dict(self) -> dict[str, Any]:
        return {"family": self.family, "weights": dict(self.weights), "attention": dict(self.attention),
                "patch": list(self.patch), "frames_first": self.frames_first}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LedgerModel:
        pf, ph, pw = (int(p) for p in d["patch"])
        return cls(str(d["family"]), {k: float(v) for k, v in d["weights"].items()},
                   {k: float(v) for k, v in d.get("attention", {}).items()}, (pf, ph, pw),
                   bool(d.get("frames_first", False)))


def token_class(path: str, joined_lists: tuple[str, ...], text_kv: bool) -> str:
    """Which tokens pass through the Linear or convolution at ``path``.  ``text_kv``: it is the key or
    value projection of a cross-attention (it reads the text)."""
    if _ONCE.search(path + "."):
        return "once"
    if text_kv or _TEXT.search(path):
        return "txt"
    if path.split(".", 1)[0] in joined_lists:
        return "joint"
    return "img"


def attention_kind(path: str, attn: Any, joined_lists: tuple[str, ...]) -> str:
    """Self, cross (image queries, text keys), joint (one sequence of both) or linear (Sana's ReLU kernel)."""
    if "Linear" in type(getattr(attn, "processor", None)).__name__:
        return "linear"
    cross = getattr(attn, "is_cross_attention", None)
    if cross is None:
        cross = path.rsplit(".", 1)[-1] == "attn2"
    if cross:
        return "cross"
    if getattr(attn, "add_q_proj", None) is not None or path.split(".", 1)[0] in joined_lists:
        return "joint"
    return "self"


def _patch(cfg: Mapping[str, Any]) -> tuple[int, int, int]:
    patch = cfg.get("patch_size", 1) or 1
    if isinstance(patch, (list, tuple)):
        pt = tuple(int(p) for p in patch)
        return (pt[0], pt[1], pt[2]) if len(pt) == 3 else (1, pt[0], pt[-1])
    return (int(cfg.get("patch_size_t") or 1), int(patch), int(patch))


def _family(name: str, table: Mapping[str, Any], default: Any) -> Any:
    return next((v for prefix, v in table.items() if name.startswith(prefix)), default)


def ledger_model(transformer: Any) -> LedgerModel | None:
    """Read the ledger's inputs from a diffusers transformer: every Linear and convolution by the tokens it
    sees, every attention by its kind.  Works on the meta device (real configs without weights).  None for
    a UNet (SD 1.x, SDXL): its resolution halves level by level, which a per-token ledger does not model, so
    it has no FLOPs or MFU rather than wrong ones."""
    import torch  # lazy: importing stepwatch.exporter (the sidecar does) must not import torch

    name = type(transformer).__name__
    if "UNet" in name:
        return None
    cfg = dict(getattr(transformer, "config", None) or {})
    joined = _family(name, _JOINED_LISTS, ())
    weights = dict.fromkeys(TOKEN_CLASSES, 0.0)
    attention = dict.fromkeys(ATTENTION_KINDS, 0.0)
    text_kv: set[str] = set()
    for path, mod in transformer.named_modules():
        to_q = getattr(mod, "to_q", None)
        if not isinstance(to_q, torch.nn.Linear):
            continue
        kind = attention_kind(path, mod, joined)
        inner = to_q.out_features
        if kind == "linear":
            heads = int(getattr(mod, "heads", 1) or 1)
            attention[kind] += inner * (inner // heads + 1)
        else:
            attention[kind] += inner
        if kind == "cross":
            text_kv.update((f"{path}.to_k", f"{path}.to_v"))
    convs = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    for path, mod in transformer.named_modules():
        if isinstance(mod, convs):
            weights[token_class(path, joined, path in text_kv)] += mod.weight.numel()
    family = "wan" if name.startswith("Wan") else "flux" if name.startswith("Flux") else \
        "sd3" if name.startswith("SD3") else name
    patch = (1, 2, 2) if name.startswith("Flux") else _patch(cfg)
    return LedgerModel(family, {k: v for k, v in weights.items() if v},
                       {k: v for k, v in attention.items() if v}, patch, name.startswith(_FRAMES_FIRST))


def mfu(step_flops: float, step_seconds: float, peak: float | None) -> float | None:
    if not peak or step_seconds <= 0:
        return None
    return step_flops / step_seconds / peak
