"""Chunked autoregressive video (seed 002): chunk times, the real-time factor and the KV cache.

A pipeline of this kind (diffusers' ``AnyFlowFARPipeline``: causal FAR over Wan) denoises a clip chunk by
chunk, each chunk attending to the past ones through a KV cache that the pipeline allocates once per call
and fills after each chunk (``encode_kv_cache``).  It is recognised by that method and by the denoiser's
``chunk_partition``; nothing else in the exporter changes for it.

What is recorded, and where:

  scheduler.set_timesteps   once per chunk: the chunk's start (the existing hook; the first one also
                            starts the denoise stage)
  pipeline.encode_kv_cache  after each chunk but the last: its frames are out (a streaming host decodes
                            and sends them in the step callback, which runs before this), and the cache's
                            tensors are read for their bytes once per chunk (sizes only: no device sync)

Chunk i's latency is the time between chunk i-1's frames and chunk i's (the first from the request's
start: what a client waits for its first frames).  The last chunk's frames are out when the VAE decode
starts, or the call returns (a host that decoded per chunk asks for latents).  The real-time factor is a
chunk's latency over the seconds its frames play: above 1 the stream stalls.

The KV ledger (seed 002): 2 (K and V) x d x layers x bytes per element per token, times the tokens the
window holds (the last ``full_chunk_limit`` chunks at full resolution, the older ones through FAR's
compressed patches) and the batch (doubled under CFG).  The tiny practice model's measured bytes equal it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from stepwatch.metrics import StreamMetrics

# Index ranges for the chunk-latency trend: bounded labels (a chunk index is never a label value).
INDEX_RANGES: tuple[tuple[int, int, str], ...] = (
    (0, 0, "0"), (1, 1, "1"), (2, 3, "2-3"), (4, 7, "4-7"), (8, 15, "8-15"), (16, 1 << 30, "16+"))
SESSION_OUTCOMES = ("done", "closed", "failed")  # stepwatch_stream_sessions_total{outcome}
DEFAULT_FPS = 16.0  # Wan's playback rate; InstrumentOptions.stream_fps overrides it


def index_range(i: int) -> str:
    for lo, hi, label in INDEX_RANGES:
        if lo <= i <= hi:
            return label
    return INDEX_RANGES[-1][2]


@dataclass(frozen=True)
class ChunkModel:
    """What the chunk timings and the KV ledger need from a chunked pipeline, read once."""

    partition: tuple[int, ...]  # latent frames per chunk (the default; a call may pass its own)
    layers: int
    heads: int
    head_dim: int
    full_chunk_limit: int
    patch: tuple[int, int, int]
    compressed_patch: tuple[int, int, int]
    spatial: int  # VAE spatial scale
    temporal: int  # VAE temporal scale
    element_bytes: int  # of the denoiser's weights: the pipeline allocates the cache in the latents' dtype

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    def tokens_per_frame(self, height: int, width: int) -> tuple[int, int]:
        """(full-resolution, compressed) tokens per latent frame."""
        lat_h, lat_w = height // self.spatial, width // self.spatial
        return ((lat_h // self.patch[1]) * (lat_w // self.patch[2]),
                (lat_h // self.compressed_patch[1]) * (lat_w // self.compressed_patch[2]))

    def window_tokens(self, height: int, width: int, partition: tuple[int, ...]) -> int:
        """Tokens the KV window holds: ``full_chunk_limit`` chunks of the largest size at full resolution and
        the rest of the clip through the compressed patches (as the pipeline allocates them)."""
        full, compressed = self.tokens_per_frame(height, width)
        biggest = max(partition)
        older = max(0, len(partition) - self.full_chunk_limit + 1)
        return self.full_chunk_limit * biggest * full + older * biggest * compressed

    def kv_bytes(self, tokens: int, element_bytes: int, batch: int) -> int:
        """The seeds' ledger: 2 x d x layers x bytes per token, for ``tokens`` tokens and ``batch`` samples."""
        return 2 * self.hidden * self.layers * element_bytes * tokens * batch

    def chunk_frames(self, partition: Sequence[int]) -> list[int]:
        return chunk_frames(partition, self.temporal)


