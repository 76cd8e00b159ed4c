"""Validation of the OpenAI-style images request: bad input gets a clear 4xx, never a crash.

Errors follow OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``.
Fields OpenAI clients send that we do not use (model, quality, style, user)
are accepted and ignored; no request text ever becomes a metric label.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from stepwatch.service.config import ServiceConfig

MAX_BODY_BYTES = 64 * 1024
MAX_PROMPT_CHARS = 4000


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str = "invalid_request",
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    n: int
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    frames: int = 1  # > 1: a video job (the video pipeline)
    job: int = 0  # a video job's sequence number, which its cancellation names (0: not a job)

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def is_video(self) -> bool:
        return self.frames > 1

    @property
    def cfg(self) -> bool:
        return self.guidance_scale > 1.0

    @property
    def shape(self) -> str:
        """The exporter's shape key for this request (width first, as ``size``)."""
        frames = f"x{self.frames}" if self.is_video else ""
        return f"{self.width}x{self.height}{frames}_{self.steps}s" + ("_cfg" if self.cfg else "")


def _bad(message: str, param: str | None, code: str = "invalid_value", status: int = 400) -> ApiError:
    return ApiError(status, message, param, code)


def int_field(body: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    """``body[key]``, an integer within lo..hi (default when absent or null), or a 400 naming the field."""
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"'{key}' must be an integer, got {type(v).__name__}", key, "invalid_type")
    if not lo <= v <= hi:
        raise _bad(f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return v


def parse_json(raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}", None,
                       "body_too_large")
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", None, "invalid_json")
    return body


def refuse_unknown(body: dict[str, Any], fields: tuple[str, ...], what: str) -> None:
    """A 400 for a field the endpoint does not take: a typo would otherwise silently change the result."""
    for k in body:
        if k not in fields:
            raise _bad(f"unknown field {k!r}; {what} takes {', '.join(fields)}", str(k), "unknown_parameter")


def prompt_field(body: dict[str, Any]) -> str:
    """``body["prompt"]``: a non-empty string of valid Unicode within the length limit, or a 400 naming it."""
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("'prompt' is required", "prompt", "missing_required_parameter")
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise _bad(f"'prompt' must be a string, got {type(prompt).__name__}", "prompt", "invalid_type")
    if not prompt.strip():
        raise _bad("'prompt' must not be empty", "prompt")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad("'prompt' is not valid Unicode text (it contains a lone surrogate)", "prompt") from None
    if len(prompt) > MAX_PROMPT_CHARS:
        raise _bad(f"'prompt' is {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}", "prompt")
    return prompt


def _guidance(body: dict[str, Any], default: float = 1.0) -> float:
    gs = body.get("guidance_scale", default)
    if gs is None:
        gs = default
    if isinstance(gs, bool) or not isinstance(gs, (int, float)):
        raise _bad(f"'guidance_scale' must be a number, got {type(gs).__name__}", "guidance_scale", "invalid_type")
    if not 0.0 <= gs <= 30.0:
        raise _bad(f"'guidance_scale' must be between 0 and 30, got {gs}", "guidance_scale")
    return float(gs)


def _seed(body: dict[str, Any]) -> int:
    seed = body.get("seed")
    return random.randrange(2**32) if seed is None else int_field(body, "seed", 0, 0, 2**32 - 1)


def _frames_of_seconds(body: dict[str, Any], fps: int, max_frames: int) -> int:
    """OpenAI's ``seconds`` (a string, "4"): the 4k+1 frames nearest that long at the service's fps."""
    if body.get("frames") is not None:
        raise _bad("give 'frames' or 'seconds', not both", "seconds", "conflicting_fields")
    raw = body["seconds"]
    try:
        seconds = float(raw) if isinstance(raw, (str, int, float)) and not isinstance(raw, bool) else float("nan")
    except ValueError:
        seconds = float("nan")
    longest = (max_frames - 1) / fps
    if not 0 < seconds <= longest + 1e-9:
        raise _bad(f"'seconds' must be a number of seconds up to {longest:g} ({max_frames} frames at {fps} fps), "
                   f"got {str(raw)[:40]!r}", "seconds")
    return max(5, 4 * round(seconds * fps / 4) + 1)


