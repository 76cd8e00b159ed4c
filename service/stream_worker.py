"""The worker's streaming sessions: one AnyFlowFAR pipeline per session slot, each session a thread.

A session is one chunked autoregressive call (``output_type="latent"``).  The step callback, at each chunk's
last step, decodes that chunk through the Wan VAE's causal decode cache (kept across the session's chunks, so
chunk by chunk gives the same frames as one decode of the whole clip) and sends its frames to the server at
once; then the call encodes the chunk into its KV cache and goes on.  A prompt change is written into the
call's prompt embeddings in place between chunks (the pipeline builds ``encoder_hidden_states`` once, and
without CFG it is that same tensor), so it reaches every chunk after the one in flight.  A close (by the
client or its idle timeout) stops the call at its next step.  When the call ends, its KV cache is the
call's garbage: the exporter's KV gauges drop its share (exporter/chunks.py), and the slot is free again.

Sessions run on their own threads beside the image loop: the main thread only starts them and passes prompt
changes and closes, so a long session never holds up image requests (both share the worker's CPUs and its
memory budget; a session that runs out fails alone, as an image request does).
"""

from __future__ import annotations

import gc
import io
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image
from prometheus_client import CollectorRegistry

from stepwatch.exporter import chunks, instrument
from stepwatch.exporter.memory import is_oom
from stepwatch.service.config import StreamConfig
from stepwatch.service.messages import (
    ErrorMsg,
    SessionAckMsg,
    SessionCloseMsg,
    SessionEndMsg,
    SessionMsg,
    SessionPromptMsg,
    internal_message,
)
from stepwatch.service.pipeline import build_pipeline, prompt_words

log = logging.getLogger("stepwatch.service.worker")
Send = Callable[[Any], None]
TEMPORAL = 4  # Wan's VAE: latent frames are 4 frames each in time


class KvCacheFull(MemoryError):
    """A session's KV window does not fit the KV memory its worker has free: an out-of-memory of stage kv_cache
    (the exporter counts it as one; the session fails, the worker serves on)."""

    stepwatch_stage = "kv_cache"

    def __init__(self, message: str, shape: str) -> None:
        super().__init__(message)
        self.stepwatch_shape = shape


class SessionClosed(Exception):
    """Raised from the step callback once the session was closed; the exporter counts the session closed."""

    stepwatch_outcome = "cancelled"


def partition(n: int) -> list[int]:
    """Latent frames per chunk of ``n``: one, then two per chunk (the tiny model's own schedule, extended)."""
    return [1] + [2] * (n - 1)


def frames_per_chunk(n: int) -> list[int]:
    """Frames out per chunk of a session (Wan's VAE: 4x in time, the first latent frame alone)."""
    return chunks.chunk_frames(partition(n), TEMPORAL)


def clip_frames(n: int) -> int:
    """Frames of a whole session of ``n`` chunks: the pipeline's ``num_frames`` and the shape label's frames."""
    return sum(frames_per_chunk(n))