def chunk_frames(partition: Sequence[int], temporal: int) -> list[int]:
    """Output frames per chunk: the first latent frame decodes to one frame, every later one to ``temporal``
    (Wan's causal VAE: T latent frames -> 1 + 4 (T - 1))."""
    return [1 + temporal * (n - 1) if i == 0 else temporal * n for i, n in enumerate(partition)]


def model_for(pipe: Any, denoiser: Any) -> ChunkModel | None:
    """The chunk model of a chunked autoregressive pipeline, None for any other."""
    if not callable(getattr(pipe, "encode_kv_cache", None)):
        return None
    cfg = getattr(denoiser, "config", None)
    if cfg is None or not cfg.get("chunk_partition"):
        return None
    try:
        element = next(denoiser.parameters()).element_size()
    except (AttributeError, StopIteration, TypeError):
        element = 4
    try:
        return ChunkModel(
            partition=tuple(int(n) for n in cfg["chunk_partition"]), layers=int(cfg["num_layers"]),
            heads=int(cfg["num_attention_heads"]), head_dim=int(cfg["attention_head_dim"]),
            full_chunk_limit=int(cfg.get("full_chunk_limit", 3)), patch=tuple(cfg["patch_size"]),
            compressed_patch=tuple(cfg.get("compressed_patch_size", cfg["patch_size"])),
            spatial=int(getattr(pipe, "vae_scale_factor_spatial", 8) or 8),
            temporal=int(getattr(pipe, "vae_scale_factor_temporal", 4) or 4), element_bytes=int(element))
    except (KeyError, TypeError, ValueError):
        return None


def with_window(model: ChunkModel, denoiser: Any) -> ChunkModel:
    """The model with the denoiser's current window (``full_chunk_limit``): the pipeline reads it at each call's
    allocation, and a host may change it between calls."""
    try:
        limit = int(denoiser.config.get("full_chunk_limit", model.full_chunk_limit))
    except (AttributeError, TypeError, ValueError):
        return model
    return model if limit == model.full_chunk_limit else replace(model, full_chunk_limit=limit)


def cache_bytes(kv_cache: Any) -> tuple[int, int]:
    """(bytes, bytes per element) of every tensor in the pipeline's KV cache: {layer: {name: tensor}}."""
    total, element = 0, 0
    if not isinstance(kv_cache, dict):
        return 0, 0
    for layer in kv_cache.values():
        for t in (layer.values() if isinstance(layer, dict) else ()):
            size = t.element_size()
            total += t.nelement() * size
            element = size
    return total, element


@dataclass
class KvReading:
    """One read of the cache after a chunk was encoded into it."""

    allocated: int
    element_bytes: int
    cached_chunks: int


@dataclass
class StreamMarks:
    """What one chunked call records: the chunks' starts and frames-out marks, and each cache read."""

    partition: tuple[int, ...]
    batch: int  # samples in the KV cache: videos per prompt, doubled under CFG
    height: int
    width: int
    window_tokens: int  # the call's KV window and its ledger bytes, fixed by its geometry: computed once
    ledger_bytes: int
    starts: list[Any]
    outs: list[Any]
    kv: list[KvReading]
    lead_seconds: float = 0.0  # a session's open to this call's start (Instrumentation.stream_session)
    published: int = 0  # chunks already on the series (as their frames came out, while the call runs)


@dataclass
class StreamReport:
    """One chunked call, resolved: per-chunk latency and real-time factor, the KV cache and its ledger."""

    chunk_seconds: list[float]  # chunk 0 from the request's start
    chunk_frames: list[int]
    realtime_factors: list[float]  # chunks after the first
    kv_allocated_bytes: int
    kv_in_use_bytes: int
    kv_ledger_bytes: int
    window_tokens: int
    fps: float
    lead_seconds: float = 0.0
    steps: int = 0

    @property
    def first_chunk_seconds(self) -> float | None:
        """What the client waited for its first frames: from the session's open where a host marked one."""
        return self.chunk_seconds[0] + self.lead_seconds if self.chunk_seconds else None


