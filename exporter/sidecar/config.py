"""Probe sets and the sidecar's YAML config, validated before anything runs.

A bad file is refused at start-up with the offending key and the reason, so a
typo never turns into a silent default or a crash an hour later.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from stepwatch.thresholds import Quality

VIDEO_GATE = "video"
DEFAULT_SIZE = "256x256"
DEFAULT_STEPS = 8
DEFAULT_PROMPTS: tuple[str, ...] = (
    "a red fox in fresh snow, morning light",
    "a lighthouse on a rocky coast at dusk",
    "a bowl of ramen with a soft-boiled egg, top view",
    "an old library with tall wooden shelves",
    "a neon-lit street in the rain at night",
    "a hot air balloon over green hills",
    "a macro photo of a dragonfly wing",
    "a watercolor painting of a mountain village",
    "a vintage bicycle leaning on a yellow wall",
    "a glass of iced tea on a wooden table, shallow depth of field",
)
DEFAULT_SEEDS: tuple[int, ...] = (0, 1)

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
_SIZE = re.compile(r"^(\d+)x(\d+)$")


class ConfigError(ValueError):
    """A bad config or probe set; the message names the key and the reason."""


@dataclass(frozen=True)
class ProbeItem:
    """One probe: a prompt and seed at a shape.  ``frames`` makes it video-shaped."""

    id: str
    prompt: str
    seed: int
    size: str = DEFAULT_SIZE
    steps: int = DEFAULT_STEPS
    guidance_scale: float | None = None
    frames: int | None = None
    chunks: int | None = None  # a streaming session of this many chunks: one frame per chunk (its last)

    @property
    def is_video(self) -> bool:
        return self.frames is not None and self.frames > 1

    @property
    def is_stream(self) -> bool:
        return self.chunks is not None

    @property
    def expected_frames(self) -> int:
        """Frames the probe's output must have: a chunk's last frame per chunk, a video's frames, or one image."""
        return self.chunks or self.frames or 1

    def session_body(self) -> dict[str, Any]:
        """The ``POST /v1/stream/sessions`` body for a stream probe (its steps are the service's, as a viewer's)."""
        return {"prompt": self.prompt, "seed": self.seed, "size": self.size, "chunks": self.chunks}

    @property
    def width_height(self) -> tuple[int, int]:
        w, h = self.size.split("x")
        return int(w), int(h)

    def request_body(self) -> dict[str, Any]:
        """The ``POST /v1/images/generations`` body for this probe."""
        body: dict[str, Any] = {"prompt": self.prompt, "n": 1, "size": self.size, "response_format": "b64_json",
                                "seed": self.seed, "steps": self.steps}
        if self.guidance_scale is not None:
            body["guidance_scale"] = self.guidance_scale
        if self.frames is not None:
            body["frames"] = self.frames
        return body

    def video_body(self) -> dict[str, Any]:
        """The ``POST /v1/videos`` body for a video probe (a job: polled, then its MP4 downloaded)."""
        body: dict[str, Any] = {"prompt": self.prompt, "size": self.size, "frames": self.frames, "seed": self.seed,
                                "steps": self.steps}
        if self.guidance_scale is not None:
            body["guidance_scale"] = self.guidance_scale
        return body

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "prompt": self.prompt, "seed": self.seed, "size": self.size,
                             "steps": self.steps}
        if self.guidance_scale is not None:
            d["guidance_scale"] = self.guidance_scale
        if self.frames is not None:
            d["frames"] = self.frames
        if self.chunks is not None:
            d["chunks"] = self.chunks
        return d