class ChunkDecoder:
    """Decode a session's chunks one by one through the VAE's causal cache (as ``AutoencoderKLWan._decode`` does
    for the whole clip): frame-identical to one decode of every chunk's latents at the end."""

    def __init__(self, vae: Any) -> None:
        self.vae = vae
        cfg = vae.config
        self.mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1)
        self.std = torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1)
        self.first = True

    def decode(self, chunk_latents: Any) -> np.ndarray:
        """(B, T, C, h, w) latents of one chunk -> (F, H, W, 3) uint8 frames of its first video."""
        vae = self.vae
        z = chunk_latents.permute(0, 2, 1, 3, 4).to(self.mean.dtype) * self.std + self.mean
        if self.first:
            vae.clear_cache()
        vae._conv_idx = [0]
        out = vae.decoder(vae.post_quant_conv(z.to(vae.dtype)), feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                          first_chunk=self.first)
        self.first = False
        video = ((out[0].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # (3, F, H, W)
        return video.permute(1, 2, 3, 0).cpu().numpy()

    def close(self) -> None:
        self.vae.clear_cache()


def png_frames(frames: np.ndarray) -> list[bytes]:
    out = []
    for f in frames:
        buf = io.BytesIO()
        Image.fromarray(f).save(buf, format="PNG", compress_level=1)
        out.append(buf.getvalue())
    return out


@dataclass
class Slot:
    pipe: Any
    inst: Any
    session: LiveSession | None = None


@dataclass
class LiveSession:
    """A running session: what the main thread's prompt changes and closes hand to its thread."""

    id: str
    request: dict[str, Any]
    opened_at: float
    slot: Slot
    delivered: int = 0
    prompt_version: int = 0  # of the chunk in flight
    pending_prompt: str | None = None
    pending_version: int = 0
    closing: str | None = None  # closed or idle, once asked to stop
    kv_ledger_bytes: int = 0  # reserved at its start
    kv_bytes: int = 0  # read from the call's cache tensors (the exporter's report), once the call ran
    last_out: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


class LateSteps:
    """Samples chunks from ``from_chunk`` on with ``steps`` steps: FAR sets its scheduler's timesteps once per chunk,
    so this wraps that call on the scheduler instance for one call (the exporter's hook inside it still sees the
    steps each chunk really gets).  ``close`` puts the scheduler back; ``steps`` 0 changes nothing."""

    def __init__(self, scheduler: Any, steps: int, from_chunk: int) -> None:
        self.scheduler, self.steps, self.from_chunk, self.chunk = scheduler, steps, from_chunk, -1
        self.had_own = "set_timesteps" in vars(scheduler)
        self.inner = scheduler.set_timesteps
        if steps:
            scheduler.set_timesteps = self

    def __call__(self, num_inference_steps: int | None = None, *args: Any, **kwargs: Any) -> Any:
        self.chunk += 1
        n = self.steps if self.chunk >= self.from_chunk else num_inference_steps
        return self.inner(n, *args, **kwargs)

    def close(self) -> None:
        if not self.steps:
            return
        if self.had_own:
            self.scheduler.set_timesteps = self.inner
        else:
            del self.scheduler.set_timesteps


class StreamSessions:
    """The session slots of one worker and the sessions on them."""

    def __init__(self, cfg: StreamConfig, registry: CollectorRegistry, send: Send, *, seed: int, device: str,
                 dtype: str | None, text_tokens: int) -> None:
        self.cfg = cfg
        self.send = send
        self.text_tokens = text_tokens
        self.kv_cache = cfg.kv_cache
        self.window = cfg.window_chunks  # knobs stream_window_chunks, stream_steps: from the next streaming session on
        self.steps = cfg.steps
        self.late_steps = cfg.late_steps  # knob stream_late_steps: chunks from cfg.late_from_chunk on; 0: steps
        self.slots = [self._slot(registry, seed, device, dtype) for _ in range(cfg.max_sessions)]
        self.capacity = int(cfg.kv_capacity_mb * 2**20)
        self.reserved = 0  # KV bytes of the sessions running (the ledger's, reserved at each session's start)
        self.slots[0].inst.set_stream_kv_capacity(self.capacity)
        self._lock = threading.Lock()
        self.sessions: dict[str, LiveSession] = {}

    def _slot(self, registry: CollectorRegistry, seed: int, device: str, dtype: str | None) -> Slot:
        pipe = build_pipeline("far", model=self.cfg.model, seed=seed, device=device, dtype=dtype)
        inst = instrument(pipe, registry=registry, text_tokens=self.text_tokens, stream_fps=float(self.cfg.fps),
                          shapes=self.serving_shapes())
        return Slot(pipe, inst)

    def serving_shapes(self) -> list[str]:
        """The slots' shape allowlist: every stream size at the default chunks and steps (a session's frames vary
        with its chunks; every other shape is ``other``, so session lengths never become label values)."""
        frames = clip_frames(self.cfg.default_chunks)
        return [f"{s}x{frames}_{self.cfg.steps}s" for s in self.cfg.sizes]

    def apply_knobs(self, knobs: dict[str, Any]) -> dict[str, Any]:
        """The stream knobs (checked by knobs.validate); they apply from the next streaming session on."""
        if "stream_window_chunks" in knobs:
            self.window = int(knobs["stream_window_chunks"])
        if "stream_steps" in knobs:
            self.steps = int(knobs["stream_steps"])
        if "stream_late_steps" in knobs:
            self.late_steps = int(knobs["stream_late_steps"])
        return {"stream_window_chunks": self.window, "stream_steps": self.steps, "stream_late_steps": self.late_steps}

    def warm(self) -> None:
        """Short calls per slot: the first call of a pipeline pays one-off costs a client must not see, and FAR's
        attention masks go through torch.compile inside diffusers' flex attention, which compiles again when the
        size and when the number of chunks first change (then with those dimensions dynamic).  Each stream size
        at 2 chunks and at 3 covers both; a session shape first served live would page as a serving recompile."""
        for slot in self.slots:
            with slot.inst.warmup():
                for size in self.cfg.sizes:
                    w, h = (int(v) for v in size.split("x"))
                    for chunks in (2, 3):
                        s = LiveSession("warm-up", {"prompt": "warm up", "seed": 0, "width": w, "height": h,
                                                    "chunks": chunks, "steps": None}, time.perf_counter(), slot)
                        self._call(s, deliver=False)

    # ----- the main thread's side -----------------------------------------------------------
    def open(self, msg: SessionMsg) -> ErrorMsg | None:
        """Start the session on a free slot (its thread answers when it ends); a refusal when none is free."""
        with self._lock:
            slot = next((s for s in self.slots if s.session is None), None)
            if slot is None:
                return {"op": "error", "id": msg["id"], "kind": "busy",
                        "message": f"all {len(self.slots)} session slots of this worker are taken; retry later"}
            s = slot.session = LiveSession(msg["id"], msg["request"], msg["opened_at"], slot)
            self.sessions[s.id] = s
        n = int(s.request["chunks"])
        self.send({"op": "session_started", "id": s.id, "chunks": n, "frames_per_chunk": frames_per_chunk(n)})
        threading.Thread(target=self._run, args=(s,), daemon=True, name=f"stream-session-{s.id[:8]}").start()
        return None

    def set_prompt(self, msg: SessionPromptMsg) -> SessionAckMsg:
        s = self.sessions.get(msg["session"])
        if s is None:
            return _ack(msg["id"], msg["session"], False, 0, "no such session (it ended or never existed)")
        with s.lock:
            s.pending_prompt = msg["prompt"]
            s.pending_version += 1
            applies = s.delivered + 1
        return _ack(msg["id"], s.id, True, applies, f"the new prompt applies from chunk {applies}")

    def close(self, msg: SessionCloseMsg) -> SessionAckMsg:
        s = self.sessions.get(msg["session"])
        if s is None:
            return _ack(msg["id"], msg["session"], False, 0, "no such session (it ended or never existed)")
        with s.lock:
            s.closing = s.closing or msg.get("reason") or "closed"
            at = s.delivered
        return _ack(msg["id"], s.id, True, at, f"closing after {at} chunks")

    def close_all(self) -> None:
        for s in list(self.sessions.values()):
            s.closing = s.closing or "closed"

    # ----- the session's thread ---------------------------------------------------------------
    def _run(self, s: LiveSession) -> None:
        outcome: Literal["done", "closed", "failed"] = "done"
        reason, message = "done", ""
        failure: BaseException | None = None
        try:
            with s.slot.inst.stream_session(opened_at=s.opened_at):
                self._call(s, deliver=True)
        except SessionClosed:
            outcome, reason = "closed", s.closing or "closed"
        except Exception as exc:
            failure = exc
            outcome, reason = "failed", "oom" if is_oom(exc) else "error"
            message = internal_message(exc)
        finally:
            with self._lock:
                s.slot.session = None
                self.sessions.pop(s.id, None)
        if failure is not None:
            log.warning("session %s failed after %d chunks: %s", s.id[:8], s.delivered, failure,
                        exc_info=failure if reason == "error" else None)
            message = _failure_message(failure, s) if reason == "oom" else message
            del failure
        gc.collect()  # the call's KV cache and the exception's frames: freed before the slot is reused
        end: SessionEndMsg = {"op": "session_end", "id": s.id, "outcome": outcome, "reason": reason,
                              "chunks": s.delivered, "message": message, "kv_bytes": s.kv_bytes,
                              "kv_ledger_bytes": s.kv_ledger_bytes}
        self.send(end)

    def _call(self, s: LiveSession, deliver: bool) -> None:
        req, pipe = s.request, s.slot.pipe
        steps = int(req.get("steps") or self.steps)
        parts = partition(int(req["chunks"]))
        # Read once per call, at its allocation; FAR sizes the older chunks' cache as chunks - window + 1, so a
        # window longer than the session is the whole session at full resolution.
        pipe.transformer.register_to_config(full_chunk_limit=min(self.window, len(parts)))
        decoder = ChunkDecoder(pipe.vae)

        def on_step(p: Any, i: int, _t: Any, kw: dict[str, Any]) -> dict[str, Any]:
            if s.closing:
                raise SessionClosed(f"session closed ({s.closing}) after {s.delivered} chunks")
            if i == len(p.scheduler.timesteps) - 1:  # the chunk's last step: its latents are final
                frames = decoder.decode(kw["latents"])
                if deliver:
                    self._deliver(s, frames)
                self._take_prompt(s, p, kw["prompt_embeds"])
            return kw

        s.last_out = s.opened_at
        demand = s.kv_ledger_bytes = self._reserve(s, parts, steps)
        before = s.slot.inst.last_report
        late = self._late_steps(pipe, steps)
        try:
            pipe(prompt_words(req["prompt"]), height=int(req["height"]), width=int(req["width"]),
                 num_frames=clip_frames(len(parts)), num_inference_steps=steps, chunk_partition=parts,
                 output_type="latent", generator=torch.Generator().manual_seed(int(req["seed"])),
                 callback_on_step_end=on_step, callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"],
                 max_sequence_length=self.text_tokens, use_kv_cache=self.kv_cache)
        finally:
            late.close()
            with self._lock:
                self.reserved -= demand
            decoder.close()
            rep = s.slot.inst.last_report
            if rep is not before and rep is not None and rep.stream is not None:
                s.kv_bytes = int(rep.stream.kv_allocated_bytes)

    def _late_steps(self, pipe: Any, steps: int) -> LateSteps:
        """The later chunks' steps for this call (the knob as it was when the session started)."""
        late = self.late_steps if self.late_steps and self.late_steps != steps else 0
        return LateSteps(pipe.scheduler, late, self.cfg.late_from_chunk)

    def _reserve(self, s: LiveSession, parts: list[int], steps: int) -> int:
        """Reserve the session's KV bytes (the ledger's, for its window and geometry) or raise KvCacheFull."""
        req, pipe = s.request, s.slot.pipe
        w, h = int(req["width"]), int(req["height"])
        model = chunks.model_for(pipe, pipe.transformer)
        if model is None:
            return 0
        model = chunks.with_window(model, pipe.transformer)
        demand = chunks.marks_for(model, {"chunk_partition": parts}, h, w).ledger_bytes
        with self._lock:
            free = self.capacity - self.reserved
            if demand > free:
                shape = f"{w}x{h}x{clip_frames(len(parts))}_{steps}s"
                raise KvCacheFull(f"KV cache out of memory: the session's window of {self.window} chunks at {w}x{h} "
                                  f"needs {demand:,} bytes, {free:,} of {self.capacity:,} are free", shape)
            self.reserved += demand
        return demand

    def _deliver(self, s: LiveSession, frames: np.ndarray) -> None:
        now = time.perf_counter()
        pngs = png_frames(frames)
        with s.lock:
            index = s.delivered
            s.delivered += 1
            seconds, s.last_out = now - s.last_out, now
        self.send({"op": "chunk", "id": s.id, "index": index, "frames": pngs, "prompt_version": s.prompt_version,
                   "seconds": seconds})

    def _take_prompt(self, s: LiveSession, pipe: Any, prompt_embeds: Any) -> None:
        """A pending prompt change, written into the call's embeddings before the next chunk starts."""
        with s.lock:
            prompt, version = s.pending_prompt, s.pending_version
            s.pending_prompt = None
        if prompt is None:
            return
        new, _ = pipe.encode_prompt(prompt_words(prompt), do_classifier_free_guidance=False,
                                    max_sequence_length=self.text_tokens, device=prompt_embeds.device)
        prompt_embeds.copy_(new.to(prompt_embeds.dtype))
        s.prompt_version = version


def _ack(id_: str, session: str, ok: bool, applies_from: int, message: str) -> SessionAckMsg:
    return {"op": "session_ack", "id": id_, "session": session, "ok": ok, "applies_from": applies_from,
            "message": message}


def _failure_message(exc: BaseException, s: LiveSession) -> str:
    r = s.request
    if isinstance(exc, KvCacheFull):
        return (f"{exc}; fix: a shorter window (the stream_window_chunks knob), fewer chunks or a smaller size, or "
                "fewer sessions at once. The session failed at its start; the worker keeps serving.")
    return (f"out of memory streaming {r['width']}x{r['height']} x {r['chunks']} chunks after {s.delivered} "
            f"chunks ({type(exc).__name__}): a chunk did not fit the worker's memory; fix: a smaller size or a "
            "shorter window (the stream_window_chunks knob). The session failed; the worker keeps serving.")
