"""Render the fixed-seed evaluation set on the practice pipeline (or a model directory) under one setting.

The seeds measure every lossy step against a baseline of 20 images from a fixed prompt x seed set, made with
the same deployment.  ``Runner`` builds the pipelines the service would build from its config (the same
``build_pipeline``, compile, VAE tiling and call as the worker), instruments them with a fresh registry, and
renders one item of the set under a ``Setting`` (cache kind and threshold, steps): the 8-bit output the client
would get and the exporter's report of the call (per-step seconds, stages, memory peak, cache decisions).
In process, one pipeline per family: what a deployment is, for determinism (``--determinism``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from stepwatch.service.api import GenerationRequest
from stepwatch.service.config import ServiceConfig, parse_size

# Twenty prompts (the seeds' set size), each rendered with its own seed (its index): words, not meaning, matter
# to the practice model, so they only need to differ.
PROMPTS = (
    "a red fox in fresh snow at dawn", "a lighthouse on a cliff in a storm", "a bowl of ramen on a wooden table",
    "a city street at night in the rain", "an astronaut riding a horse on mars", "a watercolor of a quiet harbor",
    "a close up portrait of an old sailor", "a field of sunflowers under blue sky", "a cat asleep on a pile of books",
    "a mountain lake with mirror reflections", "a neon sign that says open late", "a steam train crossing a bridge",
    "a macro photo of a dew covered leaf", "a cozy cabin interior with a fireplace", "a desert road at sunset",
    "a robot painting a self portrait", "a koi pond seen from above", "a snowy village with warm lit windows",
    "a paper boat on a puddle", "a hot air balloon over green hills",
)
IMAGES = len(PROMPTS)
_SHAPE = re.compile(r"^(\d+x\d+)(?:x(\d+))?(?:_(\d+)s)?$")


@dataclass(frozen=True)
class Shape:
    """What one row of the report measures: a size, frames (0: an image), steps and CFG scale."""

    width: int
    height: int
    frames: int
    steps: int
    guidance: float

    @property
    def is_video(self) -> bool:
        return self.frames > 0

    @property
    def label(self) -> str:
        """The exporter's shape label (``WxH[xF]_<steps>s[_cfg]``): the key of baselines and ``shape_cache``."""
        return self.request(0).shape

    def request(self, index: int) -> GenerationRequest:
        return GenerationRequest(PROMPTS[index % IMAGES], 1, self.width, self.height, self.steps, self.guidance,
                                 index, frames=self.frames or 1)


def parse_shape(text: str, cfg: ServiceConfig) -> Shape:
    """``WxH`` (an image at the config's default steps), ``WxHxF`` (a video of F frames), either with ``_Ns``."""
    m = _SHAPE.match(text.strip().lower())
    if not m:
        raise ValueError(f"shape {text!r}: expected WxH, WxHxF (video frames) or either with _<steps>s")
    w, h = parse_size(m.group(1), "shape")
    frames = int(m.group(2) or 0)
    if frames:
        if not cfg.video_active:
            raise ValueError(f"shape {text!r}: a video shape needs video enabled in the config (and one rank)")
        if (frames - 1) % 4:
            raise ValueError(f"shape {text!r}: video frames are 4k+1 (1, 5, 9, ...)")
        steps = int(m.group(3) or cfg.video.default_steps)
        return Shape(w, h, frames, steps, float(cfg.video.guidance_scale))
    return Shape(w, h, 0, int(m.group(3) or cfg.default_steps), 1.0)


def default_shapes(cfg: ServiceConfig) -> list[Shape]:
    """The config's default image size, and its default video size when video jobs are served."""
    out = [parse_shape(cfg.default_size, cfg)]
    if cfg.video_active:
        out.append(parse_shape(f"{cfg.video.default_size}x{cfg.video.default_frames}", cfg))
    return out