@dataclass(frozen=True)
class ProbeSet:
    """A fixed prompt x seed set and the gate kind it guards (a key of ``quality.gates_db``, or ``video``)."""

    name: str
    items: tuple[ProbeItem, ...]
    gate: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "gate": self.gate, "items": [i.to_dict() for i in self.items]}

    def digest(self) -> str:
        """Identity of what is generated (not the gate): a baseline belongs to one digest."""
        canon = json.dumps([i.to_dict() for i in self.items], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    @property
    def is_video(self) -> bool:
        return any(i.is_video or i.is_stream for i in self.items)

    @property
    def is_stream(self) -> bool:
        return any(i.is_stream for i in self.items)

    def gate_kind(self, override: str | None = None) -> str:
        return override or self.gate or (VIDEO_GATE if self.is_video else "")


def default_probe_set(size: str = DEFAULT_SIZE, steps: int = DEFAULT_STEPS) -> ProbeSet:
    """10 prompts x 2 seeds = 20 images, cheap at 256x256 x 8 steps."""
    return _grid("default", DEFAULT_PROMPTS, DEFAULT_SEEDS, size, steps, None, None, None)


def default_stream_probe_set(size: str = "64x64", chunks: int = 8) -> ProbeSet:
    """One fixed streaming session (prompt, seed, size, chunks), gated as video: the drift probe."""
    return ProbeSet("stream", (ProbeItem("kite", "a kite over a grey sea", 7, size=size, chunks=chunks),), VIDEO_GATE)


def _grid(name: str, prompts: tuple[str, ...], seeds: tuple[int, ...], size: str, steps: int,
          guidance: float | None, frames: int | None, gate: str | None) -> ProbeSet:
    items: list[ProbeItem] = []
    for prompt in prompts:
        for seed in seeds:
            items.append(ProbeItem(f"{len(items):03d}", prompt, seed, size, steps, guidance, frames))
    return ProbeSet(name, tuple(items), gate)


# --- validation helpers ------------------------------------------------------------------


def _int(v: Any, key: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{key}: {v!r} is not an integer")
    if lo is not None and v < lo:
        raise ConfigError(f"{key}: {v} is below {lo}")
    if hi is not None and v > hi:
        raise ConfigError(f"{key}: {v} is above {hi}")
    return v


def _float(v: Any, key: str, lo: float | None = None, hi: float | None = None, *, open_lo: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{key}: {v!r} is not a number")
    x = float(v)
    if x != x:
        raise ConfigError(f"{key}: NaN is not allowed")
    if lo is not None and (x < lo or (open_lo and x == lo)):
        raise ConfigError(f"{key}: {v} must be {'above' if open_lo else 'at least'} {lo}")
    if hi is not None and x > hi:
        raise ConfigError(f"{key}: {v} is above {hi}")
    return x


def _str(v: Any, key: str) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ConfigError(f"{key}: {v!r} is not a non-empty string")
    return v


def _bool(v: Any, key: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{key}: {v!r} is not true or false")
    return v


def _size(v: Any, key: str) -> str:
    m = _SIZE.match(str(v)) if isinstance(v, str) else None
    if not m:
        raise ConfigError(f"{key}: {v!r} is not a size like 256x256 (width x height)")
    w, h = int(m.group(1)), int(m.group(2))
    if w <= 0 or h <= 0 or w % 16 or h % 16:
        raise ConfigError(f"{key}: {v!r} must be positive multiples of 16")
    return f"{w}x{h}"


def _mapping(v: Any, key: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ConfigError(f"{key or 'top level'}: expected a mapping, got {type(v).__name__}")
    for k in v:
        if k not in allowed:
            where = f"{key}.{k}" if key else str(k)
            raise ConfigError(f"{where}: unknown key (allowed: {', '.join(sorted(allowed))})")
    return v


_SET_KEYS = {"name", "gate", "size", "steps", "guidance_scale", "frames", "chunks", "prompts", "seeds", "items"}
_ITEM_KEYS = {"id", "prompt", "seed", "size", "steps", "guidance_scale", "frames", "chunks"}


def parse_probe_set(data: Any, where: str = "probe_set") -> ProbeSet:
    """A probe set from YAML data: ``prompts`` x ``seeds`` at one shape, or explicit ``items``."""
    d = _mapping(data, where, _SET_KEYS)
    name = _str(d.get("name", "default"), f"{where}.name")
    if not _NAME.match(name):
        raise ConfigError(f"{where}.name: {name!r} must be lowercase letters, digits, '-' or '_' (a directory name)")
    gate = d.get("gate")
    if gate is not None:
        gate = _str(gate, f"{where}.gate")
    size = _size(d.get("size", DEFAULT_SIZE), f"{where}.size")
    steps = _int(d.get("steps", DEFAULT_STEPS), f"{where}.steps", 1, 1000)
    guidance = d.get("guidance_scale")
    if guidance is not None:
        guidance = _float(guidance, f"{where}.guidance_scale", 0.0, 100.0)
    frames = d.get("frames")
    if frames is not None:
        frames = _int(frames, f"{where}.frames", 1, 1000)
    if "items" in d:
        if "prompts" in d or "seeds" in d:
            raise ConfigError(f"{where}.items: give either items or prompts x seeds, not both")
        raw = d["items"]
        if not isinstance(raw, list) or not raw:
            raise ConfigError(f"{where}.items: expected a non-empty list")
        items: list[ProbeItem] = []
        for n, it in enumerate(raw):
            k = f"{where}.items[{n}]"
            it = _mapping(it, k, _ITEM_KEYS)
            if "prompt" not in it or "seed" not in it:
                raise ConfigError(f"{k}: needs prompt and seed")
            g = it.get("guidance_scale", guidance)
            f = it.get("frames", frames)
            c = it.get("chunks", d.get("chunks"))
            if f is not None and c is not None:
                raise ConfigError(f"{k}: give frames (a video job) or chunks (a streaming session), not both")
            items.append(ProbeItem(
                id=_str(str(it.get("id", f"{n:03d}")), f"{k}.id"),
                prompt=_str(it["prompt"], f"{k}.prompt"),
                seed=_int(it["seed"], f"{k}.seed", 0),
                size=_size(it.get("size", size), f"{k}.size"),
                steps=_int(it.get("steps", steps), f"{k}.steps", 1, 1000),
                guidance_scale=None if g is None else _float(g, f"{k}.guidance_scale", 0.0, 100.0),
                frames=None if f is None else _int(f, f"{k}.frames", 1, 1000),
                chunks=None if c is None else _int(c, f"{k}.chunks", 2, 1000),
            ))
        ids = [i.id for i in items]
        for i in ids:
            if not _NAME.match(i.lower()) or ids.count(i) > 1:
                raise ConfigError(f"{where}.items: id {i!r} is duplicated or not usable as a file name")
        return ProbeSet(name, tuple(items), gate)
    if "chunks" in d:
        raise ConfigError(f"{where}.chunks: a stream probe set lists its sessions as items")
    prompts = d.get("prompts", list(DEFAULT_PROMPTS))
    if not isinstance(prompts, list) or not prompts:
        raise ConfigError(f"{where}.prompts: expected a non-empty list of strings")
    seeds = d.get("seeds", list(DEFAULT_SEEDS))
    if not isinstance(seeds, list) or not seeds:
        raise ConfigError(f"{where}.seeds: expected a non-empty list of integers")
    ps = tuple(_str(p, f"{where}.prompts[{n}]") for n, p in enumerate(prompts))
    ss = tuple(_int(s, f"{where}.seeds[{n}]", 0) for n, s in enumerate(seeds))
    return _grid(name, ps, ss, size, steps, guidance, frames, gate)


def load_yaml(path: str | Path) -> Any:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read ({e.strerror})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML ({e})") from None


def load_probe_set(path: str | Path) -> ProbeSet:
    try:
        return parse_probe_set(load_yaml(path), "probe_set")
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def gate_db(quality: Quality, kind: str) -> float:
    """The PSNR gate of a kind: a key of ``quality.gates_db``, or ``video``."""
    if kind == VIDEO_GATE:
        return quality.video_psnr_gate_db
    return quality.gate(kind)


def check_gate(quality: Quality, kind: str, key: str) -> None:
    if kind != VIDEO_GATE and kind not in quality.gates_db:
        raise ConfigError(f"{key}: {kind!r} is not a gate kind (one of {', '.join([*quality.gates_db, VIDEO_GATE])})")


# --- the sidecar's config ----------------------------------------------------------------


@dataclass(frozen=True)
class SidecarConfig:
    """What the sidecar runs; every field has a default, the YAML file and CLI flags override."""

    target: str | None = None
    probe_set: ProbeSet = field(default_factory=default_probe_set)
    baseline_dir: Path = Path("baselines")
    gate: str | None = None
    interval_s: float | None = None
    min_interval_s: float = 5.0
    retry_interval_s: float = 30.0
    timeout_s: float | None = None
    timeout_margin_s: float = 5.0
    initial_timeout_s: float = 60.0
    not_ready_grace_s: float = 600.0  # prober.NOT_READY_GRACE_S: how long a restart may take before it is failing
    budget_ratio: float | None = None
    thresholds: Path | None = None
    nvml: bool = True
    prober: bool = True
    practice_gpus: Path | None = None  # stand-in GPUs from this state file instead of NVML (practice_gpus.py)
    stream_probe_set: ProbeSet | None = None  # the drift probe (stream_probe.py): off unless given


CONFIG_KEYS = {"target", "probe_set", "baseline_dir", "gate", "interval_s", "min_interval_s", "retry_interval_s",
               "timeout_s", "timeout_margin_s", "initial_timeout_s", "not_ready_grace_s", "budget_ratio", "thresholds",
               "nvml", "prober", "practice_gpus", "stream_probe_set"}


def _probe_set_of(ps: Any, base: Path, key: str) -> ProbeSet:
    """A probe set given inline or as a file relative to ``base``; ``stream_probe_set: default`` is the
    built-in drift probe (one 8-chunk session at 64x64)."""
    if key == "stream_probe_set" and ps == "default":
        return default_stream_probe_set()
    if isinstance(ps, str):
        try:
            out = parse_probe_set(load_yaml(base / ps), key)
        except ConfigError as e:
            raise ConfigError(f"{key} ({base / ps}): {e}") from None
    else:
        out = parse_probe_set(ps, key)
    if (key == "stream_probe_set") != all(i.is_stream for i in out.items):
        raise ConfigError(f"{key}: {'every' if key == 'stream_probe_set' else 'no'} item must be a streaming "
                          "session (chunks)")
    return out


def parse_config(data: Any, base: Path | None = None) -> SidecarConfig:
    """Config from YAML data; relative paths are relative to ``base`` (the config file's folder)."""
    if data is None:
        data = {}
    d = _mapping(data, "", CONFIG_KEYS)
    base = base or Path(".")
    c = SidecarConfig()
    kw: dict[str, Any] = {}
    if "target" in d:
        kw["target"] = check_target(_str(d["target"], "target"), "target")
    if "probe_set" in d:
        kw["probe_set"] = _probe_set_of(d["probe_set"], base, "probe_set")
    if d.get("stream_probe_set") is not None:
        kw["stream_probe_set"] = _probe_set_of(d["stream_probe_set"], base, "stream_probe_set")
    if "baseline_dir" in d:
        kw["baseline_dir"] = base / _str(d["baseline_dir"], "baseline_dir")
    if "thresholds" in d:
        kw["thresholds"] = base / _str(d["thresholds"], "thresholds")
    if d.get("practice_gpus") is not None:
        kw["practice_gpus"] = base / _str(d["practice_gpus"], "practice_gpus")
    if d.get("gate") is not None:
        kw["gate"] = _str(d["gate"], "gate")
    for k in ("interval_s", "timeout_s", "budget_ratio"):
        if d.get(k) is not None:
            kw[k] = _float(d[k], k, 0.0, 1.0 if k == "budget_ratio" else None, open_lo=True)
    for k in ("min_interval_s", "retry_interval_s", "timeout_margin_s", "initial_timeout_s", "not_ready_grace_s"):
        if k in d:
            kw[k] = _float(d[k], k, 0.0, None, open_lo=k != "timeout_margin_s")
    for k in ("nvml", "prober"):
        if k in d:
            kw[k] = _bool(d[k], k)
    return replace(c, **kw)


def load_config(path: str | Path) -> SidecarConfig:
    p = Path(path)
    try:
        return parse_config(load_yaml(p), p.parent)
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(str(p)) else f"{p}: {msg}") from None


def positive(v: Any, key: str) -> float:
    """A number above 0 (seconds), or ConfigError naming ``key``."""
    return _float(v, key, 0.0, open_lo=True)


def check_target(url: str, key: str = "--target") -> str:
    if not re.match(r"^https?://[^/\s]+", url):
        raise ConfigError(f"{key}: {url!r} is not an http(s) URL like http://127.0.0.1:8000")
    return url.rstrip("/")
