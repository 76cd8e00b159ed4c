"""``stepwatch gpu-check``: prove on a real GPU that CUDA timing adds no synchronization.

Run on a machine with one CUDA GPU (under 5 minutes on an H100/H200).  It
builds a FLUX.1-dev-shaped pipeline (the full 57-block transformer, 11.9 B
parameters, random bf16 weights; small text encoders with the right output
widths; the FLUX VAE), instruments it, and:

1. runs every stepwatch hook body under ``torch.cuda.set_sync_debug_mode("error")``:
   any host-device synchronization inside stepwatch raises there, is caught
   by the hook guard and counted in ``stepwatch_exporter_errors_total`` - the
   check demands zero (and first proves the detector fires on a deliberate sync);
2. compares per-step times from the CUDA events with a separate run timed with
   explicit ``torch.cuda.synchronize()`` at every step;
3. prints per-step times and MFU at 1024^2 from the FLOPs ledger.

Exit 0 when all checks pass, 1 when one fails, 2 when there is no GPU.
``--device cpu --small`` runs the same code path on the CPU (no sync check),
which is how the script itself is tested without a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

_HOOK_METHODS = ("_begin", "_end", "_stage_enter", "_stage_exit", "_denoise_start", "_on_branch_end", "_emit",
                 "_drain_pending")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    p.add_argument("--size", type=int, default=1024, help="square image size (default: %(default)s)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps (default: %(default)s)")
    p.add_argument("--requests", type=int, default=3, help="instrumented requests (default: %(default)s)")
    p.add_argument("--small", action="store_true", help="the tiny practice pipeline instead of FLUX.1-dev's shape")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the results")


def _flux_dev_shaped(device: str) -> Any:
    """FLUX.1-dev's transformer and VAE configs with random bf16 weights; small encoders of the right widths."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from stepwatch.service.pipeline import _tokenizer

    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            transformer = FluxTransformer2DModel(guidance_embeds=True)
            vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16,
                                down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                                block_out_channels=(128, 256, 512, 512), layers_per_block=2, shift_factor=0.1159,
                                scaling_factor=0.3611, use_quant_conv=False, use_post_quant_conv=False)
            clip = CLIPTextModel(CLIPTextConfig(vocab_size=1004, hidden_size=768, intermediate_size=256,
                                                num_hidden_layers=1, num_attention_heads=4, projection_dim=768,
                                                max_position_embeddings=77, eos_token_id=1003, pad_token_id=1001,
                                                bos_token_id=1000))
            t5 = T5EncoderModel(T5Config(vocab_size=1004, d_model=4096, d_kv=64, d_ff=256, num_layers=1, num_heads=8,
                                         pad_token_id=1001, eos_token_id=1002))
    finally:
        torch.set_default_dtype(prev)
    pipe: Any = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), vae=vae,
                        text_encoder=clip, tokenizer=_tokenizer(77, "<|endoftext|>"), text_encoder_2=t5,
                        tokenizer_2=_tokenizer(512, "</s>"), transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _sync_guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    def wrapped(*a: Any, **k: Any) -> Any:
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode(prev)

    return wrapped


