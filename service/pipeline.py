"""The practice pipelines: real diffusers pipelines built offline from small configs.

``build_pipeline()`` makes a FluxPipeline (or a WanPipeline, the video family,
a StableDiffusion3Pipeline, the family that runs CFG as one transformer call
on a doubled batch, or an AnyFlowFARPipeline, chunked autoregressive video over
a KV cache) with random weights drawn from a fixed seed: no hub, no downloads,
and two processes with the same seed build bit-identical pipelines.  Given
``model``, a local model directory, the same function loads a real model instead
(``DiffusionPipeline.from_pretrained``), which is what a GPU pod runs.
Only processes that build a pipeline import this module (it imports torch).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AnyFlowFARPipeline,
    AnyFlowFARTransformer3DModel,
    AutoencoderKL,
    AutoencoderKLWan,
    DiffusionPipeline,
    FlowMapEulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

log = logging.getLogger("stepwatch.service.pipeline")

FAMILIES = ("flux", "wan", "sd3", "far")
# A word-level vocabulary: prompts are split on whitespace and unknown words map to [UNK],
# which is all a random-weight text encoder needs.
_VOCAB_SIZE = 1000
_SPECIALS = ("[UNK]", "[PAD]", "</s>", "<|endoftext|>")


def _tokenizer(max_length: int, eos: str) -> Any:
    vocab = {f"w{i}": i for i in range(_VOCAB_SIZE)}
    for i, s in enumerate(_SPECIALS):
        vocab[s] = _VOCAB_SIZE + i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token=eos,
                                   model_max_length=max_length)


def prompt_words(prompt: str) -> str:
    """Map free text onto the practice vocabulary deterministically (so prompts matter)."""
    words = []
    for w in prompt.split():
        h = int.from_bytes(hashlib.sha1(w.lower().encode()).digest()[:4], "big")
        words.append(f"w{h % _VOCAB_SIZE}")
    return " ".join(words) or "w0"


def _seeded(seed: int, salt: int) -> None:
    torch.manual_seed(seed * 1000 + salt)


def _sharpen(transformer: Any) -> None:
    """Make the random transformer's velocity depend on the timestep like a trained one's.

    At default init the prediction barely changes from step to step, so a
    cross-step cache would be free of cost and a quality drill could not fail.
    Scaling the timestep/adaLN path (x2) and the output projection (x4) gives
    FirstBlockCache a realistic trade-off on 256^2 x 8 steps: threshold 0.5
    -> a few hits, PSNR > 40 dB; 1.0 -> ~28-33 dB; 3.0 -> ~25 dB.
    """
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if ("norm" in name and "linear" in name) or name.startswith("time_text_embed"):
                p.mul_(2.0)
            elif name.startswith("proj_out"):
                p.mul_(4.0)


def _tiny_vae() -> Any:
    # No mid-block attention (its N^2 map at 2048^2 would dominate); tiles of 256 px.
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=(8, 16, 16, 16), layers_per_block=1,
        latent_channels=16, norm_num_groups=4, shift_factor=0.0, scaling_factor=1.0, use_quant_conv=False,
        use_post_quant_conv=False, sample_size=256, mid_block_add_attention=False)


def _tiny_t5(seed: int, d_model: int) -> Any:
    """The T5 text encoder both MMDiT families use: 4 heads of ``d_model / 4``, its own seed salt (2)."""
    _seeded(seed, 2)
    return T5EncoderModel(T5Config(
        vocab_size=_VOCAB_SIZE + len(_SPECIALS), d_model=d_model, d_kv=d_model // 4, d_ff=37, num_layers=2,
        num_heads=4, pad_token_id=_VOCAB_SIZE + 1, eos_token_id=_VOCAB_SIZE + 2))


def _tiny_flux(seed: int) -> Any:
    vocab = _VOCAB_SIZE + len(_SPECIALS)
    _seeded(seed, 1)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        projection_dim=32, max_position_embeddings=77, eos_token_id=vocab - 1, pad_token_id=_VOCAB_SIZE + 1,
        bos_token_id=_VOCAB_SIZE))
    t5 = _tiny_t5(seed, d_model=32)
    _seeded(seed, 3)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
    _sharpen(transformer)
    _seeded(seed, 4)
    vae = _tiny_vae()
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip,
        tokenizer=_tokenizer(77, "<|endoftext|>"), text_encoder_2=t5, tokenizer_2=_tokenizer(512, "</s>"),
        transformer=transformer)
    parts: list[Any] = [clip, t5, transformer, vae]
    for m in parts:
        m.eval().requires_grad_(False)
    return pipe


def _wan_parts(seed: int, transformer: Callable[[], Any]) -> tuple[Any, Any, Any]:
    """The Wan family's tiny text encoder (UMT5) and VAE around the given transformer, each drawn from its own
    seed stream, so every Wan-based pipeline built from one seed shares the encoder's and the VAE's weights."""
    vocab = _VOCAB_SIZE + len(_SPECIALS)
    _seeded(seed, 1)
    umt5 = UMT5EncoderModel(UMT5Config(
        vocab_size=vocab, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, decoder_start_token_id=0,
        pad_token_id=_VOCAB_SIZE + 1, eos_token_id=_VOCAB_SIZE + 2))
    _seeded(seed, 3)
    denoiser = transformer()
    _seeded(seed, 4)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    parts: list[Any] = [umt5, denoiser, vae]
    for m in parts:
        m.eval().requires_grad_(False)
    return umt5, denoiser, vae


def _tiny_wan(seed: int) -> Any:
    umt5, transformer, vae = _wan_parts(seed, lambda: WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32))
    return WanPipeline(tokenizer=_tokenizer(512, "</s>"), text_encoder=umt5, vae=vae,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=transformer)


def _tiny_far(seed: int) -> Any:
    """Causal FAR over Wan (seed 002's autoregressive video): the tiny Wan's text encoder and VAE, a FAR transformer
    of 2 heads x 12 in 2 layers with chunks of (1, 2, 2, 2) latent frames (25 frames), few-step flow-map
    sampling.  64^2 x 25 frames x 4 steps per chunk runs in a few seconds on a CPU."""
    umt5, transformer, vae = _wan_parts(seed, lambda: AnyFlowFARTransformer3DModel(
        num_attention_heads=2, attention_head_dim=12, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
        rope_max_seq_len=64, chunk_partition=(1, 2, 2, 2)))
    _sharpen_far(transformer, vae)
    return AnyFlowFARPipeline(tokenizer=_tokenizer(512, "</s>"), text_encoder=umt5, vae=vae,
                              scheduler=FlowMapEulerDiscreteScheduler(), transformer=transformer)


def _sharpen_far(transformer: Any, vae: Any) -> None:
    """Make the tiny FAR's frames depend on its latents, and its later chunks on their context, as a trained
    model's do (its own VAE instance only).

    At default init the random Wan VAE's decoder dominates: two seeds' sessions differed by only 41-53 dB
    PSNR per chunk, so no sampling fault could be seen in the frames and a drift probe could not fail.
    The output projection x4 (as the FLUX practice model's) and the decoder's first convolution x300 made
    two seeds differ by 16-25 dB.  Its self-attention was then nearly uniform and small beside the residual
    stream, so a chunk barely read the chunks before it: a KV window of 2 or 8 chunks instead of 3 left
    chunks 3-7 at 37-45 dB of the 3-chunk session, where a trained autoregressive model carries every change
    of its context into the chunks after it (the drift its users see).  The self-attention's query and key
    norms x4 each (logits x16: a token attends to a few others, not all) and its output projection x12
    (attention as large as the residual) give it that: measured on the stream probe's session (64x64 x 8
    chunks, last frame of each, against the 3-chunk window), a window of 4-8 chunks leaves chunks 0-2 exact,
    chunk 3 at 26.3 dB and chunks 4-7 at 18.9-20.9 dB (drift past the 24 dB video gate); a window of 2
    drops chunk 3 to 22.3 dB as well (every chunk past two, not drift); two seeds still differ by 16-25 dB;
    chunks 4+ sampled with 1 step instead of 4 read 22.2, 19.9, 19.5, 19.1 dB (with 2 steps: 26.8, 24.5,
    21.7, 21.5).
    """
    factors = {"proj_out.": 4.0, ".attn1.norm_q.": 4.0, ".attn1.norm_k.": 4.0, ".attn1.to_out.0.": 12.0}
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            for part, factor in factors.items():
                if part in name:  # proj_out. is the top-level projection's only (checked: no block has one)
                    p.mul_(factor)
        vae.decoder.conv_in.weight.mul_(300.0)
        vae.decoder.conv_in.bias.mul_(300.0)


def _tiny_sd3(seed: int) -> Any:
    """SD3's parts at the sizes of diffusers' own SD3 pipeline tests (two CLIP encoders of width 32, an MMDiT of
    4 heads x 8), with real SD3's 2x2 patches and 16 latent channels and the FLUX family's 8x VAE: 64^2 is 16
    image tokens.  T5 is 64 wide, the two CLIP widths side by side, so the joint text embedding is not cropped."""
    vocab = _VOCAB_SIZE + len(_SPECIALS)
    clip_config = CLIPTextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=37, num_hidden_layers=5, num_attention_heads=4,
        projection_dim=32, hidden_act="gelu", layer_norm_eps=1e-5, max_position_embeddings=77,
        eos_token_id=vocab - 1, pad_token_id=_VOCAB_SIZE + 1, bos_token_id=_VOCAB_SIZE)
    _seeded(seed, 1)
    clip = CLIPTextModelWithProjection(clip_config)
    _seeded(seed, 5)
    clip_2 = CLIPTextModelWithProjection(clip_config)
    t5 = _tiny_t5(seed, d_model=64)
    _seeded(seed, 3)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=64, pooled_projection_dim=64)
    _seeded(seed, 4)
    vae = _tiny_vae()
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=clip, tokenizer=_tokenizer(77, "<|endoftext|>"), text_encoder_2=clip_2,
        tokenizer_2=_tokenizer(77, "<|endoftext|>"), text_encoder_3=t5, tokenizer_3=_tokenizer(512, "</s>"))
    parts: list[Any] = [clip, clip_2, t5, transformer, vae]
    for m in parts:
        m.eval().requires_grad_(False)
    return pipe


def build_pipeline(family: str = "flux", model: str | os.PathLike[str] | None = None, seed: int = 0,
                   device: str = "cpu", dtype: str | None = None) -> Any:
    """A ready pipeline: the tiny offline one of ``family``, or the model directory ``model``."""
    torch_dtype = getattr(torch, dtype) if dtype else None
    if model is not None:
        path = Path(model)
        if not (path / "model_index.json").is_file():
            raise FileNotFoundError(f"{path} is not a diffusers model directory (no model_index.json)")
        pipe = DiffusionPipeline.from_pretrained(str(path), torch_dtype=torch_dtype, local_files_only=True)
    elif family == "flux":
        pipe = _tiny_flux(seed)
    elif family == "wan":
        pipe = _tiny_wan(seed)
    elif family == "sd3":
        pipe = _tiny_sd3(seed)
    elif family == "far":
        pipe = _tiny_far(seed)
    else:
        raise ValueError(f"unknown pipeline family {family!r}; choose one of {', '.join(FAMILIES)}")
    if torch_dtype is not None and model is None:
        pipe.to(torch_dtype)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def compile_transformer(transformer: Any, mode: str, backend: str) -> None:
    """torch.compile the transformer as the service does: ``regional`` compiles its repeated blocks (one code
    object for all of them, compiled once), ``full`` the whole module; static shapes (serving shapes are few).

    Regional compile shares that code object across all blocks, and the cache hooks add variants: Dynamo's
    default limit of 8 would silently fall back to eager after a few shapes and hide exactly the serving
    recompiles the service must show, so the limits are raised."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    if mode == "regional":
        transformer.compile_repeated_blocks(backend=backend, dynamic=False)
    else:
        transformer.compile(backend=backend, dynamic=False)


def generate_images(pipe: Any, req: Any, text_tokens: int, callback: Callable[..., Any] | None = None) -> Any:
    """One image request (service/api.py's GenerationRequest) through an image pipeline, as the worker runs it:
    the prompt mapped onto the practice vocabulary, the request's seed, true CFG with an empty negative prompt
    when its guidance is above 1, NumPy output."""
    kwargs: dict[str, Any] = {"negative_prompt": "", "true_cfg_scale": req.guidance_scale} if req.cfg else {}
    return pipe(prompt_words(req.prompt), height=req.height, width=req.width, num_inference_steps=req.steps,
                num_images_per_prompt=req.n, max_sequence_length=text_tokens, output_type="np",
                generator=torch.Generator().manual_seed(req.seed), callback_on_step_end=callback, **kwargs)


def generate_video(pipe: Any, req: Any, text_tokens: int, on_step: Callable[..., Any] | None = None) -> Any:
    """One video job through the video pipeline, as the worker runs it (CFG with an empty negative prompt)."""
    kwargs: dict[str, Any] = {"negative_prompt": ""} if req.cfg else {}
    return pipe(prompt_words(req.prompt), height=req.height, width=req.width, num_frames=req.frames,
                num_inference_steps=req.steps, guidance_scale=req.guidance_scale, max_sequence_length=text_tokens,
                output_type="np", generator=torch.Generator().manual_seed(req.seed), callback_on_step_end=on_step,
                **kwargs)


def weights_digest(pipe: Any) -> str:
    """sha256 over every parameter and buffer of every module: the weights' identity."""
    h = hashlib.sha256()
    for name in sorted(pipe.components):
        comp = pipe.components[name]
        if not isinstance(comp, torch.nn.Module):
            continue
        for key, t in sorted(comp.state_dict().items()):
            h.update(f"{name}.{key}".encode())
            h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def damage_weights(pipe: Any, layer: str, noise: float, seed: int = 0) -> int:
    """The practice fault of config ``weights_damage``: Gaussian noise, ``noise`` times each weight matrix's own
    standard deviation, added to the transformer's module ``layer``, as a lost FP8 scale or a bad shard damages
    one instance's weights.  Applied after the weights digest on purpose: the checkpoint is the fleet's, so the
    fingerprint matches and only the quality probes can tell.  Returns how many tensors it damaged."""
    modules = dict(pipe.transformer.named_modules())
    if layer not in modules:
        raise ValueError(f"weights_damage.layer: the transformer has no module {layer!r}")
    g = torch.Generator().manual_seed(seed)
    damaged = 0
    with torch.no_grad():
        for p in modules[layer].parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * p.float().std().to(p.dtype) * noise)
                damaged += 1
    return damaged
