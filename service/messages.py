"""The messages between the HTTP process and the worker process, written once for both sides.

They travel over a multiprocessing ``Connection`` as plain dicts (pickled), so
these are TypedDicts: the wire format is the dict, and mypy checks that the
worker sends what the server reads.  Every request but ``shutdown`` carries an
``id`` that its reply repeats; ``ready`` and ``fatal`` are unsolicited.

  server -> worker  generate, knobs, info, shutdown
  worker -> server  ready, fatal (once, at start-up); result or error (generate); knobs; info;
                    error (any request that failed); progress (a video job's steps, before its result)
"""

from __future__ import annotations

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


Request = GenerateMsg | KnobsMsg | InfoMsg
ToWorker = GenerateMsg | KnobsMsg | InfoMsg | ShutdownMsg


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

    p_tok: float
    layers: int
    hidden: int
    patch: list[int]
    cross_attention: bool
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
    kind: Literal["oom", "internal", "invalid", "cancelled"]
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


Reply = ResultMsg | ErrorMsg | KnobsReply | InfoReply
FromWorker = ReadyMsg | FatalMsg | ProgressMsg | Reply