def validate(body: dict[str, Any], cfg: ServiceConfig) -> GenerationRequest:
    prompt = prompt_field(body)
    n = int_field(body, "n", 1, 1, cfg.max_n)
    fmt = body.get("response_format", "b64_json")
    if fmt is None:
        fmt = "b64_json"
    if fmt != "b64_json":
        raise _bad(f"'response_format' {fmt!r} is not supported; use 'b64_json'", "response_format")
    size = body.get("size", cfg.default_size)
    if size is None:
        size = cfg.default_size
    if not isinstance(size, str):
        raise _bad(f"'size' must be a string like '512x512', got {type(size).__name__}", "size", "invalid_type")
    parts = size.lower().split("x")
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() for p in parts):
        raise _bad(f"'size' {size!r} is not WxH, e.g. '512x512'", "size", "invalid_size")
    width, height = int(parts[0]), int(parts[1])
    if width <= 0 or height <= 0 or width % 16 or height % 16:
        raise _bad(f"'size' {size!r}: width and height must be positive multiples of 16", "size", "invalid_size")
    if max(width, height) > cfg.max_side or width * height > cfg.max_pixels:
        raise _bad(f"'size' {size!r} is over the maximum ({cfg.max_side} px per side, "
                   f"{cfg.max_pixels} pixels)", "size", "size_too_large")
    steps = int_field(body, "steps", cfg.default_steps, 1, cfg.max_steps)
    return GenerationRequest(prompt, n, width, height, steps, _guidance(body), _seed(body))


def size_choice(body: dict[str, Any], sizes: tuple[str, ...] | list[str], default: str, what: str) -> str:
    """``body["size"]`` (lower-cased), one of ``sizes``; absent or null is ``default``."""
    size = body.get("size")
    if size is None:
        return default
    if not isinstance(size, str):
        raise _bad(f"'size' must be a string like '{default}', got {type(size).__name__}", "size", "invalid_type")
    if size.lower() not in sizes:
        raise _bad(f"'size' {size!r} is not {what} this service serves ({', '.join(sizes)})", "size", "unknown_size")
    return size.lower()


VIDEO_FIELDS = ("prompt", "size", "frames", "seconds", "steps", "guidance_scale", "seed", "model")


def validate_video(body: dict[str, Any], cfg: ServiceConfig) -> GenerationRequest:
    """A ``POST /v1/videos`` body: prompt, size (one of the video sizes), frames (4k+1, up to the limit) or
    OpenAI's seconds, steps, guidance_scale, seed; model is accepted and not used (one video model).  An
    unknown field is refused (a typo would silently change the video)."""
    v = cfg.video
    refuse_unknown(body, VIDEO_FIELDS, "a video job")
    prompt = prompt_field(body)
    size = size_choice(body, v.sizes, v.default_size, "a video size")
    width, height = (int(x) for x in size.split("x"))
    frames = _frames_of_seconds(body, v.fps, v.max_frames) if body.get("seconds") is not None else int_field(
        body, "frames", v.default_frames, 1, 100_000)
    if (frames - 1) % 4:
        raise _bad(f"'frames' must be 4k+1 (1, 5, 9, ..., {v.max_frames}), got {frames}: the VAE compresses time "
                   "4x after the first frame", "frames", "invalid_frames")
    if frames > v.max_frames:
        raise _bad(f"'frames' {frames} is more than this service generates ({v.max_frames})", "frames",
                   "too_many_frames")
    if frames < 5:
        raise _bad("'frames' must be at least 5 for a video (1 frame is an image: use the images API)",
                   "frames", "invalid_frames")
    steps = int_field(body, "steps", v.default_steps, 1, v.max_steps)
    return GenerationRequest(prompt, 1, width, height, steps, _guidance(body, v.guidance_scale), _seed(body),
                             frames=frames)
