"""The worker's requests: one image request or video job through its pipeline, and the message that answers it.

A part of ``service/worker.py``'s Worker (which holds the state it reads):
running a request, encoding its output, and cleaning up and explaining a
failure (an OOM names the stage and the fix).  Only the worker process imports it.
"""

from __future__ import annotations

import gc
import io
import logging
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from PIL import Image

from stepwatch.exporter.memory import is_oom
from stepwatch.procs import large_blocks_returned_when_freed, malloc_trim
from stepwatch.service.api import GenerationRequest
from stepwatch.service.cache import apply_cache, current
from stepwatch.service.config import ServiceConfig
from stepwatch.service.messages import ErrorMsg, GenerateMsg, ResultMsg, internal_message
from stepwatch.service.pipeline import generate_images, generate_video
from stepwatch.service.shape_cache import threshold_for
from stepwatch.service.video import CONTENT_TYPE, JobCancelled, encode_mp4, to_uint8
from stepwatch.service.worker_memory import TRIM_SLACK_BYTES, vm_status

log = logging.getLogger("stepwatch.service.worker")


class Requests:
    """Runs requests on the Worker's pipelines and builds their result or error messages."""

    cfg: ServiceConfig
    conn: Connection | None
    cancel: Any
    rank: int
    pipe: Any
    inst: Any
    video_pipe: Any
    video_inst: Any
    knobs: dict[str, Any]
    rank_delays: dict[int, float]
    rss_floor: int
    send: Callable[[Any], None]
    _stamp: Any

    def _run(self, req: GenerationRequest, per_shape: bool = True) -> Any:
        """One image request; ``per_shape`` False leaves the cache threshold as set (a warm-up that forces hits)."""
        delay = self.rank_delays.get(self.rank, 0.0)
        callback = None
        if delay > 0:
            def callback(_p: Any, _i: int, _t: Any, kw: dict[str, Any]) -> dict[str, Any]:
                time.sleep(delay)  # a straggler: this rank's every step is slower
                return kw
        if per_shape:
            self._shape_cache(req)
        return generate_images(self.pipe, req, self.cfg.text_tokens, callback)

    def _shape_cache(self, req: GenerationRequest) -> None:
        """Set the first-block-cache threshold this request's shape runs at (config ``shape_cache``): an edit in
        place, only when it differs from the one in force."""
        table = {k: v["threshold"] for k, v in self.cfg.shape_cache.items()}
        if not table:
            return
        want = threshold_for(req.shape, table, self.knobs, (self.cfg.cache.kind, self.cfg.cache.threshold))
        if want is not None and current(self.pipe.transformer)[1] != want:
            apply_cache(self.pipe, "first_block_cache", want, steps=self.cfg.default_steps, stamp=self._stamp)

    def _run_video(self, req: GenerationRequest, msg_id: str | None) -> Any:
        """One video job on the video pipeline; each step reports progress (``msg_id``) and checks whether the
        job was cancelled (JobCancelled, raised from the step callback, stops it within a step)."""

        def on_step(_p: Any, i: int, _t: Any, kw: dict[str, Any]) -> dict[str, Any]:
            if self.cancel is not None and req.job and self.cancel.value == req.job:
                raise JobCancelled(f"video job {req.job} cancelled at step {i + 1} of {req.steps}")
            if msg_id is not None and self.conn is not None:
                self.send({"op": "progress", "id": msg_id, "step": i + 1, "steps": req.steps})
            return kw

        return generate_video(self.video_pipe, req, self.cfg.text_tokens, on_step)

    def generate(self, msg: GenerateMsg) -> ResultMsg | ErrorMsg:
        req = GenerationRequest(**msg["request"])
        if req.is_video and self.video_pipe is None:
            return {"op": "error", "id": msg["id"], "kind": "internal", "message": "video is off on this worker"}
        t = time.perf_counter()
        failure: tuple[bool, str] | None = None
        cancelled = False
        try:
            if req.is_video:
                with large_blocks_returned_when_freed():
                    out = self._run_video(req, msg["id"])
            else:
                out = self._run(req)
        except JobCancelled:
            cancelled = True
        except Exception as exc:
            if not is_oom(exc):
                log.exception("request %s failed", req.shape)
            failure = (is_oom(exc), internal_message(exc))
        if cancelled:
            return self._cancelled(msg["id"], req)
        if failure is not None:
            # Out of the except block: the exception and its frames (the failed request's tensors) are gone.
            return self._failed(msg["id"], req, *failure)
        if req.is_video:
            return self._video_result(msg["id"], req, out, time.perf_counter() - t)
        seconds = time.perf_counter() - t
        pngs, nonfinite = encode_images(out.images)
        rss = self._trim_if_grown()
        rep = self.inst.last_report
        return {
            "op": "result", "id": msg["id"], "images": pngs, "seconds": seconds, "nonfinite": nonfinite,
            "shape": str(rep.shape) if rep and rep.shape else req.shape,
            "stages": dict(rep.stages) if rep else {}, "steps": len(rep.step_seconds) if rep else req.steps,
            "cache": {"kind": rep.cache, "hits": rep.hits, "misses": rep.misses} if rep else None,
            "compiles": len(rep.compiles) if rep else 0, "rss_bytes": rss,
            "ranks": {"step_seconds": rep.extra.get("rank_step_seconds"), "skew": rep.extra.get("rank_skew"),
                      "requests_ago": rep.extra.get("rank_requests_ago")}
            if rep and "rank_skew" in rep.extra else None,
        }

    def _video_result(self, id_: str, req: GenerationRequest, out: Any, seconds: float) -> ResultMsg:
        """The finished job: its frames encoded as MP4 (the encoding is the worker's, not the pipeline's, time)."""
        frames, nonfinite = to_uint8(out.frames[0])
        del out
        t = time.perf_counter()
        mp4 = encode_mp4(frames, self.cfg.video.fps)
        encode_s = time.perf_counter() - t
        rss = self._trim_if_grown()
        rep = self.video_inst.last_report
        return {
            "op": "result", "id": id_, "images": [mp4], "seconds": seconds, "nonfinite": nonfinite,
            "shape": req.shape, "stages": {**(dict(rep.stages) if rep else {}), "encode": encode_s},
            "steps": len(rep.step_seconds) if rep else req.steps,
            "cache": {"kind": rep.cache, "hits": rep.hits, "misses": rep.misses} if rep else None,
            "compiles": len(rep.compiles) if rep else 0, "rss_bytes": rss, "ranks": None,
            "content_type": CONTENT_TYPE, "frames": int(frames.shape[0]),
        }

    def _cancelled(self, id_: str, req: GenerationRequest) -> ErrorMsg:
        self._reset_after_failure(self.video_pipe)
        return {"op": "error", "id": id_, "kind": "cancelled", "shape": req.shape,
                "message": f"video job cancelled by its client ({req.shape})"}

    def _reset_after_failure(self, pipe: Any) -> None:
        # diffusers resets cache-hook state only at the end of a call that finished: a call that died
        # mid-way would leave the next one starting from stale residuals.
        reset = getattr(pipe.transformer, "_reset_stateful_cache", None)
        if reset is not None:
            reset()
        gc.collect()
        malloc_trim()

    def _failed(self, id_: str, req: GenerationRequest, oom: bool, detail: str) -> ErrorMsg:
        """Clean up after a failed request and say why it failed (an OOM names the stage and the fix)."""
        inst = self.video_inst if req.is_video else self.inst
        rep = inst.last_report
        stage = rep.failed_stage if rep is not None else None
        self._reset_after_failure(self.video_pipe if req.is_video else self.pipe)
        if oom:
            return {"op": "error", "id": id_, "kind": "oom", "stage": stage, "shape": req.shape, "size": req.size,
                    "message": oom_message(stage, req, self.knobs)}
        return {"op": "error", "id": id_, "kind": "internal", "stage": stage, "shape": req.shape, "message": detail}

    def _trim_if_grown(self) -> int:
        """Resident bytes after a request, trimmed first when the request left the heap well above the floor.

        A request larger than the usual leaves freed heap that glibc keeps: give it back, so resident memory
        tracks what the worker holds.  Steady traffic reuses its heap and stays under the floor plus the
        slack: no trim (it costs tens of ms).
        """
        rss = vm_status().get("VmRSS", 0)
        if rss > self.rss_floor + TRIM_SLACK_BYTES:
            malloc_trim()
            rss = vm_status().get("VmRSS", 0)
            self.rss_floor = rss
        return rss