@dataclass(frozen=True)
class Setting:
    """The knobs a sweep turns: the cross-step cache and the steps (None: the shape's own)."""

    cache_kind: str
    cache_threshold: float | None
    steps: int | None = None

    def describe(self) -> str:
        cache = self.cache_kind if self.cache_threshold is None or self.cache_kind == "none" \
            else f"{self.cache_kind}@{self.cache_threshold:g}"
        return cache + (f", {self.steps} steps" if self.steps else "")


LOSSLESS = Setting("none", None)


def configured(cfg: ServiceConfig, shape: Shape) -> Setting:
    """The setting the service would run ``shape`` at: its cache (a video's own), a per-shape threshold."""
    if shape.is_video:
        kind, t = cfg.video.cache.kind, cfg.video.cache.threshold
    else:
        kind, t = cfg.cache.kind, cfg.shape_cache.get(shape.label, {}).get("threshold", cfg.cache.threshold)
    return Setting(kind, None if kind == "none" else float(t))


@dataclass
class Item:
    """One rendered item: the 8-bit output (HxWxC, or FxHxWxC for a video) and what the call measured."""

    output: NDArray[np.uint8]
    seconds: float
    step_seconds: list[float]
    stages: dict[str, float]
    peak_bytes: int
    hits: int
    decisions: int


