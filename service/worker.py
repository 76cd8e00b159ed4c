"""The worker process: the instrumented pipeline under a memory budget.

It runs apart from the HTTP process so that an OOM, a crash or a hang costs
one request, never the instance.  The budget is an address-space limit
(RLIMIT_AS) set after warm-up at the warmed footprint plus a headroom: the
CPU stand-in for a GPU's memory.  Compilation is host work, not "device"
memory, so the limit is lifted while torch.compile runs and re-based after.

Protocol (multiprocessing Connection, dict messages):
  main -> worker  {"op": "generate", "id", "request": {...}}
                  {"op": "knobs", "id", "knobs": {...}}    {"op": "info", "id"}    {"op": "shutdown"}
  worker -> main  {"op": "ready", ...}   {"op": "result", "id", ...}   {"op": "error", "id", "kind", ...}
                  {"op": "knobs", "id", ...}   {"op": "info", "id", ...}   {"op": "fatal", "message"}
"""

from __future__ import annotations

import ctypes
import gc
import io
import logging
import os
import resource
import time
import traceback
from typing import Any

log = logging.getLogger("stepwatch.service.worker")
TRIM_SLACK_BYTES = 64 << 20  # above the last trimmed RSS by this much after a request: return freed heap


def _malloc_trim() -> None:
    """Give freed heap back to the OS, so an OOM's garbage does not stay resident."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _vm() -> dict[str, int]:
    from stepwatch.exporter.memory import _status

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
        from torch._dynamo.callback import callback_handler

        if self.lift not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(self.lift)
            callback_handler.register_end_callback(self.rearm)


class Worker:
    def __init__(self, cfg: dict[str, Any], conn: Any, rank: int = 0, world: int = 1) -> None:
        from stepwatch.service.config import parse

        self.cfg = parse(cfg)
        self.conn = conn
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
        self._weights = ""

    # ----- set-up ---------------------------------------------------------------------------
    def setup(self) -> dict[str, Any]:
        from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server

        from stepwatch.exporter import instrument
        from stepwatch.service.pipeline import build_pipeline, weights_digest

        disable_created_metrics()
        cfg = self.cfg
        t0 = time.perf_counter()
        self.pipe = build_pipeline(cfg.family, model=cfg.model, seed=cfg.seed, device=cfg.device, dtype=cfg.dtype)
        self._weights = weights_digest(self.pipe)
        if self.world > 1:
            from diffusers import ContextParallelConfig

            self.pipe.transformer.set_attention_backend("native")
            self.pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=self.world))
        registry = CollectorRegistry()
        rank_reporter = None
        if self.world > 1:
            from stepwatch.exporter.ranks import RankReporter

            rank_reporter = RankReporter()
        self.inst = instrument(self.pipe, registry=registry, shapes=cfg.serving_shapes(), text_tokens=cfg.text_tokens,
                               baselines=cfg.baselines, rank_reporter=rank_reporter)
        if self.rank == 0:
            server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
            self.metrics_port = server.server_port
        self.apply_knobs({"cache": cfg.cache.kind, "cache_threshold": cfg.cache.threshold,
                          "vae_tiling": cfg.vae_tiling, "compile": cfg.compile.enabled}, warm=False)
        warm = self.warmup()
        self.budget.arm()
        if self.budget.limit is not None:
            self.budget.install_compile_hooks()
        self.inst.refresh_capacity()
        _malloc_trim()
        self.rss_floor = _vm().get("VmRSS", 0)
        return {"setup_seconds": time.perf_counter() - t0, "warmup": warm}

    def warmup(self) -> list[dict[str, Any]]:
        """Compile (if on) and measure every warm-up size: twice each, the second run is the steady state.

        With a cross-step cache on, the compiled blocks take a different path on a cache hit (Dynamo
        guards on the hook's decision), so each size also runs once with every middle step forced to
        hit: otherwise the first hit in serving would compile, and page as a serving recompile.
        """
        from stepwatch.service.api import GenerationRequest
        from stepwatch.service.cache import apply_cache, current
        from stepwatch.service.config import parse_size

        out = []
        kind, threshold = current(self.pipe.transformer)
        with self.inst.warmup():
            for size in self.cfg.warmup:
                w, h = parse_size(size)
                req = GenerationRequest("warm up", 1, w, h, self.cfg.warmup_steps, 1.0, 0)
                for i in range(2):
                    t = time.perf_counter()
                    self._run(req)
                    rep = self.inst.last_report
                    out.append({"size": size, "run": i, "seconds": time.perf_counter() - t,
                                "compiles": len(rep.compiles) if rep else 0,
                                "stages": dict(rep.stages) if rep else {}, "shape": str(rep.shape) if rep else ""})
                if kind == "first_block_cache" and self.compile_active:
                    apply_cache(self.pipe, kind, 1e9)
                    try:
                        self._run(GenerationRequest("warm up", 1, w, h, self.cfg.cache_warmup_steps, 1.0, 0))
                    finally:
                        apply_cache(self.pipe, kind, threshold)
        return out

    def fingerprint(self) -> dict[str, Any]:
        from stepwatch.service.fingerprint import fingerprint

        cfg = self.cfg
        compile_mode = f"{cfg.compile.backend}/{cfg.compile.mode}" if self.compile_active else "off"
        return fingerprint(model_id=cfg.model or f"stepwatch-tiny-{cfg.family}-seed{cfg.seed}",
                           weights_digest=self._weights, dtype=str(self.pipe.dtype).removeprefix("torch."),
                           compile_mode=compile_mode, ranks=self.world, device_type=self.pipe.device.type)

    def ledger_params(self) -> dict[str, Any] | None:
        lm = getattr(self.inst, "_ledger", None)
        if lm is None:
            return None
        return {"p_tok": lm.p_tok, "layers": lm.layers, "hidden": lm.hidden, "patch": list(lm.patch),
                "cross_attention": lm.cross_attention, "vae_scale": int(getattr(self.pipe, "vae_scale_factor", 8)),
                "text_tokens": self.cfg.text_tokens}

    # ----- knobs ----------------------------------------------------------------------------
    def apply_knobs(self, knobs: dict[str, Any], warm: bool = True) -> dict[str, Any]:
        from stepwatch.service.cache import apply_cache, current

        pipe = self.pipe
        rewarm = False
        if "cache" in knobs or "cache_threshold" in knobs:
            before = current(pipe.transformer)[0]
            kind = knobs.get("cache", before)
            threshold = knobs.get("cache_threshold", self.knobs.get("cache_threshold"))
            apply_cache(pipe, kind, threshold, steps=self.cfg.default_steps)
            self.knobs["cache"] = kind
            self.knobs["cache_threshold"] = threshold
            # Another cache kind changes the blocks' forward: a compiled service re-warms its shapes, as a
            # redeploy with the new config would (a threshold change alone edits the hook in place).
            rewarm = kind != before and self.compile_active
        if "vae_tiling" in knobs:
            (pipe.vae.enable_tiling if knobs["vae_tiling"] else pipe.vae.disable_tiling)()
            self.knobs["vae_tiling"] = bool(knobs["vae_tiling"])
        if "compile" in knobs and bool(knobs["compile"]) != self.compile_active:
            self._set_compile(bool(knobs["compile"]))
            self.knobs["compile"] = self.compile_active
            rewarm = rewarm or self.compile_active
        if warm and rewarm:
            self.warmup()
        self.knobs.setdefault("compile", self.compile_active)
        if "baselines" in knobs:
            self.inst.set_baselines(knobs["baselines"])
            self.knobs["baselines"] = sorted(knobs["baselines"].get("shapes", knobs["baselines"]))
        if "rank_delay_seconds" in knobs:
            self.rank_delays = {int(k): float(v) for k, v in (knobs["rank_delay_seconds"] or {}).items()}
            self.knobs["rank_delay_seconds"] = {str(k): v for k, v in self.rank_delays.items()}
        return dict(self.knobs)

    def _set_compile(self, on: bool) -> None:
        import torch._dynamo

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
    def _run(self, req: Any) -> Any:
        import torch

        from stepwatch.service.pipeline import prompt_words

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

    def generate(self, msg: dict[str, Any]) -> dict[str, Any]:
        import numpy as np
        from PIL import Image

        from stepwatch.exporter.memory import is_oom

        req = _request(msg)
        t = time.perf_counter()
        try:
            out = self._run(req)
        except Exception as exc:
            rep = self.inst.last_report
            oom = is_oom(exc)
            stage = rep.failed_stage if rep is not None else None
            del exc
            # diffusers resets cache-hook state only at the end of a call that finished: a call that died
            # mid-way would leave the next one starting from stale residuals.
            reset = getattr(self.pipe.transformer, "_reset_stateful_cache", None)
            if reset is not None:
                reset()
            gc.collect()
            _malloc_trim()
            if oom:
                return {"op": "error", "id": msg["id"], "kind": "oom", "stage": stage, "shape": req.shape,
                        "size": req.size, "message": _oom_message(stage, req, self.knobs)}
            return {"op": "error", "id": msg["id"], "kind": "internal", "stage": stage, "shape": req.shape,
                    "message": traceback.format_exc(limit=3)[-600:]}
        seconds = time.perf_counter() - t
        images = out.images
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
        rep = self.inst.last_report
        rss = _vm().get("VmRSS", 0)
        if rss > self.rss_floor + TRIM_SLACK_BYTES:
            # A request larger than the usual left freed heap that glibc keeps: give it back, so resident
            # memory tracks what the worker holds.  Steady traffic reuses its heap and stays under the floor
            # plus the slack: no trim (it costs tens of ms).
            _malloc_trim()
            rss = _vm().get("VmRSS", 0)
            self.rss_floor = rss
        return {
            "op": "result", "id": msg["id"], "images": pngs, "seconds": seconds, "nonfinite": nonfinite,
            "shape": str(rep.shape) if rep and rep.shape else req.shape,
            "stages": dict(rep.stages) if rep else {}, "steps": len(rep.step_seconds) if rep else req.steps,
            "cache": {"kind": rep.cache, "hits": rep.hits, "misses": rep.misses} if rep else None,
            "compiles": len(rep.compiles) if rep else 0, "rss_bytes": rss,
            "ranks": {"step_seconds": rep.extra.get("rank_step_seconds"), "skew": rep.extra.get("rank_skew")}
            if rep and "rank_skew" in rep.extra else None,
        }

    def info(self) -> dict[str, Any]:
        vm = _vm()
        return {"pid": os.getpid(), "rss_bytes": vm.get("VmRSS", 0), "vm_bytes": vm.get("VmSize", 0),
                "budget_bytes": self.budget.limit, "knobs": dict(self.knobs), "fingerprint": self.fingerprint()}

    # ----- loop -----------------------------------------------------------------------------
    def _broadcast(self, msg: dict[str, Any] | None) -> dict[str, Any]:
        """Rank 0 sends the message to the other ranks; they receive it (one small collective)."""
        import torch.distributed as dist

        box = [msg]
        dist.broadcast_object_list(box, src=0)
        return box[0] or {"op": "shutdown"}

    def serve_follower(self) -> None:
        """Ranks > 0: run what rank 0 runs, in the same order; only rank 0 answers."""
        while True:
            msg = self._broadcast(None)
            op = msg.get("op")
            if op == "shutdown":
                return
            try:
                if op == "generate":
                    self._run(_request(msg))
                elif op == "knobs":
                    self.apply_knobs(msg["knobs"])
            except Exception:
                log.exception("rank %d failed on %s", self.rank, op)

    def serve(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                msg = {"op": "shutdown"}
            op = msg.get("op")
            if self.world > 1 and op in ("generate", "knobs", "shutdown"):
                self._broadcast(msg)
            if op == "shutdown":
                return
            try:
                if op == "generate":
                    reply = self.generate(msg)
                elif op == "knobs":
                    knobs = self.apply_knobs(msg["knobs"])
                    reply = {"op": "knobs", "id": msg["id"], "knobs": knobs, "fingerprint": self.fingerprint()}
                elif op == "info":
                    reply = {"op": "info", "id": msg["id"], **self.info()}
                else:
                    reply = {"op": "error", "id": msg.get("id"), "kind": "internal", "message": f"unknown op {op!r}"}
            except Exception:
                reply = {"op": "error", "id": msg.get("id"), "kind": "internal",
                         "message": traceback.format_exc(limit=3)[-600:]}
            self.conn.send(reply)


def _request(msg: dict[str, Any]) -> Any:
    from stepwatch.service.api import GenerationRequest

    return GenerationRequest(**msg["request"])


def _oom_message(stage: str | None, req: Any, knobs: dict[str, Any]) -> str:
    where = stage or "an unknown stage"
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


def worker_main(cfg: dict[str, Any], conn: Any, rank: int = 0, world: int = 1) -> None:
    """Entry point of the worker process (spawned)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker[{rank}] %(levelname)s %(message)s")
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    w = Worker(cfg, conn, rank, world)
    try:
        setup = w.setup()
    except Exception:
        conn.send({"op": "fatal", "message": traceback.format_exc(limit=5)})
        return
    conn.send({"op": "ready", "pid": os.getpid(), "metrics_port": w.metrics_port, "fingerprint": w.fingerprint(),
               "knobs": dict(w.knobs), "ledger": w.ledger_params(), "budget_bytes": w.budget.limit, **setup})
    w.serve()
