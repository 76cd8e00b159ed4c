"""The messages between the HTTP process and the worker process, written once for both sides.

They travel over a multiprocessing ``Connection`` as plain dicts (pickled), so
these are TypedDicts: the wire format is the dict, and mypy checks that the
worker sends what the server reads.  Every request but ``shutdown`` carries an
``id`` that its reply repeats; ``ready`` and ``fatal`` are unsolicited.

  server -> worker  generate, knobs, info, shutdown; session (open one: its reply comes when it ends),
                    session_prompt, session_close
  worker -> server  ready, fatal (once, at start-up); result or error (generate); knobs; info;
                    error (any request that failed); progress (a video job's steps, before its result);
                    session_started and chunk (a session's, before its session_end); session_ack
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypedDict


# ----- server -> worker -------------------------------------------------------------------------
class GenerateMsg(TypedDict):
    op: Literal["generate"]
    id: str
    request: dict[str, Any]  # the fields of api.GenerationRequest


class KnobsMsg(TypedDict):
    op: Literal["knobs"]
    id: str
    knobs: dict[str, Any]  # already checked by knobs.validate


class InfoMsg(TypedDict):
    op: Literal["info"]
    id: str


class ShutdownMsg(TypedDict):
    op: Literal["shutdown"]


class SessionMsg(TypedDict):
    """Open a streaming session; ``id`` is the session's and its session_end (or a refusal) the reply."""

    op: Literal["session"]
    id: str
    request: dict[str, Any]  # prompt, seed, width, height, chunks, steps
    opened_at: float  # the server's time.perf_counter() when the client opened it (the system's monotonic clock)


class SessionPromptMsg(TypedDict):
    op: Literal["session_prompt"]
    id: str
    session: str
    prompt: str


class SessionCloseMsg(TypedDict):
    op: Literal["session_close"]
    id: str
    session: str
    reason: str  # closed (by its client), idle (the idle timeout) or backpressure (the send buffer)


Request = GenerateMsg | KnobsMsg | InfoMsg | SessionMsg | SessionPromptMsg | SessionCloseMsg
ToWorker = GenerateMsg | KnobsMsg | InfoMsg | ShutdownMsg | SessionMsg | SessionPromptMsg | SessionCloseMsg


# ----- worker -> server -------------------------------------------------------------------------
class _VideoWarmup(TypedDict, total=False):
    frames: int  # a video warm-up run: its frames, steps and guidance (the predictor's first observation)
    steps: int
    guidance_scale: float


class WarmupRun(_VideoWarmup):
    size: str
    run: int
    seconds: float
    compiles: int
    stages: dict[str, float]
    shape: str


class Ledger(TypedDict):
    """What the server's queue predictor needs of the worker's FLOPs ledger (see queue.LedgerParams)."""

    model: dict[str, Any]  # exporter.ledger.LedgerModel.as_dict()
    vae_scale: int
    text_tokens: int


class RankProc(TypedDict):
    rank: int
    pid: int
    cpus: list[int]


class ReadyMsg(TypedDict):
    op: Literal["ready"]
    pid: int
    metrics_port: int
    fingerprint: dict[str, Any]
    knobs: dict[str, Any]
    ledger: Ledger | None
    budget_bytes: int | None
    setup_seconds: float
    warmup: list[WarmupRun]
    ranks: list[RankProc]  # with ranks: each rank's process and CPUs (empty with one rank)


class FatalMsg(TypedDict):
    op: Literal["fatal"]
    message: str


class CacheStats(TypedDict):
    kind: str | None
    hits: int
    misses: int


class _VideoResult(TypedDict, total=False):
    content_type: str  # a video job: images holds one MP4
    frames: int


class ResultMsg(_VideoResult):
    op: Literal["result"]
    id: str
    images: list[bytes]  # PNG
    seconds: float
    nonfinite: int
    shape: str
    stages: dict[str, float]
    steps: int
    cache: CacheStats | None
    compiles: int
    rss_bytes: int
    ranks: dict[str, Any] | None


class _ErrorDetail(TypedDict, total=False):
    stage: str | None  # the pipeline stage that failed, when a generate failed
    shape: str
    size: str
    param: str | None  # the knob a refused knobs request named


class ErrorMsg(_ErrorDetail):
    op: Literal["error"]
    id: str | None
    kind: Literal["oom", "internal", "invalid", "cancelled", "busy"]  # busy: every session slot is taken
    message: str


class KnobsReply(TypedDict):
    op: Literal["knobs"]
    id: str
    knobs: dict[str, Any]
    fingerprint: dict[str, Any]


class InfoReply(TypedDict):
    op: Literal["info"]
    id: str
    pid: int
    rss_bytes: int
    vm_bytes: int
    budget_bytes: int | None
    knobs: dict[str, Any]
    fingerprint: dict[str, Any]


class ProgressMsg(TypedDict):
    """Unsolicited, during a video job: step ``step`` of ``steps`` is done (``id``: the generate request's)."""

    op: Literal["progress"]
    id: str
    step: int
    steps: int


class SessionStartedMsg(TypedDict):
    """Unsolicited: the session has a slot and its call started (``id``: the session's)."""

    op: Literal["session_started"]
    id: str
    chunks: int
    frames_per_chunk: list[int]


class ChunkMsg(TypedDict):
    """Unsolicited: one chunk's frames, sent as soon as the chunk is done."""

    op: Literal["chunk"]
    id: str
    index: int
    frames: list[bytes]  # PNG
    prompt_version: int  # 0: the opening prompt; each accepted change adds 1
    seconds: float  # the chunk's latency as the worker saw it (previous chunk's frames out to this one's)


class SessionEndMsg(TypedDict):
    """The reply to ``session``: how it ended and what it delivered."""

    op: Literal["session_end"]
    id: str
    outcome: Literal["done", "closed", "failed"]
    reason: str  # done, closed, idle, backpressure, oom, error
    chunks: int  # chunks delivered
    message: str
    kv_bytes: int  # the session's KV cache as allocated (its tensors), 0 when its call never ran
    kv_ledger_bytes: int  # what the KV ledger reserved for it


class SessionAckMsg(TypedDict):
    """The reply to session_prompt and session_close: ``applies_from`` is the first chunk the change reaches."""

    op: Literal["session_ack"]
    id: str
    session: str
    ok: bool
    applies_from: int
    message: str


Reply = ResultMsg | ErrorMsg | KnobsReply | InfoReply | SessionEndMsg | SessionAckMsg
FromWorker = ReadyMsg | FatalMsg | ProgressMsg | SessionStartedMsg | ChunkMsg | Reply


_SERVER_PATH = re.compile(r"(?<![\w.])/(?:[\w.+-]+/)+[\w.+-]*")


def internal_message(exc: BaseException) -> str:
    """What a client is told of an unexpected error: the type and first line of the error and of its root cause
    (a compiler's error wraps the kernel's), any server path masked; never a traceback (the worker's log has it)."""
    said = [_first_line(exc)]
    root, depth = exc, 0
    while (root.__cause__ or root.__context__) is not None and depth < 8:
        root, depth = root.__cause__ or root.__context__, depth + 1  # type: ignore[assignment]
    if root is not exc:
        said.append(_first_line(root))
    return f"internal error ({' <- '.join(said)}); the service's log has the details"


def _first_line(exc: BaseException) -> str:
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    text = _SERVER_PATH.sub("<path>", first)[:240]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
