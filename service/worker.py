"""The worker process: the instrumented pipeline under a memory budget.

It runs apart from the HTTP process so that an OOM, a crash or a hang costs
one request, never the instance.  The budget is an address-space limit
(RLIMIT_AS) set after warm-up at the warmed footprint plus a headroom: the
CPU stand-in for a GPU's memory.  Compilation is host work, not "device"
memory, so the limit is lifted while torch.compile runs and re-based after.

Here: set-up, warm-up and the message loop.  The Worker's other parts are
beside it: the budget (``worker_memory.py``), the knobs (``worker_knobs.py``)
and the requests (``worker_requests.py``).  The messages it receives and sends
are in ``messages.py``.  Only the spawned worker process imports these modules
(and torch); the HTTP process never does.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, cast

import torch
import torch._dynamo
import torch.distributed as dist
from diffusers import ContextParallelConfig
from prometheus_client import CollectorRegistry, disable_created_metrics

from stepwatch.exporter import instrument
from stepwatch.exporter.memory import is_oom
from stepwatch.exporter.ranks import RankReporter
from stepwatch.exposition import serve_metrics
from stepwatch.procs import limit_arenas, malloc_trim
from stepwatch.service import knobs as knob_rules
from stepwatch.service.api import GenerationRequest
from stepwatch.service.cache import apply_cache, current
from stepwatch.service.config import parse, parse_size
from stepwatch.service.fingerprint import fingerprint
from stepwatch.service.messages import (
    ErrorMsg,
    InfoReply,
    Ledger,
    RankProc,
    ReadyMsg,
    Reply,
    SessionMsg,
    ToWorker,
    WarmupRun,
    internal_message,
)
from stepwatch.service.pipeline import build_pipeline, damage_weights, weights_digest
from stepwatch.service.worker_knobs import Knobs
from stepwatch.service.worker_memory import Budget, vm_status
from stepwatch.service.worker_requests import Requests

log = logging.getLogger("stepwatch.service.worker")


def _broadcast_box(box: list[Any]) -> None:
    dist.broadcast_object_list(box, src=0)


class Worker(Knobs, Requests):
    """One rank's pipelines, their knobs and the loop that serves them (rank 0 answers the server)."""

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
        if cfg.weights_damage is not None:
            n = damage_weights(self.pipe, str(cfg.weights_damage["layer"]), float(cfg.weights_damage["noise"]),
                               cfg.seed)
            log.warning("weights_damage: %d weight tensors of %s damaged (a practice fault)", n,
                        cfg.weights_damage["layer"])
        if self.world > 1:
            self.pipe.transformer.set_attention_backend("native")
            self.pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=self.world))

    def _arm_budget(self) -> None:
        """The memory budget from the warmed footprint; the baseline resident size for trimming."""
        self.budget.arm()
        if self.budget.limit is not None:
            self.budget.install_compile_hooks()
        self.inst.refresh_capacity()
        malloc_trim()
        self.rss_floor = vm_status().get("VmRSS", 0)

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
                        self._run(GenerationRequest("warm up", 1, w, h, self.cfg.cache_warmup_steps, 1.0, 0),
                                  per_shape=False)
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
        return {"model": lm.as_dict(), "vae_scale": int(getattr(self.pipe, "vae_scale_factor", 8)),
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

    def info(self, id_: str) -> InfoReply:
        vm = vm_status()
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
        return cast(ToWorker, box[0] or {"op": "shutdown"})

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
        except Exception as exc:
            log.exception("opening a session failed")
            return {"op": "error", "id": msg["id"], "kind": "internal", "message": internal_message(exc)}
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
            return {"op": "error", "id": cast("str | None", msg.get("id")), "kind": "internal",
                    "message": f"unknown op {msg['op']!r}"}
        except Exception as exc:
            log.exception("worker op %s failed", msg.get("op"))
            return {"op": "error", "id": cast("str | None", msg.get("id")), "kind": "internal",
                    "message": internal_message(exc)}


def _refusal(msg: ToWorker, world: int, video: bool, stream: bool) -> ErrorMsg | None:
    """The answer to knobs that fail the shared validation (before any rank applies them), else None."""
    if msg["op"] != "knobs":
        return None
    try:
        knob_rules.validate(msg["knobs"], world, video, stream)
    except knob_rules.KnobError as e:
        return {"op": "error", "id": msg["id"], "kind": "invalid", "message": str(e), "param": e.param}
    return None


def configure_process(rank: int) -> None:
    """Logging and environment of a worker process (rank 0 or a follower)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker[{rank}] %(levelname)s %(message)s")
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    limit_arenas()


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
