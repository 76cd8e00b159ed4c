"""The practice service's one YAML config, validated at start-up.

A bad config exits with the offending key and the reason (ConfigError).  Every
field has a default; ``service/default.yaml`` is the embedded default the demo
and the drills run.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from stepwatch.service import shape_cache
from stepwatch.service.cache import KINDS as CACHE_KINDS

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
COMPILE_MODES = ("regional", "full")
DTYPES = ("float32", "bfloat16", "float16")
_SIZE = re.compile(r"^(\d+)x(\d+)$")


class ConfigError(ValueError):
    """A bad config value; str() names the key and the reason."""


def parse_size(text: Any, key: str = "size") -> tuple[int, int]:
    """'WxH' -> (width, height)."""
    m = _SIZE.match(str(text).strip().lower()) if isinstance(text, str) else None
    if not m:
        raise ConfigError(f"{key}: {text!r} is not a size like 512x512 (WxH)")
    w, h = int(m.group(1)), int(m.group(2))
    if w <= 0 or h <= 0 or w % 16 or h % 16:
        raise ConfigError(f"{key}: {text!r} must be positive multiples of 16")
    return w, h


@dataclass
class PoolConfig:
    name: str
    sizes: list[str]
    slo_seconds: float
    max_wait_seconds: float  # past this estimated wait: 429 + Retry-After


@dataclass
class CompileConfig:
    enabled: bool = True
    backend: str = "inductor"
    mode: str = "regional"  # regional: compile the repeated blocks; full: the whole transformer


@dataclass
class CacheConfig:
    kind: str = "first_block_cache"
    threshold: float = 0.5


@dataclass
class VideoConfig:
    """Asynchronous video jobs (``POST /v1/videos``) on a tiny offline WanPipeline beside the image pipeline.

    The practice video model is a few-step (distilled) one, as FastWan is: by default 4 steps without CFG, and
    so no cross-step cache (a cache must never hit on a distilled model).  Its jobs wait in their own pool
    ("video", with its own SLO) of the one queue, served by the same worker between image requests.
    """

    enabled: bool = True  # served only with ranks: 1 (the video pipeline is not sequence-parallel here)
    model: str | None = None  # a diffusers Wan model directory; None: the tiny offline one
    sizes: list[str] = field(default_factory=lambda: ["128x128", "256x256"])  # any other size: 400
    default_size: str = "128x128"
    default_frames: int = 9
    max_frames: int = 121  # frames are 4k+1 (Wan's VAE: 4x temporal); the tiny model's rope covers 32 latent frames
    default_steps: int = 4
    max_steps: int = 50
    guidance_scale: float = 1.0  # the default: no CFG (a distilled model); > 1 runs CFG
    fps: int = 16
    slo_seconds: float = 60.0
    max_wait_seconds: float = 120.0
    max_jobs: int = 256  # jobs remembered (in flight and finished); the oldest finished ones are forgotten first
    keep_seconds: float = 900.0  # a finished job's video can be downloaded this long
    decode_chunk_frames: int = 4  # latent frames per VAE decoder call (frame-chunked decode); 0: the whole clip
    cache: CacheConfig = field(default_factory=lambda: CacheConfig(kind="none", threshold=0.5))
    warmup: bool = True  # one default job at start (its shape then serves warm)


@dataclass
class StreamConfig:
    """Streaming sessions (``POST /v1/stream/sessions``, server-sent events) on tiny offline AnyFlowFAR pipelines.

    A session is one chunked autoregressive call: each chunk's frames go to the client as soon as the chunk is
    done, the prompt may change between chunks, and the KV cache lives as long as the call.  The worker holds
    one pipeline per session slot (a call mutates its scheduler and its VAE's causal decode cache, so two
    sessions cannot share one); a session beyond the slots is refused (429).  Sessions do not wait in the
    image queue: they run on their slot's thread beside it.  Off by default: it adds the slots' pipelines to
    every worker start and the ``stepwatch_stream_*`` series to its exposition.
    """

    enabled: bool = False  # served only with ranks: 1
    model: str | None = None  # a diffusers AnyFlowFAR model directory; None: the tiny offline one
    max_sessions: int = 2  # session slots per worker
    idle_timeout_seconds: float = 30.0  # a session whose client has read nothing this long is closed
    # Events waiting for a client that reads slower than the session makes them: past this, the session is
    # closed (reason backpressure) and what waits is freed. 8 MiB is ~30 chunks of 128x128 frames as PNGs.
    send_buffer_mb: float = 8.0
    sizes: list[str] = field(default_factory=lambda: ["64x64", "128x128"])  # any other size: 400
    default_size: str = "64x64"
    default_chunks: int = 8  # chunks per session: 1 latent frame, then 2 per chunk (8 frames out each)
    max_chunks: int = 32  # the tiny model's rope covers 64 latent frames
    steps: int = 4  # denoising steps per chunk (few-step flow-map sampling)
    max_steps: int = 16
    window_chunks: int = 3  # chunks the KV window keeps at full resolution (FAR's full_chunk_limit)
    # Steps per chunk from chunk ``late_from_chunk`` on (0: the same as ``steps``). Cutting the later chunks'
    # steps keeps a slow stream real-time and costs their quality (the drift drill's fault).
    late_steps: int = 0
    late_from_chunk: int = 4
    kv_cache: bool = True  # the pipeline's use_kv_cache (off fails every call in this diffusers: refused)
    # The KV memory of the worker's sessions together (a GPU server's KV pool; here a stand-in, as
    # memory_budget_mb is for device memory): a session whose window does not fit what is free fails at its
    # start with an out-of-memory of stage kv_cache.  1.25 MiB holds two of the largest default sessions
    # (128x128 x 32 chunks, window 3: 516,096 bytes each by the KV ledger).
    kv_capacity_mb: float = 1.25
    fps: int = 16


@dataclass
class QueueConfig:
    policy: str = "spf"  # spf: shortest predicted first, with aging; fifo
    aging: float = 1.0  # seconds of priority gained per second waited
    max_queued: int = 256


@dataclass
class ServiceConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    instance_id: str = ""  # default: hostname:port
    family: str = "flux"
    model: str | None = None  # a diffusers model directory; None: the tiny offline pipeline
    seed: int = 0
    device: str = "cpu"
    dtype: str | None = None
    default_size: str = "512x512"
    default_steps: int = 8
    # Other step counts clients send that get shape labels (and baselines) of their own; any other count
    # folds into `other` (bounded labels).  A FLUX-dev deployment may serve 28 and 50 beside its default.
    served_steps: list[int] = field(default_factory=list)
    max_steps: int = 50
    max_side: int = 2048
    max_pixels: int = 2048 * 2048
    max_n: int = 4
    text_tokens: int = 32
    compile: CompileConfig = field(default_factory=CompileConfig)
    warmup: list[str] = field(default_factory=lambda: ["512x512"])
    warmup_steps: int = 2  # compiled graphs do not depend on the step count; fewer steps warm faster
    cache: CacheConfig = field(default_factory=CacheConfig)
    # Serving shape -> {threshold}: that shape's first-block-cache threshold (service/shape_cache.py).
    shape_cache: dict[str, Any] = field(default_factory=dict)
    vae_tiling: bool = True
    memory_budget_mb: float | None = 700.0  # headroom above the warmed worker; None: no budget
    pools: list[PoolConfig] = field(default_factory=list)
    other_pool: PoolConfig = field(default_factory=lambda: PoolConfig("other", [], 60.0, 120.0))
    queue: QueueConfig = field(default_factory=QueueConfig)
    video: VideoConfig = field(default_factory=VideoConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    admin_token: str | None = None
    ranks: int = 1
    # With ranks: each rank gets its own slice of this process's CPUs, as each rank of a GPU service has its
    # own GPU; a process beside one rank then slows that rank alone (the straggler drill's neighbour).
    pin_ranks: bool = True
    baselines: str | None = None  # per-shape step time / hit-rate baselines published as gauges
    # A practice fault (the replica-bad-weights drill): {layer: <transformer module>, noise: <x its weights' std>}
    # damages that module's weights after loading, as a lost FP8 scale would; null in any real deployment.
    weights_damage: dict[str, Any] | None = None
    # Where the service keeps its last configuration (service/config_history.py), so a restart onto another
    # configuration is told from a routine one.  A directory that outlives the process (a pod's volume); None:
    # only changes within one process (knob calls, worker restarts) are known.
    state_dir: str | None = None
    request_timeout_seconds: float = 600.0
    # The thresholds file whose alerts.worker_stalled sets the stall limit (/readyz, the worker restart), so
    # the service and StepwatchWorkerStalled agree; default: the packaged stepwatch/thresholds.yaml.
    thresholds: str | None = None
    # Which profile of that file: the alert rules the Prometheus watching this service runs (production, or
    # drill on the practice stack, whose floor is short enough for a drill to see a stall within a minute).
    thresholds_profile: str = "production"

    def pool_for(self, size: str) -> PoolConfig:
        for p in self.pools:
            if size in p.sizes:
                return p
        return self.other_pool

    def all_pools(self) -> list[PoolConfig]:
        return [*self.pools, self.other_pool, *([self.video_pool()] if self.video_active else [])]

    @property
    def stream_active(self) -> bool:
        """Streaming sessions are served: enabled, and one rank."""
        return self.stream.enabled and self.ranks == 1

    @property
    def video_active(self) -> bool:
        """Video jobs are served: enabled, and one rank (the video pipeline does not run sequence-parallel)."""
        return self.video.enabled and self.ranks == 1

    def video_pool(self) -> PoolConfig:
        v = self.video
        return PoolConfig(VIDEO_POOL, list(v.sizes), v.slo_seconds, v.max_wait_seconds)

    def video_serving_shapes(self) -> list[str]:
        """The video pipeline's label allowlist: every video size at its default frames and steps, CFG off and
        on (``WxHxF_<steps>s[_cfg]``)."""
        v = self.video
        out = []
        for s in v.sizes:
            w, h = parse_size(s)
            base = f"{w}x{h}x{v.default_frames}_{v.default_steps}s"
            out += [base, base + "_cfg"]
        return sorted(set(out))

    def serving_shapes(self) -> list[str]:
        """The exporter's label allowlist: every pool size at the default steps and each served step count, CFG
        off and on, and the warm-up shapes (at warmup_steps)."""
        out = []
        for p in self.pools:
            for s in p.sizes:
                w, h = parse_size(s)
                for n in sorted({self.default_steps, *self.served_steps}):
                    out += [f"{w}x{h}_{n}s", f"{w}x{h}_{n}s_cfg"]
        for s in self.warmup:
            w, h = parse_size(s)
            out += [f"{w}x{h}_{self.warmup_steps}s", f"{w}x{h}_{self.cache_warmup_steps}s"]
        return sorted(set(out))

    @property
    def cache_warmup_steps(self) -> int:
        """Steps of the warm-up run that forces cache hits: first and last always compute, so >= 3."""
        return max(3, self.warmup_steps)

    def to_raw(self) -> dict[str, Any]:
        """A dict that parse() turns back into this config (sent to the worker process)."""
        d = asdict(self)
        d["pools"] = {p["name"]: {"sizes": p["sizes"], "slo_seconds": p["slo_seconds"],
                                  "max_wait_seconds": p["max_wait_seconds"]} for p in d["pools"]}
        other = d["other_pool"]
        d["other_pool"] = {"slo_seconds": other["slo_seconds"], "max_wait_seconds": other["max_wait_seconds"]}
        return d


VIDEO_POOL = "video"  # the pool of video jobs (a label value); image pools may not take the name


def _check_type(value: Any, typ: type | tuple[type, ...], key: str) -> Any:
    if isinstance(value, bool) and typ in (int, float, (int, float)):
        raise ConfigError(f"{key}: {value!r} is not a number")
    if not isinstance(value, typ):
        names = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
        raise ConfigError(f"{key}: {value!r} is not {names}")
    return value


def _section(cls: type, raw: Any, key: str) -> Any:
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}: expected a mapping")
    fields = {f.name: f for f in cls.__dataclass_fields__.values()}  # type: ignore[attr-defined]
    for k in raw:
        if k not in fields:
            raise ConfigError(f"{key}.{k}: unknown key (known: {', '.join(fields)})")
    return cls(**raw)


def parse(raw: Any) -> ServiceConfig:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("<top>: expected a mapping")
    known = ServiceConfig.__dataclass_fields__
    for k in raw:
        if k not in known:
            raise ConfigError(f"{k}: unknown key")
    raw = dict(raw)
    nested = {
        "compile": _section(CompileConfig, raw.pop("compile", None), "compile"),
        "cache": _section(CacheConfig, raw.pop("cache", None), "cache"),
        "queue": _section(QueueConfig, raw.pop("queue", None), "queue"),
    }
    nested["video"] = _video(raw.pop("video", None))
    nested["stream"] = _section(StreamConfig, raw.pop("stream", None), "stream")
    pools_raw = raw.pop("pools", None) or {}
    other_raw = raw.pop("other_pool", None)
    cfg = ServiceConfig(**raw, **nested)
    if not isinstance(pools_raw, dict):
        raise ConfigError("pools: expected a mapping of pool name -> {sizes, slo_seconds}")
    for name, p in pools_raw.items():
        cfg.pools.append(_pool(str(name), p, f"pools.{name}"))
    if other_raw is not None:
        if not isinstance(other_raw, dict):
            raise ConfigError("other_pool: expected a mapping with slo_seconds and max_wait_seconds")
        cfg.other_pool = _pool("other", other_raw, "other_pool")
    validate(cfg)
    return cfg


def _video(raw: Any) -> VideoConfig:
    """The ``video`` section; its ``cache`` is a nested section of its own."""
    if raw is None:
        return VideoConfig()
    if not isinstance(raw, dict):
        raise ConfigError("video: expected a mapping")
    raw = dict(raw)
    cache = _section(CacheConfig, raw.pop("cache", None), "video.cache") if "cache" in raw else None
    v: VideoConfig = _section(VideoConfig, raw, "video")
    if cache is not None:
        v.cache = cache
    return v


def _pool(name: str, p: Any, key: str) -> PoolConfig:
    if not isinstance(p, dict):
        raise ConfigError(f"{key}: expected a mapping with sizes and slo_seconds")
    for k in p:
        if k not in ("sizes", "slo_seconds", "max_wait_seconds"):
            raise ConfigError(f"{key}.{k}: unknown key")
    if not re.match(r"^[a-z][a-z0-9_]{0,31}$", name):
        raise ConfigError(f"{key}: pool names are lowercase identifiers (a label value)")
    if key.startswith("pools.") and name == VIDEO_POOL:
        raise ConfigError(f"{key}: 'video' is reserved for the pool of video jobs (configure it under video)")
    if key.startswith("pools.") and name == "other":
        raise ConfigError(f"{key}: 'other' is reserved for the pool of unlisted sizes (configure it as other_pool)")
    sizes = p.get("sizes", [])
    if not isinstance(sizes, list):
        raise ConfigError(f"{key}.sizes: expected a list of WxH sizes")
    if key == "other_pool" and sizes:
        raise ConfigError("other_pool.sizes: the other pool takes every size not in a pool; list none")
    # Canonical 'WxH' (no leading zeros): requests are matched against it.
    sizes = ["{}x{}".format(*parse_size(s, f"{key}.sizes[{i}]")) for i, s in enumerate(sizes)]
    slo = float(_check_type(p.get("slo_seconds", 60.0), (int, float), f"{key}.slo_seconds"))
    if slo <= 0:
        raise ConfigError(f"{key}.slo_seconds: must be > 0")
    max_wait = float(_check_type(p.get("max_wait_seconds", 2 * slo), (int, float), f"{key}.max_wait_seconds"))
    if max_wait < slo / 2:
        raise ConfigError(f"{key}.max_wait_seconds: {max_wait} is below SLO/2 = {slo / 2}: it would reject "
                          "before the queue-wait alert could fire")
    return PoolConfig(name, sizes, slo, max_wait)


def validate(cfg: ServiceConfig) -> None:
    """Every check of a parsed config, in the order of its sections; the first failure raises ConfigError."""
    _check_deployment(cfg)
    _check_limits(cfg)
    _check_compile_and_cache(cfg)
    _check_queue(cfg)
    _check_sizes(cfg)
    _check_shape_cache(cfg)
    _check_video(cfg)
    _check_stream(cfg)
    if cfg.admin_token is not None and (not isinstance(cfg.admin_token, str) or len(cfg.admin_token) < 8):
        raise ConfigError("admin_token: must be a string of at least 8 characters (or null: admin off)")


def _check_deployment(cfg: ServiceConfig) -> None:
    _check_type(cfg.host, str, "host")
    _check_type(cfg.port, int, "port")
    if not 0 <= cfg.port < 65536:
        raise ConfigError(f"port: {cfg.port} out of range")
    if cfg.family not in ("flux", "wan"):
        raise ConfigError(f"family: {cfg.family!r} is not flux or wan")
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        raise ConfigError(f"dtype: {cfg.dtype!r} is not one of {', '.join(DTYPES)} (or null: the model's own)")
    if cfg.state_dir is not None and not isinstance(cfg.state_dir, str):
        raise ConfigError(f"state_dir: a directory path (or null), got {cfg.state_dir!r}")
    if cfg.baselines is not None and not Path(cfg.baselines).is_file():
        raise ConfigError(f"baselines: {cfg.baselines} is not a file")
    if cfg.model is not None and not (Path(cfg.model) / "model_index.json").is_file():
        raise ConfigError(f"model: {cfg.model} is not a diffusers model directory (no model_index.json)")
    d = cfg.weights_damage
    if d is not None and not (isinstance(d, dict) and set(d) == {"layer", "noise"} and isinstance(d["layer"], str)
                              and d["layer"] and isinstance(d["noise"], (int, float)) and d["noise"] > 0):
        raise ConfigError(f"weights_damage: {{layer: <transformer module>, noise: <number > 0>}} or null, got {d!r}")


def _check_limits(cfg: ServiceConfig) -> None:
    for key in ("default_steps", "max_steps", "max_side", "max_pixels", "max_n", "text_tokens", "ranks", "seed",
                "warmup_steps"):
        _check_type(getattr(cfg, key), int, key)
    if not 1 <= cfg.default_steps <= cfg.max_steps:
        raise ConfigError(f"default_steps: must be within 1..max_steps ({cfg.max_steps})")
    if not isinstance(cfg.served_steps, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= cfg.max_steps for n in cfg.served_steps):
        raise ConfigError(f"served_steps: a list of step counts within 1..max_steps ({cfg.max_steps}), "
                          f"got {cfg.served_steps!r}")
    if cfg.warmup_steps < 1:
        raise ConfigError("warmup_steps: must be >= 1")
    if cfg.ranks not in (1, 2):
        raise ConfigError(f"ranks: {cfg.ranks} is not 1 or 2")
    _check_type(cfg.pin_ranks, bool, "pin_ranks")
    for key in ("max_n", "max_side", "max_pixels", "text_tokens"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key}: must be >= 1")
    _check_type(cfg.request_timeout_seconds, (int, float), "request_timeout_seconds")
    if not cfg.request_timeout_seconds > 0:
        raise ConfigError("request_timeout_seconds: must be > 0")
    _check_thresholds(cfg)


def _check_thresholds(cfg: ServiceConfig) -> None:
    """The stall limit comes from the thresholds file: a bad file or profile fails at start-up, not mid-stall."""
    from stepwatch.thresholds import PROFILES, ThresholdsError, load, stall_floor  # light: YAML only

    if cfg.thresholds is not None:
        _check_type(cfg.thresholds, str, "thresholds")
    _check_type(cfg.thresholds_profile, str, "thresholds_profile")
    if cfg.thresholds_profile not in PROFILES:
        raise ConfigError(f"thresholds_profile: {cfg.thresholds_profile!r} is not one of {', '.join(PROFILES)}")
    try:
        stall_floor(load(cfg.thresholds).alert("worker_stalled"), cfg.thresholds_profile)
    except ThresholdsError as e:
        raise ConfigError(f"thresholds: {e}") from None


def _check_compile_and_cache(cfg: ServiceConfig) -> None:
    if cfg.compile.backend not in COMPILE_BACKENDS:
        raise ConfigError(f"compile.backend: {cfg.compile.backend!r} is not one of {', '.join(COMPILE_BACKENDS)}")
    if cfg.compile.mode not in COMPILE_MODES:
        raise ConfigError(f"compile.mode: {cfg.compile.mode!r} is not one of {', '.join(COMPILE_MODES)}")
    _check_type(cfg.compile.enabled, bool, "compile.enabled")
    if cfg.cache.kind not in CACHE_KINDS:
        raise ConfigError(f"cache.kind: {cfg.cache.kind!r} is not one of {', '.join(CACHE_KINDS)}")
    _check_type(cfg.cache.threshold, (int, float), "cache.threshold")
    if not 0 <= cfg.cache.threshold < float("inf"):
        raise ConfigError(f"cache.threshold: {cfg.cache.threshold} must be a finite number >= 0")
    _check_type(cfg.vae_tiling, bool, "vae_tiling")
    if cfg.memory_budget_mb is not None:
        _check_type(cfg.memory_budget_mb, (int, float), "memory_budget_mb")
        if cfg.memory_budget_mb <= 0:
            raise ConfigError("memory_budget_mb: must be > 0 (or null for no budget)")


def _check_shape_cache(cfg: ServiceConfig) -> None:
    """Per-shape thresholds name serving shapes (checked once the sizes are)."""
    try:
        table = shape_cache.check(cfg.shape_cache, cfg.cache.kind, cfg.serving_shapes() if cfg.shape_cache else [])
    except shape_cache.ShapeCacheError as e:
        raise ConfigError(str(e)) from None
    cfg.shape_cache = {k: {"threshold": t} for k, t in table.items()}


def _check_queue(cfg: ServiceConfig) -> None:
    if cfg.queue.policy not in ("spf", "fifo"):
        raise ConfigError(f"queue.policy: {cfg.queue.policy!r} is not spf or fifo")
    _check_type(cfg.queue.aging, (int, float), "queue.aging")
    if cfg.queue.aging < 0:
        raise ConfigError("queue.aging: must be >= 0 (negative aging starves the oldest requests)")
    _check_type(cfg.queue.max_queued, int, "queue.max_queued")
    if cfg.queue.max_queued < 1:
        raise ConfigError("queue.max_queued: must be >= 1")


def _check_sizes(cfg: ServiceConfig) -> None:
    """Every configured size is one the API would serve, and no size is in two pools."""
    if not isinstance(cfg.warmup, list):
        raise ConfigError("warmup: expected a list of WxH sizes")
    _servable(cfg, cfg.default_size, "default_size")
    for i, s in enumerate(cfg.warmup):
        _servable(cfg, s, f"warmup[{i}]")
    seen: set[str] = set()
    for p in cfg.pools:
        for i, s in enumerate(p.sizes):
            _servable(cfg, s, f"pools.{p.name}.sizes[{i}]")
            if s in seen:
                raise ConfigError(f"pools.{p.name}.sizes: {s} is in two pools")
            seen.add(s)


def _sizes_with_default(sizes: Any, default: Any, section: str) -> tuple[list[str], str]:
    """A section's ``sizes`` (a non-empty list of WxH) and its ``default_size`` among them, normalized."""
    if not isinstance(sizes, list) or not sizes:
        raise ConfigError(f"{section}.sizes: expected a non-empty list of WxH sizes")
    out = ["{}x{}".format(*parse_size(s, f"{section}.sizes[{i}]")) for i, s in enumerate(sizes)]
    dflt = "{}x{}".format(*parse_size(default, f"{section}.default_size"))
    if dflt not in out:
        raise ConfigError(f"{section}.default_size: {dflt} is not one of {section}.sizes ({', '.join(out)})")
    return out, dflt