def marks_for(model: ChunkModel, params: dict[str, Any], height: int | None, width: int | None) -> StreamMarks:
    """A chunked call's marks from its bound parameters (its own ``chunk_partition`` or the model's), with its
    KV window and the ledger's bytes for it (0 when the call's size is unknown)."""
    partition = tuple(int(n) for n in (params.get("chunk_partition") or model.partition))
    gs = params.get("guidance_scale")
    batch = int(params.get("num_videos_per_prompt") or 1) * (2 if gs is not None and gs > 1 else 1)
    h, w = height or 0, width or 0
    window = model.window_tokens(h, w, partition) if h and w else 0
    return StreamMarks(partition=partition, batch=batch, height=h, width=w, window_tokens=window,
                       ledger_bytes=model.kv_bytes(window, model.element_bytes, batch), starts=[], outs=[], kv=[])


def ready_chunks(model: ChunkModel, marks: StreamMarks, seconds: Any, start: Any,
                 ready: Any) -> list[tuple[int, float, int]]:
    """(index, latency, frames) of every chunk whose frames are out and not yet published, up to the first mark
    the clock cannot read yet (a CUDA event still pending): what a running call publishes chunk by chunk."""
    out = []
    frames = model.chunk_frames(marks.partition)
    while marks.published < len(marks.outs) and ready(marks.outs[marks.published]):
        i = marks.published
        prev = start if i == 0 else marks.outs[i - 1]
        out.append((i, seconds(prev, marks.outs[i]), frames[i] if i < len(frames) else 0))
        marks.published += 1
    return out


def in_use_bytes(model: ChunkModel, marks: StreamMarks, reading: KvReading) -> int:
    """Bytes of the allocation the encoded chunks fill: the last ``full_chunk_limit`` of them at full
    resolution, the older ones compressed, as a share of the window's tokens.  From the cache's own chunk
    counter: reading the tensors' contents would synchronize a GPU once per chunk."""
    window = marks.window_tokens
    if window <= 0:
        return 0
    full, compressed = model.tokens_per_frame(marks.height, marks.width)
    cached = marks.partition[:reading.cached_chunks]
    recent, older = cached[-model.full_chunk_limit:], cached[:-model.full_chunk_limit]
    used = sum(recent) * full + sum(older) * compressed
    return int(reading.allocated * min(1.0, used / window))


def resolve(model: ChunkModel, marks: StreamMarks, seconds: Any, start: Any, last_out: Any,
            fps: float, steps: int = 0) -> StreamReport | None:
    """Chunk latencies from the frames-out marks (the last chunk's is ``last_out``: the VAE decode's start or
    the call's end), the real-time factor of each later chunk, and the last cache reading against the ledger."""
    if not marks.starts:
        return None
    outs = list(marks.outs)
    if last_out is not None and len(outs) < len(marks.partition):  # None: the call failed in its last chunk
        outs.append(last_out)
    if not outs:
        return None
    times = [seconds(start, m) for m in outs]
    latencies = [times[0], *(b - a for a, b in itertools.pairwise(times))]
    frames = model.chunk_frames(marks.partition)[:len(latencies)]
    rtf = [lat / (n / fps) for lat, n in zip(latencies[1:], frames[1:], strict=False) if n > 0 and fps > 0]
    last = marks.kv[-1] if marks.kv else None
    return StreamReport(chunk_seconds=latencies, chunk_frames=frames, realtime_factors=rtf,
                        kv_allocated_bytes=last.allocated if last is not None else 0,
                        kv_in_use_bytes=in_use_bytes(model, marks, last) if last is not None else 0,
                        kv_ledger_bytes=marks.ledger_bytes, window_tokens=marks.window_tokens, fps=fps,
                        lead_seconds=marks.lead_seconds, steps=steps)


