"""The worker process: the instrumented pipeline under a memory budget.

It runs apart from the HTTP process so that an OOM, a crash or a hang costs
one request, never the instance.  The budget is an address-space limit
(RLIMIT_AS) set after warm-up at the warmed footprint plus a headroom: the
CPU stand-in for a GPU's memory.  Compilation is host work, not "device"
memory, so the limit is lifted while torch.compile runs and re-based after.

The messages it receives and sends are in ``messages.py``.  Only the spawned
worker process imports this module (and torch); the HTTP process never does.
"""

from __future__ import annotations

import ctypes
import gc
import io
import logging
import os
import resource
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
import torch._dynamo
import torch.distributed as dist
from diffusers import ContextParallelConfig
from PIL import Image
from prometheus_client import CollectorRegistry, disable_created_metrics
from torch._dynamo.callback import callback_handler

from stepwatch.exporter import instrument
from stepwatch.exporter.memory import _status, is_oom
from stepwatch.exporter.ranks import RankReporter
from stepwatch.exposition import serve_metrics
from stepwatch.service import knobs as knob_rules
from stepwatch.service.api import GenerationRequest
from stepwatch.service.cache import apply_cache, current
from stepwatch.service.config import parse, parse_size
from stepwatch.service.fingerprint import fingerprint
from stepwatch.service.messages import (
    ErrorMsg,
    GenerateMsg,
    InfoReply,
    Ledger,
    RankProc,
    ReadyMsg,
    Reply,
    ResultMsg,
    SessionMsg,
    ToWorker,
    WarmupRun,
)
from stepwatch.service.pipeline import build_pipeline, prompt_words, weights_digest
from stepwatch.service.video import CONTENT_TYPE, JobCancelled, encode_mp4, set_decode_chunk, to_uint8

log = logging.getLogger("stepwatch.service.worker")
TRIM_SLACK_BYTES = 64 << 20  # above the last trimmed RSS by this much after a request: return freed heap