def _check_video(cfg: ServiceConfig) -> None:
    """The video section: frames 4k+1, sizes the video pipeline serves, limits that admit the defaults."""
    v = cfg.video
    _check_type(v.enabled, bool, "video.enabled")
    _check_type(v.warmup, bool, "video.warmup")
    if v.model is not None and not (Path(v.model) / "model_index.json").is_file():
        raise ConfigError(f"video.model: {v.model} is not a diffusers model directory (no model_index.json)")
    v.sizes, v.default_size = _sizes_with_default(v.sizes, v.default_size, "video")
    for key in ("default_frames", "max_frames", "default_steps", "max_steps", "fps", "max_jobs",
                "decode_chunk_frames"):
        _check_type(getattr(v, key), int, f"video.{key}")
    for key in ("default_frames", "max_frames"):
        n = getattr(v, key)
        if n < 1 or (n - 1) % 4:
            raise ConfigError(f"video.{key}: {n} is not 4k+1 frames (1, 5, 9, ...: the VAE compresses time 4x)")
    if v.default_frames > v.max_frames:
        raise ConfigError(f"video.default_frames: {v.default_frames} is above video.max_frames {v.max_frames}")
    if not 1 <= v.default_steps <= v.max_steps:
        raise ConfigError(f"video.default_steps: must be within 1..video.max_steps ({v.max_steps})")
    if v.fps < 1 or v.max_jobs < 1 or v.decode_chunk_frames < 0:
        raise ConfigError("video: fps and max_jobs must be >= 1, decode_chunk_frames >= 0 (0: the whole clip)")
    for key in ("guidance_scale", "slo_seconds", "max_wait_seconds", "keep_seconds"):
        _check_type(getattr(v, key), (int, float), f"video.{key}")
    if not 0 <= v.guidance_scale <= 30:
        raise ConfigError(f"video.guidance_scale: {v.guidance_scale} must be within 0..30")
    if v.slo_seconds <= 0 or v.keep_seconds <= 0:
        raise ConfigError("video.slo_seconds and video.keep_seconds: must be > 0")
    if v.max_wait_seconds < v.slo_seconds / 2:
        raise ConfigError(f"video.max_wait_seconds: {v.max_wait_seconds} is below SLO/2 = {v.slo_seconds / 2}")
    if v.cache.kind not in CACHE_KINDS:
        raise ConfigError(f"video.cache.kind: {v.cache.kind!r} is not one of {', '.join(CACHE_KINDS)}")