def run(args: argparse.Namespace) -> int:
    import torch
    from prometheus_client import CollectorRegistry

    from stepwatch.exporter import instrument, uninstrument
    from stepwatch.exporter.ledger import peak_flops_for

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; run it on a machine with a GPU (or --device cpu --small for a "
              "dry run of the code path)")
        return 2
    results: dict[str, Any] = {"device": args.device, "size": args.size, "steps": args.steps, "checks": {}}
    t0 = time.perf_counter()
    if args.small:
        from stepwatch.service.pipeline import build_pipeline

        pipe = build_pipeline("flux", seed=0, device=args.device)
        text_tokens = 32
    else:
        print("building a FLUX.1-dev-shaped pipeline with random bf16 weights...", flush=True)
        pipe = _flux_dev_shaped(args.device)
        text_tokens = 512
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    results["gpu"] = name
    print(f"built in {time.perf_counter() - t0:.1f}s on {name}", flush=True)

    def call(**kw: Any) -> Any:
        return pipe("a photo of a lighthouse at dusk", height=args.size, width=args.size,
                    num_inference_steps=args.steps, max_sequence_length=text_tokens, guidance_scale=3.5,
                    output_type="latent" if cuda else "np", generator=torch.Generator().manual_seed(0), **kw)

    call()  # warm kernels / allocator
    registry = CollectorRegistry()
    inst = instrument(pipe, registry=registry, text_tokens=text_tokens)
    detector_ok = True
    if cuda:
        for m in _HOOK_METHODS:
            setattr(inst, m, _sync_guarded(getattr(inst, m)))
        inst.clock.mark = _sync_guarded(inst.clock.mark)
        probe = _sync_guarded(lambda: torch.ones(1, device=args.device).item())
        try:
            probe()
            detector_ok = False
        except RuntimeError:
            detector_ok = True
    results["checks"]["sync_detector_fires"] = detector_ok

    def settle() -> None:
        if cuda:
            # Outside stepwatch: lets the events complete.  The sync-debug mode is process-wide, so the
            # resolver thread (which runs hook code under "error") must finish before the next call.
            torch.cuda.synchronize()
        deadline = time.time() + 10
        while inst._pending and time.time() < deadline:
            time.sleep(0.01)

    reports = []
    for _ in range(args.requests):
        call()
        settle()
        reports.append(inst.last_report)
    # The same calls timed two ways: CUDA events (stepwatch) and a synchronize at every step boundary
    # in the pipeline's own step callback (outside stepwatch, so the sync check does not apply to it).
    diffs: list[float] = []
    ref_steps: list[float] = []
    for _ in range(2):
        marks: list[float] = []

        def sync_step(_p: Any, _i: int, _t: Any, kw: dict[str, Any], marks: list[float] = marks) -> dict[str, Any]:
            if cuda:
                torch.cuda.synchronize()
            marks.append(time.perf_counter())
            return kw

        call(callback_on_step_end=sync_step)
        settle()
        ev = inst.last_report.step_seconds[1:] if inst.last_report else []
        ref_steps = [b - a for a, b in itertools.pairwise(marks)]
        if ev and len(ev) == len(ref_steps):
            diffs.append(abs(statistics.mean(ev) - statistics.mean(ref_steps)) / statistics.mean(ref_steps))
    from prometheus_client import generate_latest

    from stepwatch.exposition import parse_exposition

    data = parse_exposition(generate_latest(registry).decode())
    errors = {dict(k[1]).get("component"): v for k, v in data.items() if k[0] == "stepwatch_exporter_errors_total"
              and v > 0}
    results["exporter_errors"] = errors
    results["checks"]["no_sync_in_hooks"] = sum(errors.values()) == 0
    rep = reports[-1]
    results["checks"]["reports_resolved"] = rep is not None and len(rep.step_seconds) == args.steps
    if rep is None:
        print("no report was resolved")
        return 1
    ev_mean = statistics.mean(rep.step_seconds[1:])
    results["step_seconds_events"] = [round(s, 5) for s in rep.step_seconds]
    results["step_seconds_synchronized"] = [round(s, 5) for s in ref_steps]
    results["event_vs_sync_relative_diff"] = [round(d, 4) for d in diffs]
    results["checks"]["event_times_match_sync_times"] = bool(diffs) and min(diffs) <= 0.1
    peak = peak_flops_for(name) if cuda else None
    results["step_flops"] = rep.step_flops
    results["peak_flops"] = peak
    results["mfu"] = (rep.step_flops / ev_mean / peak) if (peak and rep.step_flops) else None
    results["stages"] = rep.stages
    uninstrument(pipe)
    timer = "CUDA events" if cuda else "host clock"
    print(f"\nper-step seconds ({timer}): {' '.join(f'{s:.4f}' for s in rep.step_seconds)}")
    print(f"per-step seconds (synchronized): {' '.join(f'{s:.4f}' for s in ref_steps)}")
    print("stages: " + ", ".join(f"{k} {v:.3f}s" for k, v in rep.stages.items()))
    if rep.step_flops:
        print(f"ledger: {rep.step_flops / 1e12:.1f} TFLOP per step (CFG branches: {rep.cfg_branches})")
    if results["mfu"] is not None and peak:
        print(f"MFU at {args.size}^2: {results['mfu']:.3f} (peak {peak / 1e12:.0f} TFLOP/s, eager bf16)")
    for k, ok in results["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {k}")
    if errors:
        print(f"exporter errors: {errors}")
    if args.json:
        print(json.dumps(results, default=str))
    return 0 if all(results["checks"].values()) else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    add_arguments(p)
    sys.exit(run(p.parse_args()))
