"""The runtime knobs (POST /admin/knobs): one validation, run by the server before it forwards them and
by the worker before it applies them, so a bad knob is refused the same way whoever sends it.

A knob set is a JSON object of any of the names in ``KNOB_TYPES``.  A bad one raises ``KnobError``
naming the knob (the server answers it as a 400).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from stepwatch.exporter.shapes import ShapeKey
from stepwatch.service.cache import KINDS

KNOB_TYPES: dict[str, type | tuple[type, ...]] = {
    "cache": str, "cache_threshold": (int, float), "vae_tiling": bool, "compile": bool,
    "rank_delay_seconds": dict, "baselines": dict, "drop_compiled_graphs": bool, "attention_backend": str,
    # the video pipeline's own (a distilled model should run without a cache) and its frame-chunked decode
    "video_cache": str, "video_cache_threshold": (int, float), "video_decode_chunk_frames": int,
    # streaming sessions (service/stream_worker.py): from the next session on
    "stream_window_chunks": int, "stream_steps": int, "stream_kv_cache": bool, "stream_late_steps": int,
}
VIDEO_KNOBS = ("video_cache", "video_cache_threshold", "video_decode_chunk_frames")
STREAM_KNOBS = ("stream_window_chunks", "stream_steps", "stream_kv_cache", "stream_late_steps")
MAX_STREAM_STEPS = 64
# diffusers' attention dispatch backends the practice service accepts: "native" (PyTorch's SDPA picking its
# kernel, the start-up value) and the forced SDPA kernels and flex.  A kernel the device cannot run is
# accepted, as a deploy would be, and fails every generation with a non-OOM error (on CPU: cuDNN and
# memory-efficient SDPA): the request-error drill's real misconfiguration.
ATTENTION_BACKENDS = ("native", "_native_math", "_native_cudnn", "_native_efficient", "_native_flash", "flex")
BASELINE_FIELDS = ("step_seconds", "cache_hit_ratio")


class KnobError(ValueError):
    """A bad knob; ``param`` names it (None when the whole body is wrong)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def finite_nonneg(v: Any) -> bool:
    """A real number (not a bool) in [0, inf)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and math.isfinite(v)


def validate(knobs: Any, ranks: int, video: bool = True, stream: bool = False) -> dict[str, Any]:
    """``knobs`` if every knob is known, of its type and in range for a service of ``ranks`` ranks (``video``,
    ``stream``: whether it serves video jobs and streaming sessions, without which their knobs are refused)."""
    if not isinstance(knobs, dict) or not knobs:
        raise KnobError("expected a JSON object of knobs", None)
    for k, v in knobs.items():
        _check_type(k, v)
    _check_video(knobs, video)
    _check_stream(knobs, stream)
    if "cache_threshold" in knobs and not finite_nonneg(knobs["cache_threshold"]):
        raise KnobError(f"cache_threshold must be a finite number >= 0, got {knobs['cache_threshold']}",
                        "cache_threshold")
    if "cache" in knobs and knobs["cache"] not in KINDS:
        raise KnobError(f"cache {knobs['cache']!r} is not one of {', '.join(KINDS)}", "cache")
    if "attention_backend" in knobs and knobs["attention_backend"] not in ATTENTION_BACKENDS:
        raise KnobError(f"attention_backend {knobs['attention_backend']!r} is not one of "
                        f"{', '.join(ATTENTION_BACKENDS)}", "attention_backend")
    if "baselines" in knobs:
        _check_baselines(knobs["baselines"])
    if "rank_delay_seconds" in knobs:
        _check_rank_delays(knobs["rank_delay_seconds"], ranks)
    return knobs


def _check_video(knobs: dict[str, Any], video: bool) -> None:
    named = [k for k in VIDEO_KNOBS if k in knobs]
    if named and not video:
        raise KnobError(f"{named[0]}: this service serves no video jobs", named[0])
    if "video_cache" in knobs and knobs["video_cache"] not in KINDS:
        raise KnobError(f"video_cache {knobs['video_cache']!r} is not one of {', '.join(KINDS)}", "video_cache")
    if "video_cache_threshold" in knobs and not finite_nonneg(knobs["video_cache_threshold"]):
        raise KnobError("video_cache_threshold must be a finite number >= 0", "video_cache_threshold")
    if "video_decode_chunk_frames" in knobs and knobs["video_decode_chunk_frames"] < 0:
        raise KnobError("video_decode_chunk_frames must be >= 0 (0: the whole clip in one decoder call)",
                        "video_decode_chunk_frames")


def _check_stream(knobs: dict[str, Any], stream: bool) -> None:
    named = [k for k in STREAM_KNOBS if k in knobs]
    if named and not stream:
        raise KnobError(f"{named[0]}: this service serves no streaming sessions", named[0])
    if "stream_window_chunks" in knobs and knobs["stream_window_chunks"] < 2:
        # FAR builds no attention mask for a window of one chunk (diffusers raises in torch.cat).
        raise KnobError("stream_window_chunks must be >= 2", "stream_window_chunks")
    if "stream_steps" in knobs and not 1 <= knobs["stream_steps"] <= MAX_STREAM_STEPS:
        raise KnobError(f"stream_steps must be within 1..{MAX_STREAM_STEPS}", "stream_steps")
    if "stream_late_steps" in knobs and not 0 <= knobs["stream_late_steps"] <= MAX_STREAM_STEPS:
        raise KnobError(f"stream_late_steps must be within 0..{MAX_STREAM_STEPS} (0: as stream_steps)",
                        "stream_late_steps")
    if knobs.get("stream_kv_cache") is False:
        raise KnobError("stream_kv_cache: false is refused: AnyFlowFAR fails every call without its KV cache in "
                        "this diffusers (the transformer returns one value where the pipeline unpacks two)",
                        "stream_kv_cache")


def baseline_shapes(baselines: dict[str, Any]) -> dict[str, Any]:
    """The per-shape table of a baselines knob: either the table itself or a baselines file's ``shapes``."""
    shapes: dict[str, Any] = baselines.get("shapes", baselines)
    return shapes