def _check_stream(cfg: ServiceConfig) -> None:
    """The stream section: sizes the FAR pipeline serves (multiples of 16), limits that admit the defaults."""
    st = cfg.stream
    _check_type(st.enabled, bool, "stream.enabled")
    _check_type(st.kv_cache, bool, "stream.kv_cache")
    if not st.kv_cache:
        raise ConfigError("stream.kv_cache: false is refused: AnyFlowFAR fails every call without its KV cache in "
                          "this diffusers (the transformer returns one value where the pipeline unpacks two)")
    if st.model is not None and not (Path(st.model) / "model_index.json").is_file():
        raise ConfigError(f"stream.model: {st.model} is not a diffusers model directory (no model_index.json)")
    st.sizes, st.default_size = _sizes_with_default(st.sizes, st.default_size, "stream")
    for key in ("max_sessions", "default_chunks", "max_chunks", "steps", "max_steps", "window_chunks", "fps"):
        _check_type(getattr(st, key), int, f"stream.{key}")
        if getattr(st, key) < 1:
            raise ConfigError(f"stream.{key}: must be >= 1")
    if not 2 <= st.default_chunks <= st.max_chunks:
        raise ConfigError(f"stream.default_chunks: must be within 2..stream.max_chunks ({st.max_chunks})")
    if st.steps > st.max_steps:
        raise ConfigError(f"stream.steps: {st.steps} is above stream.max_steps {st.max_steps}")
    _check_type(st.late_steps, int, "stream.late_steps")
    if not 0 <= st.late_steps <= st.max_steps:
        raise ConfigError(f"stream.late_steps: must be within 0..stream.max_steps ({st.max_steps}); 0: as steps")
    _check_type(st.late_from_chunk, int, "stream.late_from_chunk")
    if st.late_from_chunk < 1:
        raise ConfigError("stream.late_from_chunk: must be >= 1 (the first chunk is sampled with stream.steps)")
    _check_type(st.kv_capacity_mb, (int, float), "stream.kv_capacity_mb")
    if st.kv_capacity_mb <= 0:
        raise ConfigError("stream.kv_capacity_mb: must be > 0")
    _check_type(st.idle_timeout_seconds, (int, float), "stream.idle_timeout_seconds")
    if st.idle_timeout_seconds <= 0:
        raise ConfigError("stream.idle_timeout_seconds: must be > 0")
    _check_type(st.send_buffer_mb, (int, float), "stream.send_buffer_mb")
    if st.send_buffer_mb <= 0:
        raise ConfigError("stream.send_buffer_mb: must be > 0")


def _servable(cfg: ServiceConfig, size: Any, key: str) -> None:
    """A size the API would accept: parsed, and within max_side and max_pixels."""
    w, h = parse_size(size, key)
    if max(w, h) > cfg.max_side or w * h > cfg.max_pixels:
        raise ConfigError(f"{key}: {size} is over the maximum ({cfg.max_side} px per side, {cfg.max_pixels} pixels)")


def default_path() -> Path:
    return Path(str(resources.files("stepwatch.service") / "default.yaml"))


def load(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ServiceConfig:
    """The config at ``path`` (default: the embedded default), with top-level overrides applied."""
    p = Path(path) if path is not None else default_path()
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ConfigError(f"{p}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML ({e})") from None
    raw = dict(raw or {})
    for k, v in (overrides or {}).items():
        if v is not None:
            raw[k] = v
    try:
        return parse(raw)
    except TypeError as e:  # a wrong field in a nested dataclass
        raise ConfigError(f"{p}: {e}") from None