def _malloc_trim() -> None:
    """Give freed heap back to the OS, so an OOM's garbage does not stay resident."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _vm() -> dict[str, int]:
    return _status()


class Budget:
    """RLIMIT_AS = footprint + headroom, lifted during compiles."""

    def __init__(self, headroom_bytes: int | None) -> None:
        self.headroom = headroom_bytes
        self.limit: int | None = None
        self._lifted = False

    def arm(self) -> None:
        if self.headroom is None:
            return
        self.limit = _vm()["VmSize"] + self.headroom
        resource.setrlimit(resource.RLIMIT_AS, (self.limit, resource.RLIM_INFINITY))

    def lift(self, _args: Any = None) -> None:
        if self.limit is not None and not self._lifted:
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            self._lifted = True

    def rearm(self, _args: Any = None) -> None:
        if self._lifted:
            self._lifted = False
            self.arm()

    def install_compile_hooks(self) -> None:
        if self.lift not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(self.lift)
            callback_handler.register_end_callback(self.rearm)


def _broadcast_box(box: list[Any]) -> None:
    dist.broadcast_object_list(box, src=0)


class Worker:
    def __init__(self, cfg: dict[str, Any], conn: Connection | None, rank: int = 0, world: int = 1,
                 cancel: Any = None) -> None:
        self.cfg = parse(cfg)
        self.video_pipe: Any = None  # the video pipeline (cfg.video_active), instrumented on the same registry
        self.video_inst: Any = None
        self.cancel = cancel  # a shared integer: the job number the server wants stopped (None: no video)
        self.conn = conn  # None on follower ranks: only rank 0 talks to the server
        self.rank = rank
        self.world = world
        self.pipe: Any = None
        self.inst: Any = None
        self.knobs: dict[str, Any] = {}
        self.compile_active = False
        self.budget = Budget(int(self.cfg.memory_budget_mb * 2**20) if self.cfg.memory_budget_mb else None)
        self.metrics_port = 0
        self.rss_floor = 0  # resident bytes after warm-up or the last trim
        self.rank_delays: dict[int, float] = {}
        self.rank_procs: list[RankProc] = []  # set by service/ranks.py on rank 0
        self._weights = ""
        self.sessions: Any = None  # stream_worker.StreamSessions where streaming sessions are served
        self._send_lock = threading.Lock()  # session threads send chunks beside the main loop's replies

    def send(self, msg: Any) -> None:
        """One message to the server, whole (a Connection is not safe for two senders at once)."""
        assert self.conn is not None
        with self._send_lock:
            self.conn.send(msg)

    # ----- set-up ---------------------------------------------------------------------------
    def setup(self) -> ReadyMsg:
        """Build, instrument and warm the pipeline, then arm the budget; the message that says so."""
        disable_created_metrics()
        cfg = self.cfg
        t0 = time.perf_counter()
        self._build()
        registry = CollectorRegistry()
        self.inst = instrument(self.pipe, registry=registry, shapes=cfg.serving_shapes(), text_tokens=cfg.text_tokens,
                               baselines=cfg.baselines, rank_reporter=RankReporter() if self.world > 1 else None)
        if self.rank == 0:
            server, _ = serve_metrics(0, "127.0.0.1", registry)
            self.metrics_port = server.server_port
        self._setup_video(registry)
        self._setup_stream(registry)
        self.apply_knobs({"cache": cfg.cache.kind, "cache_threshold": cfg.cache.threshold,
                          "vae_tiling": cfg.vae_tiling, "compile": cfg.compile.enabled, **self._video_knobs()},
                         warm=False)
        warm = self.warmup() + self._warm_video()
        if self.sessions is not None:
            self.sessions.warm()
        self._arm_budget()
        return {"op": "ready", "pid": os.getpid(), "metrics_port": self.metrics_port,
                "fingerprint": self.fingerprint(), "knobs": dict(self.knobs), "ledger": self.ledger_params(),
                "budget_bytes": self.budget.limit, "setup_seconds": time.perf_counter() - t0, "warmup": warm,
                "ranks": self.rank_procs}

    def _setup_video(self, registry: CollectorRegistry) -> None:
        """The video pipeline beside the image one: built offline like it (or from ``video.model``), instrumented
        on the same registry with its own shape allowlist.  Served eager: on CPU, compiling the Wan blocks
        would add tens of seconds to every start for a model this small (its shapes still count compiles)."""
        cfg = self.cfg
        if not cfg.video_active:
            return
        self.video_pipe = build_pipeline("wan", model=cfg.video.model, seed=cfg.seed, device=cfg.device,
                                         dtype=cfg.dtype)
        self._weights += "+" + weights_digest(self.video_pipe)
        self.video_inst = instrument(self.video_pipe, registry=registry, shapes=cfg.video_serving_shapes(),
                                     text_tokens=cfg.text_tokens, few_step_max_steps=self._few_step_max())

    def _setup_stream(self, registry: CollectorRegistry) -> None:
        """Session slots (service/stream_worker.py): their pipelines, instrumented on the same registry."""
        if not self.cfg.stream_active or self.conn is None:
            return
        from stepwatch.service.stream_worker import StreamSessions

        cfg = self.cfg
        self.sessions = StreamSessions(cfg.stream, registry, self.send, seed=cfg.seed, device=cfg.device,
                                       dtype=cfg.dtype, text_tokens=cfg.text_tokens)
        self._weights += "+" + weights_digest(self.sessions.slots[0].pipe)  # every slot holds the same weights

    def _few_step_max(self) -> int:
        from stepwatch.thresholds import load

        return load(self.cfg.thresholds).few_step_max_steps

    def _video_knobs(self) -> dict[str, Any]:
        v = self.cfg.video
        if not self.cfg.video_active:
            return {}
        return {"video_cache": v.cache.kind, "video_cache_threshold": v.cache.threshold,
                "video_decode_chunk_frames": v.decode_chunk_frames}

    def _warm_video(self) -> list[WarmupRun]:
        """One default job (twice: the second is the steady state the queue's predictor starts from)."""
        v = self.cfg.video
        if self.video_pipe is None or not v.warmup:
            return []
        w, h = parse_size(v.default_size)
        req = GenerationRequest("warm up", 1, w, h, v.default_steps, v.guidance_scale, 0, frames=v.default_frames)
        out: list[WarmupRun] = []
        with self.video_inst.warmup():
            for run in range(2):
                t = time.perf_counter()
                self._run_video(req, None)
                rep = self.video_inst.last_report
                out.append({"size": v.default_size, "run": run, "seconds": time.perf_counter() - t,
                            "compiles": len(rep.compiles) if rep else 0, "stages": dict(rep.stages) if rep else {},
                            "shape": req.shape, "frames": v.default_frames, "steps": v.default_steps,
                            "guidance_scale": v.guidance_scale})
        return out

    def _build(self) -> None:
        cfg = self.cfg
        self.pipe = build_pipeline(cfg.family, model=cfg.model, seed=cfg.seed, device=cfg.device, dtype=cfg.dtype)
        self._weights = weights_digest(self.pipe)
        if self.world > 1:
            self.pipe.transformer.set_attention_backend("native")
            self.pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=self.world))

    def _arm_budget(self) -> None:
        """The memory budget from the warmed footprint; the baseline resident size for trimming."""
        self.budget.arm()
        if self.budget.limit is not None:
            self.budget.install_compile_hooks()
        self.inst.refresh_capacity()
        _malloc_trim()
        self.rss_floor = _vm().get("VmRSS", 0)

    def warmup(self) -> list[WarmupRun]:
        """Compile (if on) and measure every warm-up size: twice each, the second run is the steady state.

        With a cross-step cache on, the compiled blocks take a different path on a cache hit (Dynamo
        guards on the hook's decision), so each size also runs once with every middle step forced to
        hit: otherwise the first hit in serving would compile, and page as a serving recompile.
        """
        out: list[WarmupRun] = []
        kind, threshold = current(self.pipe.transformer)
        with self.inst.warmup():
            for size in self.cfg.warmup:
                w, h = parse_size(size)
                req = GenerationRequest("warm up", 1, w, h, self.cfg.warmup_steps, 1.0, 0)
                out += [self._timed_warmup(size, req, i) for i in range(2)]
                if kind == "first_block_cache" and self.compile_active:
                    apply_cache(self.pipe, kind, 1e9, stamp=self._stamp)
                    try:
                        self._run(GenerationRequest("warm up", 1, w, h, self.cfg.cache_warmup_steps, 1.0, 0))
                    finally:
                        apply_cache(self.pipe, kind, threshold, stamp=self._stamp)
        return out

    def _timed_warmup(self, size: str, req: GenerationRequest, run: int) -> WarmupRun:
        t = time.perf_counter()
        self._run(req)
        rep = self.inst.last_report
        return {"size": size, "run": run, "seconds": time.perf_counter() - t,
                "compiles": len(rep.compiles) if rep else 0,
                "stages": dict(rep.stages) if rep else {}, "shape": str(rep.shape) if rep else ""}

    def fingerprint(self) -> dict[str, Any]:
        cfg = self.cfg
        compile_mode = f"{cfg.compile.backend}/{cfg.compile.mode}" if self.compile_active else "off"
        return fingerprint(model_id=cfg.model or f"stepwatch-tiny-{cfg.family}-seed{cfg.seed}",
                           weights_digest=self._weights, dtype=str(self.pipe.dtype).removeprefix("torch."),
                           compile_mode=compile_mode, ranks=self.world, device_type=self.pipe.device.type)

    def ledger_params(self) -> Ledger | None:
        lm = getattr(self.inst, "_ledger", None)
        if lm is None:
            return None
        return {"p_tok": lm.p_tok, "layers": lm.layers, "hidden": lm.hidden, "patch": list(lm.patch),
                "cross_attention": lm.cross_attention, "vae_scale": int(getattr(self.pipe, "vae_scale_factor", 8)),
                "text_tokens": self.cfg.text_tokens}

    # ----- knobs ----------------------------------------------------------------------------
    def apply_knobs(self, knobs: dict[str, Any], warm: bool = True) -> dict[str, Any]:
        """Apply checked knobs (knobs.validate); re-warm when the compiled forward changed."""
        pipe = self.pipe
        rewarm = self._apply_cache(knobs)
        if "vae_tiling" in knobs:
            for p in (pipe, self.video_pipe):
                if p is not None:
                    (p.vae.enable_tiling if knobs["vae_tiling"] else p.vae.disable_tiling)()
            self.knobs["vae_tiling"] = bool(knobs["vae_tiling"])
        self._apply_video_knobs(knobs)
        if self.sessions is not None:  # the stream knobs in force (the config's until a knob changes them)
            self.knobs.update(self.sessions.apply_knobs(knobs))
        if "compile" in knobs and bool(knobs["compile"]) != self.compile_active:
            self._set_compile(bool(knobs["compile"]))
            self.knobs["compile"] = self.compile_active
            rewarm = rewarm or self.compile_active
        rewarm = self._apply_attention(knobs) or rewarm
        if warm and rewarm:
            self._rewarm()
        self.knobs.setdefault("compile", self.compile_active)
        if "baselines" in knobs:
            self.inst.set_baselines(knobs["baselines"])
            self.knobs["baselines"] = sorted(knob_rules.baseline_shapes(knobs["baselines"]))
        if "rank_delay_seconds" in knobs:
            self.rank_delays = {int(k): float(v) for k, v in (knobs["rank_delay_seconds"] or {}).items()}
            self.knobs["rank_delay_seconds"] = {str(k): v for k, v in self.rank_delays.items()}
        if knobs.get("drop_compiled_graphs"):
            # What an evicted compiled-graph cache does (Dynamo's cache limit, a guard that failed): every
            # warmed shape compiles again, on live requests, with compile still on.  Only the code caches:
            # torch._dynamo.reset() would also drop the compile callbacks stepwatch counts compiles with.
            torch._dynamo.reset_code_caches()
            log.warning("compiled graphs dropped: every shape compiles again on its next request")
        return dict(self.knobs)

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

    def _rewarm(self) -> None:
        """Warm up again after a knob changed the compiled forward.  A forward that no longer runs (an attention
        kernel the device lacks) fails its warm-up as it fails every request: the knob stays, as a deploy would,
        and the worker serves on, answering each request with that error."""
        try:
            self.warmup()
        except Exception as e:
            if is_oom(e):
                raise
            log.error("re-warm failed with the new knobs, which stay in place: %s: %s", type(e).__name__, e)

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
        # Regional compile shares one code object (the hook's forward) across all blocks, and the
        # cache hooks add variants: Dynamo's default limit of 8 would silently fall back to eager
        # after a few shapes and hide exactly the serving recompiles the service must show.
        torch._dynamo.config.recompile_limit = 256
        torch._dynamo.config.accumulated_recompile_limit = 4096
        tr = self.pipe.transformer
        mode, backend = self.cfg.compile.mode, self.cfg.compile.backend
        if on:
            if mode == "regional":
                tr.compile_repeated_blocks(backend=backend, dynamic=False)
            else:
                tr.compile(backend=backend, dynamic=False)
        else:
            for m in tr.modules():
                if getattr(m, "_compiled_call_impl", None) is not None:
                    m._compiled_call_impl = None
        self.compile_active = on

    # ----- requests -------------------------------------------------------------------------
    def _run(self, req: GenerationRequest) -> Any:
        kwargs: dict[str, Any] = {}
        if req.cfg:
            kwargs = {"negative_prompt": "", "true_cfg_scale": req.guidance_scale}
        delay = self.rank_delays.get(self.rank, 0.0)
        callback = None
        if delay > 0:
            def callback(_p: Any, _i: int, _t: Any, kw: dict[str, Any]) -> dict[str, Any]:
                time.sleep(delay)  # a straggler: this rank's every step is slower
                return kw
        return self.pipe(
            prompt_words(req.prompt), height=req.height, width=req.width, num_inference_steps=req.steps,
            num_images_per_prompt=req.n, max_sequence_length=self.cfg.text_tokens, output_type="np",
            generator=torch.Generator().manual_seed(req.seed), callback_on_step_end=callback, **kwargs)

    def _run_video(self, req: GenerationRequest, msg_id: str | None) -> Any:
        """One video job on the video pipeline; each step reports progress (``msg_id``) and checks whether the
        job was cancelled (JobCancelled, raised from the step callback, stops it within a step)."""
        kwargs: dict[str, Any] = {"negative_prompt": ""} if req.cfg else {}

        def on_step(_p: Any, i: int, _t: Any, kw: dict[str, Any]) -> dict[str, Any]:
            if self.cancel is not None and req.job and self.cancel.value == req.job:
                raise JobCancelled(f"video job {req.job} cancelled at step {i + 1} of {req.steps}")
            if msg_id is not None and self.conn is not None:
                self.send({"op": "progress", "id": msg_id, "step": i + 1, "steps": req.steps})
            return kw

        return self.video_pipe(
            prompt_words(req.prompt), height=req.height, width=req.width, num_frames=req.frames,
            num_inference_steps=req.steps, guidance_scale=req.guidance_scale, max_sequence_length=self.cfg.text_tokens,
            output_type="np", generator=torch.Generator().manual_seed(req.seed), callback_on_step_end=on_step,
            **kwargs)

    def generate(self, msg: GenerateMsg) -> ResultMsg | ErrorMsg:
        req = GenerationRequest(**msg["request"])
        if req.is_video and self.video_pipe is None:
            return {"op": "error", "id": msg["id"], "kind": "internal", "message": "video is off on this worker"}
        t = time.perf_counter()
        failure: tuple[bool, str] | None = None
        cancelled = False
        try:
            out = self._run_video(req, msg["id"]) if req.is_video else self._run(req)
        except JobCancelled:
            cancelled = True
        except Exception as exc:
            failure = (is_oom(exc), traceback.format_exc(limit=3)[-600:])
        if cancelled:
            return self._cancelled(msg["id"], req)
        if failure is not None:
            # Out of the except block: the exception and its frames (the failed request's tensors) are gone.
            return self._failed(msg["id"], req, *failure)
        if req.is_video:
            return self._video_result(msg["id"], req, out, time.perf_counter() - t)
        seconds = time.perf_counter() - t
        pngs, nonfinite = _encode(out.images)
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
        _malloc_trim()

    def _failed(self, id_: str, req: GenerationRequest, oom: bool, detail: str) -> ErrorMsg:
        """Clean up after a failed request and say why it failed (an OOM names the stage and the fix)."""
        inst = self.video_inst if req.is_video else self.inst
        rep = inst.last_report
        stage = rep.failed_stage if rep is not None else None
        self._reset_after_failure(self.video_pipe if req.is_video else self.pipe)
        if oom:
            return {"op": "error", "id": id_, "kind": "oom", "stage": stage, "shape": req.shape, "size": req.size,
                    "message": _oom_message(stage, req, self.knobs)}
        return {"op": "error", "id": id_, "kind": "internal", "stage": stage, "shape": req.shape, "message": detail}

    def _trim_if_grown(self) -> int:
        """Resident bytes after a request, trimmed first when the request left the heap well above the floor.

        A request larger than the usual leaves freed heap that glibc keeps: give it back, so resident memory
        tracks what the worker holds.  Steady traffic reuses its heap and stays under the floor plus the
        slack: no trim (it costs tens of ms).
        """
        rss = _vm().get("VmRSS", 0)
        if rss > self.rss_floor + TRIM_SLACK_BYTES:
            _malloc_trim()
            rss = _vm().get("VmRSS", 0)
            self.rss_floor = rss
        return rss

    def info(self, id_: str) -> InfoReply:
        vm = _vm()
        return {"op": "info", "id": id_, "pid": os.getpid(), "rss_bytes": vm.get("VmRSS", 0),
                "vm_bytes": vm.get("VmSize", 0), "budget_bytes": self.budget.limit, "knobs": dict(self.knobs),
                "fingerprint": self.fingerprint()}

    # ----- loop -----------------------------------------------------------------------------
    def _broadcast(self, msg: ToWorker | None) -> ToWorker:
        """Rank 0 sends the message to the other ranks; they receive it (one small collective).

        Rank 0's send is stamped as a collective: a follower frozen between requests leaves it waiting here,
        which the stall signals must see as a wait for that rank.  The followers' receive is not: they wait
        in it whenever the service is idle, which is no wait for anyone."""
        box: list[Any] = [msg]
        send = self._stamp if self.rank == 0 else None
        (send(_broadcast_box) if send is not None else _broadcast_box)(box)
        return box[0] or {"op": "shutdown"}

    def serve_follower(self) -> None:
        """Ranks > 0: run what rank 0 runs, in the same order; only rank 0 answers."""
        while True:
            msg = self._broadcast(None)
            if msg["op"] == "shutdown":
                return
            try:
                if msg["op"] == "generate":
                    self._run(GenerationRequest(**msg["request"]))
                elif msg["op"] == "knobs":
                    self.apply_knobs(msg["knobs"])
            except Exception:
                log.exception("rank %d failed on %s", self.rank, msg["op"])

    def serve(self) -> None:
        """Rank 0: answer the server's requests one at a time until shutdown (or the pipe closes)."""
        assert self.conn is not None
        while True:
            try:
                msg: ToWorker = self.conn.recv()
            except (EOFError, OSError):
                msg = {"op": "shutdown"}
            refused = _refusal(msg, self.world, self.video_pipe is not None, self.sessions is not None)
            if refused is not None:
                self.send(refused)
                continue
            if self.world > 1 and msg["op"] in ("generate", "knobs", "shutdown"):
                self._broadcast(msg)
            if msg["op"] == "shutdown":
                if self.sessions is not None:
                    self.sessions.close_all()
                return
            if msg["op"] == "session":
                refused = self._open_session(msg)
                if refused is not None:
                    self.send(refused)
                continue
            self.send(self._reply(msg))

    def _open_session(self, msg: SessionMsg) -> ErrorMsg | None:
        """Start a session on its own thread (it replies when it ends), or the refusal to send now."""
        if self.sessions is None:
            return {"op": "error", "id": msg["id"], "kind": "invalid", "message": "streaming is off on this worker"}
        try:
            refused: ErrorMsg | None = self.sessions.open(msg)
        except Exception:
            log.exception("opening a session failed")
            return {"op": "error", "id": msg["id"], "kind": "internal", "message": traceback.format_exc(limit=2)}
        return refused

    def _reply(self, msg: ToWorker) -> Reply:
        try:
            if msg["op"] == "generate":
                return self.generate(msg)
            if msg["op"] == "knobs":
                return {"op": "knobs", "id": msg["id"], "knobs": self.apply_knobs(msg["knobs"]),
                        "fingerprint": self.fingerprint()}
            if msg["op"] == "info":
                return self.info(msg["id"])
            if msg["op"] in ("session_prompt", "session_close"):
                if self.sessions is None:
                    return {"op": "error", "id": msg["id"], "kind": "invalid", "message": "streaming is off"}
                return (self.sessions.set_prompt(msg) if msg["op"] == "session_prompt"
                        else self.sessions.close(msg))
            return {"op": "error", "id": msg.get("id"), "kind": "internal", "message": f"unknown op {msg['op']!r}"}
        except Exception:
            return {"op": "error", "id": msg.get("id"), "kind": "internal",
                    "message": traceback.format_exc(limit=3)[-600:]}