def _check_type(k: str, v: Any) -> None:
    if k not in KNOB_TYPES:
        raise KnobError(f"unknown knob {k!r}; known: {', '.join(KNOB_TYPES)}", k)
    typ = KNOB_TYPES[k]
    if (isinstance(v, bool) and typ is not bool) or not isinstance(v, typ):
        raise KnobError(f"knob {k!r} has the wrong type ({type(v).__name__})", k)


def _check_baselines(baselines: dict[str, Any]) -> None:
    shapes = baseline_shapes(baselines)
    if not isinstance(shapes, dict):
        raise KnobError("baselines: expected {shape: {step_seconds, cache_hit_ratio}}", "baselines")
    for shape, vals in shapes.items():
        try:
            ShapeKey.parse(str(shape))
        except ValueError as e:
            raise KnobError(f"baselines: {e}", "baselines") from None
        if not isinstance(vals, dict) or not all(k in BASELINE_FIELDS and finite_nonneg(v) for k, v in vals.items()):
            raise KnobError(f"baselines: {shape}: expected {{step_seconds, cache_hit_ratio}} >= 0", "baselines")


def _check_rank_delays(delays: dict[str, Any], ranks: int) -> None:
    for r, d in delays.items():
        rank = str(r)
        if not (rank.isascii() and rank.isdigit()) or int(rank) >= ranks or not finite_nonneg(d):
            raise KnobError(f"rank_delay_seconds: rank {r!r} / delay {d!r} invalid (ranks: {ranks})",
                            "rank_delay_seconds")


class KnobGate:
    """Generations and knob calls take turns on the worker; a knob call waiting goes before the next generation.

    A knob that re-warms (another cache kind, compile back on) runs for many seconds.  A generation sent
    behind it would be timed as in flight all along, read as a stalled worker (a critical alert) and get
    the worker restarted: found by the cache-off drill.  Generations wait in the queue instead, where
    their wait is queue wait.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._knob_calls = 0
        self._generating = False

    @contextmanager
    def generation(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._knob_calls)
            self._generating = True
        try:
            yield
        finally:
            with self._cond:
                self._generating = False
                self._cond.notify_all()

    @contextmanager
    def knobs(self) -> Iterator[None]:
        with self._cond:
            self._knob_calls += 1
            self._cond.wait_for(lambda: not self._generating)
        try:
            yield
        finally:
            with self._cond:
                self._knob_calls -= 1
                self._cond.notify_all()
