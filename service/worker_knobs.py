"""The worker's knobs: the cache, attention, compile and video settings applied to its pipelines.

A part of ``service/worker.py``'s Worker (which holds the state it reads and
decides when a changed knob needs a re-warm).  Only the worker process imports it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch._dynamo

from stepwatch.service.cache import apply_cache, current
from stepwatch.service.config import ServiceConfig
from stepwatch.service.pipeline import compile_transformer
from stepwatch.service.video import set_decode_chunk


class Knobs:
    """Applies one knob at a time to the Worker's pipelines; each says whether a compiled service must re-warm."""

    cfg: ServiceConfig
    pipe: Any
    inst: Any
    video_pipe: Any
    knobs: dict[str, Any]
    compile_active: bool

    def _apply_attention(self, knobs: dict[str, Any]) -> bool:
        """The attention backend knob (diffusers' dispatch); True when a compiled service must re-warm."""
        self.knobs.setdefault("attention_backend", "native")
        backend = knobs.get("attention_backend")
        if backend is None or backend == self.knobs["attention_backend"]:
            return False
        # "native" is set, not reset: diffusers' reset_attention_backend() leaves the forced kernel in use.
        self.pipe.transformer.set_attention_backend(backend)
        self.knobs["attention_backend"] = backend
        return self.compile_active

    def _apply_video_knobs(self, knobs: dict[str, Any]) -> None:
        """The video pipeline's own cache (a distilled model should have none) and its decode chunk."""
        vp = self.video_pipe
        if vp is None:
            return
        if "video_cache" in knobs or "video_cache_threshold" in knobs:
            kind = knobs.get("video_cache", self.knobs.get("video_cache", "none"))
            threshold = knobs.get("video_cache_threshold", self.knobs.get("video_cache_threshold"))
            apply_cache(vp, kind, threshold, steps=self.cfg.video.default_steps)
            self.knobs["video_cache"], self.knobs["video_cache_threshold"] = kind, threshold
        if "video_decode_chunk_frames" in knobs:
            set_decode_chunk(vp.vae, int(knobs["video_decode_chunk_frames"]))
            self.knobs["video_decode_chunk_frames"] = int(knobs["video_decode_chunk_frames"])

    @property
    def _rank_reporter(self) -> Any:
        """The instrumentation's rank reporter (None with one rank or before set-up)."""
        return self.inst.options.rank_reporter if self.inst is not None else None

    @property
    def _stamp(self) -> Any:
        """With ranks, the rank reporter's stamp: the cache's agreement all-reduce counts as a collective."""
        reporter = self._rank_reporter
        return reporter.stamp if reporter is not None else None

    def close_ranks(self) -> None:
        """Stop the rank reporter's shipping thread before the process group goes (see RankReporter.close)."""
        if self._rank_reporter is not None:
            self._rank_reporter.close()

    def _apply_cache(self, knobs: dict[str, Any]) -> bool:
        """The cache knobs; True when the cache kind changed on a compiled service (it must re-warm)."""
        if "cache" not in knobs and "cache_threshold" not in knobs:
            return False
        before = current(self.pipe.transformer)[0]
        kind = knobs.get("cache", before)
        threshold = knobs.get("cache_threshold", self.knobs.get("cache_threshold"))
        apply_cache(self.pipe, kind, threshold, steps=self.cfg.default_steps, stamp=self._stamp)
        self.knobs["cache"] = kind
        self.knobs["cache_threshold"] = threshold
        # Another cache kind changes the blocks' forward: a compiled service re-warms its shapes, as a
        # redeploy with the new config would (a threshold change alone edits the hook in place).
        return bool(kind != before and self.compile_active)

    def _set_compile(self, on: bool) -> None:
        # FX marks "tracing" in one flag for the whole process, and a compile traces: while a streaming session's
        # thread compiles or traces, a compiled block called on this thread would raise "FX to symbolically trace a
        # dynamo-optimized function". Off, that call runs the block eagerly once (same result); the next compiles.
        torch._dynamo.config.error_on_nested_fx_trace = False
        tr = self.pipe.transformer
        if on:
            compile_transformer(tr, self.cfg.compile.mode, self.cfg.compile.backend)
        else:
            for m in tr.modules():
                if getattr(m, "_compiled_call_impl", None) is not None:
                    m._compiled_call_impl = None
        self.compile_active = on