def encode_images(images: Any) -> tuple[list[bytes], int]:
    """PNG bytes of each image, and how many were non-finite or all black (a NaN image decodes to black)."""
    nonfinite = 0
    pngs = []
    for img in images:
        finite = bool(np.isfinite(img).all())
        arr = np.nan_to_num(img, nan=0.0, posinf=1.0, neginf=0.0)
        u8 = (np.clip(arr, 0.0, 1.0) * 255.0).round().astype(np.uint8)
        if not finite or int(u8.max()) == 0:
            nonfinite += 1
        buf = io.BytesIO()
        Image.fromarray(u8).save(buf, format="PNG", compress_level=1)
        pngs.append(buf.getvalue())
    return pngs, nonfinite


def oom_message(stage: str | None, req: GenerationRequest, knobs: dict[str, Any]) -> str:
    where = stage or "an unknown stage"
    if req.is_video and stage == "vae_decode":
        return _video_oom_message(req, knobs)
    if stage == "vae_decode" and not knobs.get("vae_tiling", True):
        fix = "enable VAE tiling (it is off) or request a smaller size"
    elif stage == "vae_decode":
        fix = "request a smaller size, or raise the worker's memory budget"
    elif stage == "denoise":
        fix = "request a smaller size or fewer images (n), or raise the memory budget / use more ranks"
    else:
        fix = "request a smaller size or fewer images (n), or raise the worker's memory budget"
    return (f"out of memory in {where} generating {req.n} x {req.size} ({req.shape}); fix: {fix}. "
            "The request failed; the instance keeps serving.")


def _video_oom_message(req: GenerationRequest, knobs: dict[str, Any]) -> str:
    """The video decode ran out: the fix is tiling and a frame-chunked decode, whichever is off."""
    off = [k for k, on in (("VAE tiling", knobs.get("vae_tiling", True)),
                          ("frame-chunked decode", knobs.get("video_decode_chunk_frames", 1) != 0)) if not on]
    fix = (f"enable {' and '.join(off)} (off: the whole clip decodes at full resolution at once)" if off
           else "request fewer frames or a smaller size, or raise the worker's memory budget")
    return (f"out of memory in vae_decode decoding {req.frames} frames at {req.size} ({req.shape}); fix: {fix}. "
            "The job failed; the instance keeps serving.")