class StreamPublisher:
    """The chunk series of one worker: per-call observations, and the KV gauges of the calls in flight
    (summed over them: a worker may serve several sessions; each call's share leaves when it ends)."""

    @classmethod
    def shared(cls, m: StreamMetrics) -> StreamPublisher:
        """One per metric set: every chunked pipeline instrumented on a registry (a worker's session slots)
        adds its calls to the same worker gauges instead of overwriting them."""
        pub = m.__dict__.get("_stream_publisher")
        if pub is None:
            pub = m.__dict__["_stream_publisher"] = cls(m)
        return pub

    def __init__(self, m: StreamMetrics) -> None:
        self.m = m
        self._by_index = {label: m.stream_chunk_index_duration_seconds.labels(chunk_index=label)
                          for _, _, label in INDEX_RANGES}
        self._allocated = m.stream_kv_cache_bytes.labels(state="allocated")
        self._in_use = m.stream_kv_cache_bytes.labels(state="in_use")
        self._live: dict[int, tuple[int, int, int]] = {}  # id(call marks) -> (allocated, in use, ledger)
        self._lock = threading.Lock()
        self._allocated.set(0)
        self._in_use.set(0)
        self._active = 0
        m.stream_sessions_active.set(0)
        m.stream_kv_cache_capacity_bytes.set(0)
        for outcome in SESSION_OUTCOMES:
            m.stream_sessions_total.labels(outcome=outcome)

    def session_opened(self) -> None:
        with self._lock:
            self._active += 1
            self.m.stream_sessions_active.set(self._active)

    def session_ended(self, outcome: str, seconds: float) -> None:
        with self._lock:
            self._active = max(0, self._active - 1)
            self.m.stream_sessions_active.set(self._active)
        self.m.stream_sessions_total.labels(outcome=outcome if outcome in SESSION_OUTCOMES else "failed").inc()
        self.m.stream_session_duration_seconds.observe(max(0.0, seconds))

    def live(self, key: int, allocated: int, in_use: int, ledger: int) -> None:
        """A call's cache after a chunk was encoded into it."""
        with self._lock:
            self._live[key] = (allocated, in_use, ledger)
            self._set_gauges()

    def done(self, key: int) -> None:
        """The call ended: its cache is the pipeline's garbage now."""
        with self._lock:
            if self._live.pop(key, None) is not None:
                self._set_gauges()

    def _set_gauges(self) -> None:
        values = self._live.values()
        self._allocated.set(sum(v[0] for v in values))
        self._in_use.set(sum(v[1] for v in values))
        self.m.stream_kv_cache_ledger_bytes.set(sum(v[2] for v in values))

    def chunk(self, index: int, seconds: float, frames: int, fps: float, lead: float = 0.0) -> None:
        """One chunk's latency (chunk 0: from the call's start, plus the session's lead for the first-chunk
        series) and, after the first, its real-time factor."""
        m = self.m
        if index == 0:
            m.stream_first_chunk_seconds.observe(seconds + lead)
        m.stream_chunk_duration_seconds.observe(seconds)
        self._by_index[index_range(index)].observe(seconds)
        if index > 0 and frames > 0 and fps > 0:
            m.stream_realtime_factor_ratio.observe(seconds / (frames / fps))

    def publish(self, r: StreamReport, from_index: int = 0) -> None:
        """A call's end: its chunks not yet published as they came out, its steps and its window."""
        m = self.m
        for i in range(from_index, len(r.chunk_seconds)):
            self.chunk(i, r.chunk_seconds[i], r.chunk_frames[i], r.fps, r.lead_seconds)
        if r.steps:
            m.stream_steps_total.inc(r.steps)
        if r.window_tokens:
            m.stream_kv_window_tokens.set(r.window_tokens)
