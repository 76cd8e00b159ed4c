"""The GPU check's steps: build a FLUX.1-dev-shaped pipeline, prove no hook synchronizes, compare
event and synchronized step times, and measure MFU.  What it proves and how to run it is
``stepwatch gpu-check --help`` (bench/cli_gpu_check.py).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from prometheus_client import CollectorRegistry, generate_latest
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from stepwatch.exporter import Instrumentation, instrument, uninstrument
from stepwatch.exporter.ledger import peak_flops_for
from stepwatch.exporter.report import RequestReport
from stepwatch.exposition import parse_exposition
from stepwatch.service.pipeline import _tokenizer, build_pipeline

# Every hook body the wrappers call through the handle (see exporter/hooks.py), plus the request's end.
HOOK_METHODS = ("_begin", "_end", "_stage_enter", "_stage_exit", "_denoise_start", "_emit",
                "_drain_pending")


class NoGpu(RuntimeError):
    """Asked for CUDA on a machine without it."""


def _flux_dev_shaped(device: str) -> Any:
    """FLUX.1-dev's transformer and VAE configs with random bf16 weights; small encoders of the right widths."""
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
    def wrapped(*a: Any, **k: Any) -> Any:
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode(prev)

    return wrapped


@dataclass
class Check:
    """One gpu-check session: the pipeline, its handle and how to call it."""

    device: str
    size: int
    steps: int
    pipe: Any
    text_tokens: int
    gpu: str
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    inst: Instrumentation | None = None

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def call(self, **kw: Any) -> Any:
        return self.pipe("a photo of a lighthouse at dusk", height=self.size, width=self.size,
                         num_inference_steps=self.steps, max_sequence_length=self.text_tokens, guidance_scale=3.5,
                         output_type="latent" if self.cuda else "np", generator=torch.Generator().manual_seed(0),
                         **kw)

    def settle(self) -> None:
        """Wait until the last request's report is resolved."""
        if self.cuda:
            # Outside stepwatch: lets the events complete.  The sync-debug mode is process-wide, so the
            # resolver thread (which runs hook code under "error") must finish before the next call.
            torch.cuda.synchronize()
        deadline = time.time() + 10
        while self.inst is not None and self.inst._pending and time.time() < deadline:
            time.sleep(0.01)

    @property
    def last(self) -> RequestReport | None:
        return self.inst.last_report if self.inst is not None else None


def build(device: str, size: int, steps: int, small: bool, log: Callable[[str], None] = print) -> Check:
    """The pipeline to check, warmed once before it is instrumented; NoGpu without CUDA."""
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise NoGpu("gpu-check: no CUDA device here; run it on a machine with a GPU (or --device cpu --small for "
                    "a dry run of the code path)")
    t0 = time.perf_counter()
    if small:
        pipe, text_tokens = build_pipeline("flux", seed=0, device=device), 32
    else:
        log("building a FLUX.1-dev-shaped pipeline with random bf16 weights...")
        pipe, text_tokens = _flux_dev_shaped(device), 512
    gpu = torch.cuda.get_device_name(0) if cuda else "cpu"
    log(f"built in {time.perf_counter() - t0:.1f}s on {gpu}")
    check = Check(device, size, steps, pipe, text_tokens, gpu)
    check.call()  # warm kernels / allocator
    return check


def guard_hooks(check: Check) -> bool:
    """Instrument, and on CUDA run every hook body under sync-debug "error"; True when the detector fires on a
    deliberate sync (on the CPU there is nothing to detect)."""
    inst = check.inst = instrument(check.pipe, registry=check.registry, text_tokens=check.text_tokens)
    if not check.cuda:
        return True
    for m in HOOK_METHODS:
        setattr(inst, m, _sync_guarded(getattr(inst, m)))
    setattr(inst.clock, "mark", _sync_guarded(inst.clock.mark))  # noqa: B010 (mypy: a method is not assigned)
    probe = _sync_guarded(lambda: torch.ones(1, device=check.device).item())
    try:
        probe()
    except RuntimeError:
        return True
    return False


def event_vs_sync(check: Check, runs: int = 2) -> tuple[list[float], list[float]]:
    """The same call timed two ways: CUDA events (stepwatch) and a synchronize at every step boundary in
    the pipeline's own step callback (outside stepwatch, so the sync check does not apply to it).
    Returns the relative differences of the mean step per run, and the last run's synchronized steps."""
    diffs: list[float] = []
    ref_steps: list[float] = []
    for _ in range(runs):
        marks: list[float] = []

        def sync_step(_p: Any, _i: int, _t: Any, kw: dict[str, Any], marks: list[float] = marks) -> dict[str, Any]:
            if check.cuda:
                torch.cuda.synchronize()
            marks.append(time.perf_counter())
            return kw

        check.call(callback_on_step_end=sync_step)
        check.settle()
        ev = check.last.step_seconds[1:] if check.last else []
        ref_steps = [b - a for a, b in itertools.pairwise(marks)]
        if ev and len(ev) == len(ref_steps):
            diffs.append(abs(statistics.mean(ev) - statistics.mean(ref_steps)) / statistics.mean(ref_steps))
    return diffs, ref_steps


def exporter_errors(registry: CollectorRegistry) -> dict[str | None, float]:
    """Non-zero ``stepwatch_exporter_errors_total`` by component."""
    data = parse_exposition(generate_latest(registry).decode())
    return {dict(k[1]).get("component"): v for k, v in data.items()
            if k[0] == "stepwatch_exporter_errors_total" and v > 0}


def _summary(check: Check, rep: RequestReport, diffs: list[float], ref_steps: list[float]) -> dict[str, Any]:
    ev_mean = statistics.mean(rep.step_seconds[1:])
    peak = peak_flops_for(check.gpu) if check.cuda else None
    return {
        "step_seconds_events": [round(s, 5) for s in rep.step_seconds],
        "step_seconds_synchronized": [round(s, 5) for s in ref_steps],
        "event_vs_sync_relative_diff": [round(d, 4) for d in diffs],
        "step_flops": rep.step_flops,
        "peak_flops": peak,
        "mfu": (rep.step_flops / ev_mean / peak) if (peak and rep.step_flops) else None,
        "stages": rep.stages,
    }


def run_check(check: Check, requests: int) -> tuple[dict[str, Any], RequestReport | None]:
    """All checks on a built pipeline; the results (``checks`` maps each to pass/fail) and the last report."""
    results: dict[str, Any] = {"device": check.device, "size": check.size, "steps": check.steps,
                               "checks": {}, "gpu": check.gpu}
    results["checks"]["sync_detector_fires"] = guard_hooks(check)
    reports = []
    for _ in range(requests):
        check.call()
        check.settle()
        reports.append(check.last)
    diffs, ref_steps = event_vs_sync(check)
    errors = exporter_errors(check.registry)
    results["exporter_errors"] = errors
    results["checks"]["no_sync_in_hooks"] = sum(errors.values()) == 0
    rep = reports[-1] if reports else None
    results["checks"]["reports_resolved"] = rep is not None and len(rep.step_seconds) == check.steps
    if rep is None:
        return results, None
    results.update(_summary(check, rep, diffs, ref_steps))
    results["checks"]["event_times_match_sync_times"] = bool(diffs) and min(diffs) <= 0.1
    uninstrument(check.pipe)
    return results, rep