def _refusal(msg: ToWorker, world: int, video: bool, stream: bool) -> ErrorMsg | None:
    """The answer to knobs that fail the shared validation (before any rank applies them), else None."""
    if msg["op"] != "knobs":
        return None
    try:
        knob_rules.validate(msg["knobs"], world, video, stream)
    except knob_rules.KnobError as e:
        return {"op": "error", "id": msg["id"], "kind": "invalid", "message": str(e), "param": e.param}
    return None


def _encode(images: Any) -> tuple[list[bytes], int]:
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


def _oom_message(stage: str | None, req: GenerationRequest, knobs: dict[str, Any]) -> str:
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


def configure_process(rank: int) -> None:
    """Logging and environment of a worker process (rank 0 or a follower)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker[{rank}] %(levelname)s %(message)s")
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def start(w: Worker) -> ReadyMsg | None:
    """Set the worker up; on failure rank 0 tells the server why (``fatal``) and None is returned."""
    try:
        return w.setup()
    except Exception:
        log.exception("rank %d: set-up failed", w.rank)
        if w.conn is not None:
            w.conn.send({"op": "fatal", "message": traceback.format_exc(limit=5)})
        return None


def worker_main(cfg: dict[str, Any], conn: Connection, cancel: Any = None) -> None:
    """Entry point of the worker process (spawned); ``cancel``: the shared job number to stop (video jobs)."""
    configure_process(0)
    w = Worker(cfg, conn, cancel=cancel)
    ready = start(w)
    if ready is None:
        return
    conn.send(ready)
    w.serve()