@dataclass
class Runner:
    """The pipelines of one config, built once (one deployment), rendering items under any setting."""

    cfg: ServiceConfig
    progress: Callable[[str], None] | None = None
    _pipes: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    _warm: set[tuple[str, str]] = field(default_factory=set)

    def _say(self, text: str) -> None:
        if self.progress is not None:
            self.progress(text)

    def pipeline(self, video: bool) -> tuple[Any, Any]:
        """(pipeline, instrumentation) of the image or video family, built on first use."""
        key = "video" if video else "image"
        if key not in self._pipes:
            self._pipes[key] = self._build(video)
        return self._pipes[key]

    def _build(self, video: bool) -> tuple[Any, Any]:
        from prometheus_client import CollectorRegistry

        from stepwatch.exporter.instrument import instrument
        from stepwatch.service.pipeline import build_pipeline, compile_transformer

        cfg = self.cfg
        t = time.perf_counter()
        if video:
            pipe = build_pipeline("wan", cfg.video.model, seed=cfg.seed, device=cfg.device, dtype=cfg.dtype)
        else:
            pipe = build_pipeline(cfg.family, cfg.model, seed=cfg.seed, device=cfg.device, dtype=cfg.dtype)
            if cfg.vae_tiling:
                pipe.vae.enable_tiling()
            if cfg.compile.enabled:
                compile_transformer(pipe.transformer, cfg.compile.mode, cfg.compile.backend)
        inst = instrument(pipe, registry=CollectorRegistry(), text_tokens=cfg.text_tokens)
        self._say(f"  built the {'video' if video else 'image'} pipeline in {time.perf_counter() - t:.1f} s")
        return pipe, inst

    def warm(self, shape: Shape, settings: list[Setting]) -> None:
        """One untimed call per cache kind (and, compiled, one whose middle steps all hit): the compile and the
        first call's allocations stay out of the timings, as the service's warm-up keeps them out of serving."""
        for s in settings:
            if (shape.label, s.cache_kind) in self._warm:
                continue
            self._warm.add((shape.label, s.cache_kind))
            self.render(shape, s, 0)
            if s.cache_kind == "first_block_cache" and self.cfg.compile.enabled and not shape.is_video:
                self.render(replace(shape, steps=max(3, shape.steps)), replace(s, cache_threshold=1e9), 0)

    def render(self, shape: Shape, setting: Setting, index: int) -> Item:
        """Item ``index`` of the set at ``shape`` under ``setting``."""
        from stepwatch.service.cache import apply_cache
        from stepwatch.service.pipeline import generate_images, generate_video
        from stepwatch.service.video import to_uint8

        pipe, inst = self.pipeline(shape.is_video)
        steps = setting.steps or shape.steps
        apply_cache(pipe, setting.cache_kind, setting.cache_threshold, steps=steps)
        req = replace(shape, steps=steps).request(index)
        t = time.perf_counter()
        if shape.is_video:
            out, _ = to_uint8(generate_video(pipe, req, self.cfg.text_tokens).frames[0])
        else:
            out, _ = to_uint8(generate_images(pipe, req, self.cfg.text_tokens).images)
            out = out[0]
        seconds = time.perf_counter() - t
        rep = inst.last_report
        if rep is None or rep.outcome != "ok":
            raise RuntimeError(f"{shape.label} item {index}: the call was not recorded ({rep and rep.error})")
        return Item(out, seconds, list(rep.step_seconds), dict(rep.stages),
                    int(rep.memory_peak_bytes.get("request", 0)), rep.hits, len(rep.cache_decisions))

    def side_by_side(self, shape: Shape, settings: list[Setting], images: int) -> list[list[Item]]:
        """Each item under every setting back to back, the order rotated per item (each setting first as often
        as the others, so a host's drift falls on all); settings[i]'s items.  With several cache kinds on a
        compiled pipeline, one kind's settings at a time: a switch of kind recompiles, once per block, and that
        call stays out of the timings."""
        self.warm(shape, settings)
        out: list[list[Item]] = [[] for _ in settings]
        kinds = list(dict.fromkeys(s.cache_kind for s in settings))
        groups = [[i for i, s in enumerate(settings) if s.cache_kind == k] for k in kinds] \
            if self.cfg.compile.enabled and len(kinds) > 1 else [list(range(len(settings)))]
        for group in groups:
            if len(groups) > 1:
                self.render(shape, settings[group[0]], 0)
            for i in range(images):
                k = i % len(group)
                for j in group[k:] + group[:k]:
                    out[j].append(self.render(shape, settings[j], i))
        return out

    def model(self, shape: Shape) -> str:
        """The model a shape runs on: the config's directory (its last part, never a path) or the tiny one."""
        from pathlib import Path

        cfg = self.cfg
        model, family = (cfg.video.model, "wan") if shape.is_video else (cfg.model, cfg.family)
        return Path(model).name if model else f"stepwatch-tiny-{family}-seed{cfg.seed}"

    def compile_mode(self, shape: Shape) -> str:
        """How the shape's pipeline runs: the config's compile for images; video eager, as the worker serves it."""
        c = self.cfg.compile
        return f"{c.backend}/{c.mode}" if c.enabled and not shape.is_video else "off (eager)"

    def describe(self) -> dict[str, Any]:
        """Engine, backend, precision and device of the image pipeline, for the report's header."""
        import torch

        pipe, _ = self.pipeline(False)
        ranks = self.cfg.ranks
        return {
            "engine": f"diffusers {_version('diffusers')}, torch {torch.__version__}",
            "attention_backend": "native (torch SDPA through diffusers' dispatch)",
            # One process, one rank: sequence parallelism changes a request's latency, not its GPU-seconds.
            "parallel_degree": 1 if ranks == 1 else f"1 (the config serves {ranks} ranks)",
            "precision": str(pipe.dtype).removeprefix("torch."),
            "device": device_info(str(pipe.device)),
        }


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def device_info(device: str) -> dict[str, Any]:
    """The device's model and count, and the driver and CUDA versions where there is a GPU."""
    import torch

    if device.startswith("cuda"):
        return {"type": "cuda", "model": torch.cuda.get_device_name(), "count": torch.cuda.device_count(),
                "driver": _nvidia_driver(), "cuda": torch.version.cuda}
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return {"type": "cpu", "model": model, "count": 1, "threads": torch.get_num_threads(), "driver": None,
            "cuda": None}


def _nvidia_driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return str(pynvml.nvmlSystemGetDriverVersion())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None
