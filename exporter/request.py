"""One request's recorded marks, and the pure step that turns them into a RequestReport.

The hooks only record (clock marks, branch counts, cache decisions, memory peaks) while the
request runs; everything derived (durations, the shape, FLOPs, MFU, the peaks per stage) is
computed here afterwards, once device timings are ready.  No Prometheus, no pipeline: the
step is a function of the marks, a clock and the labeler, so it is unit-tested on plain
numbers.
"""

from __future__ import annotations

import inspect
import itertools
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stepwatch.exporter import caches, ledger
from stepwatch.exporter.report import CompileEvent, RequestReport
from stepwatch.exporter.shapes import ShapeKey, ShapeLabeler

STAGES = ("text_encode", "denoise", "vae_decode")
PEAK_STAGES = (*STAGES, "request")

Bounds = tuple[float, float]  # seconds from the request start


@dataclass
class RequestMarks:
    """What the hooks record for one request in flight (marks are the clock's: floats or CUDA events).

    The per-step hooks write one flat log through the bound ``add``: the batch (int) of every transformer
    call, a branch name (str) per cache_context, and per scheduler.step its clock mark or, with a cache
    active, (mark, the cache's raw state) in one tuple.  ``replay`` turns it into step marks, the samples
    each step computed, branch names and decisions at request end, so a step costs one append (and a state
    copy) besides one or two per call.  ``step_marks``/``decisions``/``max_branches`` hold marks recorded
    directly (tests, other recorders) and are merged with the log.  ``call_shape`` is the first call's
    (hidden_states shape, text tokens), what the ledger counts; ``prompt_batch`` the samples one branch
    holds (prompts x images per prompt), what a call's batch is divided by to count CFG branches.
    """

    start: Any
    start_unix: float
    height: int | None
    width: int | None
    frames: int | None
    steps_hint: int | None
    cfg_hint: bool
    text_tokens: int
    parent_ctx: Any
    cache: tuple[str, caches.Decision] | None
    stage: str = "prepare"
    mem_stage: str = "prepare"
    te_spans: list[tuple[Any, Any]] = field(default_factory=list)
    te_open: Any = None
    denoise_start: Any = None
    planned_steps: int | None = None
    step_marks: list[Any] = field(default_factory=list)
    max_branches: int = 0
    log: list[Any] = field(default_factory=list)
    decisions: list[tuple[int, str, bool]] = field(default_factory=list)
    vae_spans: list[tuple[Any, Any]] = field(default_factory=list)
    vae_open: Any = None
    end: Any = None
    compiles: list[tuple[float, float]] = field(default_factory=list)
    peaks: dict[str, int] = field(default_factory=dict)
    capacity: int = 0
    outcome: str = "ok"
    error: str | None = None
    oom_demand: int | None = None
    prompt_batch: int | None = None
    call_shape: tuple[tuple[int, ...], int | None] | None = None
    rank_request: int = -1  # this request's index on the rank reporter's timeline (see exporter/ranks.py)
    stream: Any = None  # chunks.StreamMarks for a chunked autoregressive video call
    span_attrs: dict[str, Any] | None = None  # the GenAI request attributes, read only when spans are drawn
    add: Callable[[Any], None] = field(init=False, repr=False)
    take: Callable[[], dict[str, Any]] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.add = self.log.append  # bound once: the hooks' one call per event
        self.take = getattr(self.cache[1], "take", None) if self.cache is not None else None

    def tail_snapshot(self) -> None:
        """Branches that ran after the last step (a failed step, a pipeline without a final step call) had
        no snapshot taken: take it now, once denoising is over (at the VAE decode, before the pipeline
        resets its cache hooks; else when the request ends, which a failed step reaches first)."""
        if self.take is not None and self.log and type(self.log[-1]) is str:
            self.add(self.take())


@dataclass
class Replayed:
    """The log replayed: all step marks, the most cache_context branches in one step, every cache decision,
    and the samples the transformer computed in each step that called it (the batches of its calls)."""

    step_marks: list[Any]
    max_branches: int
    decisions: list[tuple[int, str, bool]]
    step_samples: list[int] = field(default_factory=list)


def replay(req: RequestMarks) -> Replayed:
    """Walk the hot path's log once: an int is a transformer call's batch, names count branches per step; a
    mark, or a (mark, cache state) pair, closes a step and the state decides the branches logged since the
    step before; a state alone (the tail snapshot) decides the branches after the last step.  This loop runs
    over every event of the request, so it is written for speed: class checks, bound appends, a step
    counter instead of len()."""
    marks = list(req.step_marks)
    branches = req.max_branches
    decisions = list(req.decisions)
    samples: list[int] = []
    decide = getattr(req.cache[1], "decide", None) if req.cache is not None else None
    negate = decide is caches.Reader.decide  # FirstBlockCache / MagCache: a hit is a branch that did not compute
    decided, mark = decisions.append, marks.append
    step = len(marks)
    group: list[str] = []
    batch = 0
    for x in req.log:
        cls = x.__class__
        if cls is int:
            batch += x
            continue
        if cls is str:
            group.append(x)
            continue
        if cls is tuple:
            x, state = x
        elif cls is dict:
            x, state = None, x
        else:
            state = None
        if state is not None and decide is not None:
            for name in group:
                raw = state.get(name)
                if raw is None:
                    raw = caches.branch_raw(state, name)
                    if raw is None:
                        continue
                if negate:
                    decided((step, name, not raw))
                    continue
                hit = decide(raw)
                if hit is not None:
                    decided((step, name, hit))
        if x is not None:
            mark(x)
            step += 1
            if len(group) > branches:
                branches = len(group)
            group = []
            if batch:
                samples.append(batch)
                batch = 0
    return Replayed(marks, branches, decisions, samples)


@dataclass
class Resolved:
    """A report plus the bounds the spans are drawn from."""

    report: RequestReport
    stage_bounds: dict[str, Bounds]
    step_edges: list[float]  # denoising's start, then each step's end (seconds from the request start)

    @property
    def step_bounds(self) -> list[Bounds]:
        """Each step's (start, end): built only when spans are drawn."""
        return list(itertools.pairwise(self.step_edges))


@dataclass
class ResolveContext:
    """What resolving needs besides the marks; ``step_flops(marks, branches)`` is None without a ledger."""

    seconds: Callable[[Any, Any], float]
    labeler: ShapeLabeler
    device: str
    peak_flops: float | None = None
    step_flops: Callable[[RequestMarks, int], float | None] | None = None  # (marks, samples per step)
    offsets: Callable[[Any, list[Any]], list[float]] | None = None  # the clock's, else seconds() per mark


def _spans(req: RequestMarks, ctx: ResolveContext, spans: list[tuple[Any, Any]]) -> tuple[float, Bounds]:
    """Total time of a stage that may run more than once (two encoders, tiled decode), and its bounds."""
    s = ctx.seconds
    return sum(s(a, b) for a, b in spans), (s(req.start, spans[0][0]), s(req.start, spans[-1][1]))


def _timings(req: RequestMarks, ctx: ResolveContext,
             step_marks: list[Any]) -> tuple[dict[str, float], dict[str, Bounds], list[float], list[float]]:
    """Stage seconds, stage bounds, the step edges (denoising's start, then each step's end, in seconds from
    the request start) and the step times.  A
    step runs from the previous step's end (the first from the end of set_timesteps) to its scheduler.step
    return, so it covers all CFG branches."""
    stages: dict[str, float] = {}
    bounds: dict[str, Bounds] = {}
    if req.te_spans:
        stages["text_encode"], bounds["text_encode"] = _spans(req, ctx, req.te_spans)
    edges: list[float] = []
    step_seconds: list[float] = []
    if req.denoise_start is not None and step_marks:
        first = ctx.seconds(req.start, req.denoise_start)
        ends = (ctx.offsets(req.start, step_marks) if ctx.offsets is not None
                else [ctx.seconds(req.start, m) for m in step_marks])
        edges = [first, *ends]
        step_seconds = [b - a for a, b in itertools.pairwise(edges)]
        stages["denoise"] = ends[-1] - first
        bounds["denoise"] = (first, ends[-1])
    if req.vae_spans:
        stages["vae_decode"], bounds["vae_decode"] = _spans(req, ctx, req.vae_spans)
    return stages, bounds, edges, step_seconds


def _peaks(req: RequestMarks) -> tuple[dict[str, int], str | None]:
    """Peak bytes per stage and for the request; on a failure, the stage it failed in.  An OOM's demand
    (in use + the refused allocation) counts as its stage's peak: it is what did not fit."""
    peaks = {k: v for k, v in req.peaks.items() if k not in ("prepare", "postprocess")}
    request_peak = max(req.peaks.values()) if req.peaks else 0
    failed_stage = None
    if req.outcome != "ok":
        failed_stage = req.stage
        if req.oom_demand is not None and req.stage in STAGES:
            peaks[req.stage] = max(peaks.get(req.stage, 0), req.oom_demand)
            request_peak = max(request_peak, req.oom_demand)
    peaks["request"] = request_peak
    return peaks, failed_stage


def usual_samples(step_samples: list[int]) -> int | None:
    """The samples a step usually computes: the most common count (the larger on a tie).  A chunked video
    pipeline's KV-cache pass adds a call to one step per chunk; the usual step is the others."""
    if not step_samples:
        return None
    counts = Counter(step_samples)
    return max(counts, key=lambda n: (counts[n], n))


def branch_count(samples: int | None, prompt_batch: int | None, logged: int, hint: bool) -> int:
    """CFG branches per step: the shape's ``_cfg``, the ``cfg_branches`` gauge and the ledger's multiplier.

    From what the transformer received: the samples a step's calls held (``usual_samples``) over the samples
    one branch holds (the prompt batch), so separate calls (FLUX's true CFG, Wan) and one call on a doubled
    batch (SD3, PixArt, CogVideoX, LTX) count alike, and a tripled batch (PAG with CFG) reads 3.  Without
    calls seen (a request that failed before its first step) or a known prompt batch: the most
    cache_context branches in one step, else the call's parameters (``cfg_hint``)."""
    if samples and prompt_batch:
        return max(1, round(samples / prompt_batch))
    if logged:
        return logged
    return 2 if hint else 1


def resolve(req: RequestMarks, phase: str, ctx: ResolveContext) -> Resolved:
    """The report of one finished request whose marks are all ready."""
    log = replay(req)
    stages, stage_bounds, step_edges, step_seconds = _timings(req, ctx, log.step_marks)
    samples = usual_samples(log.step_samples)
    branches = branch_count(samples, req.prompt_batch, log.max_branches, req.cfg_hint)
    cfg = branches > 1
    steps = req.planned_steps or req.steps_hint or len(step_seconds)
    shape = (ShapeKey(req.height, req.width, int(steps), cfg, req.frames)
             if req.height and req.width and steps else None)
    step_flops = None
    if shape is not None and ctx.step_flops is not None:
        step_flops = ctx.step_flops(req, samples or branches * (req.prompt_batch or 1))
    mean_step = sum(step_seconds) / len(step_seconds) if step_seconds else 0.0
    peaks, failed_stage = _peaks(req)
    report = RequestReport(
        shape=shape,
        shape_label=ctx.labeler.label(shape),
        outcome=req.outcome,
        seconds=ctx.seconds(req.start, req.end),
        stages=stages,
        step_seconds=step_seconds,
        cfg_branches=branches,
        cache=req.cache[0] if req.cache else None,
        cache_decisions=log.decisions,
        compiles=[CompileEvent(s, d, phase) for s, d in req.compiles],
        memory_peak_bytes=peaks,
        memory_capacity_bytes=req.capacity,
        device=ctx.device,
        step_flops=step_flops,
        mfu=ledger.mfu(step_flops, mean_step, ctx.peak_flops) if step_flops else None,
        failed_stage=failed_stage,
        error=req.error,
        start_unix=req.start_unix,
    )
    return Resolved(report, stage_bounds, step_edges)


class StepFlops:
    """The ledger's FLOPs per step: one forward at the first call's token counts, times the samples a step
    computed (CFG branches x prompt batch; separate calls or the halves of a doubled batch cost the same).
    Memoized (requests repeat a few shapes)."""

    _MEMO_MAX = 256

    def __init__(self, model: ledger.LedgerModel) -> None:
        self.model = model
        self._memo: dict[tuple[Any, ...], float] = {}

    def __call__(self, req: RequestMarks, samples: int) -> float | None:
        if req.call_shape is None:
            return None
        hidden, text = req.call_shape
        if text is None:  # the call passed no encoder_hidden_states: the request's text length (max_sequence_length)
            text = req.text_tokens
        key = (hidden, text)
        one = self._memo.get(key)
        if one is None:
            one = self.model.forward_flops(self.model.image_tokens(hidden), text)
            if len(self._memo) < self._MEMO_MAX:
                self._memo[key] = one
        return samples * one


class CallSignature:
    """Positional names and defaults of the pipeline's __call__, read once; binding is a dict merge."""

    def __init__(self, cls: type) -> None:
        self.names: list[str] = []
        self.defaults: dict[str, Any] = {}
        try:
            sig = inspect.signature(cls.__call__)
        except (TypeError, ValueError):
            return
        for i, (name, p) in enumerate(sig.parameters.items()):
            if i == 0 or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                self.names.append(name)
            if p.default is not p.empty:
                self.defaults[name] = p.default

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        out = dict(self.defaults)
        if args:
            out.update(zip(self.names, args, strict=False))
        out.update(kwargs)
        return out


def default_size(pipe: Any) -> int | None:
    """The pipeline's own default height/width, for calls that do not pass them."""
    sample = getattr(pipe, "default_sample_size", None)
    scale = getattr(pipe, "vae_scale_factor", None) or getattr(pipe, "vae_scale_factor_spatial", None)
    if sample and scale:
        return int(sample) * int(scale)
    return None


def cfg_hint(pipe: Any, params: Mapping[str, Any]) -> bool:
    """CFG on, from the call's parameters?  Only used when no transformer call was seen (see branch_count).
    A FLUX-family transformer embeds ``guidance_scale`` (FLUX.2's config has no ``guidance_embeds`` to say
    so): its CFG is ``true_cfg_scale`` only."""
    true_cfg = params.get("true_cfg_scale")
    if true_cfg is not None and "guidance_scale" in params and "negative_prompt" in params:
        negative = params.get("negative_prompt") or params.get("negative_prompt_embeds") is not None
        return bool(true_cfg > 1 and negative)  # never a tensor's truth: it raises
    gs = params.get("guidance_scale")
    if gs is None or not gs > 1:
        return False
    t = getattr(pipe, "transformer", None)
    t = getattr(t, "_orig_mod", t)
    return not (type(t).__name__.startswith("Flux") or getattr(t, "config", {}).get("guidance_embeds", False))


def denoiser(pipe: Any) -> Any:
    """The transformer (or UNet), unwrapped from torch.compile's OptimizedModule for its config and hooks."""
    t = getattr(pipe, "transformer", None)  # not `or`: an OptimizedModule's truth test raises
    if t is None:
        t = getattr(pipe, "unet", None)
    return getattr(t, "_orig_mod", t)


def prompt_batch(params: Mapping[str, Any]) -> int | None:
    """The samples one CFG branch holds: prompts (a string, a list, or the rows of ``prompt_embeds``) times
    images or videos per prompt; None when the call does not say (then branches are not counted by batch)."""
    prompt = params.get("prompt")
    if isinstance(prompt, str):
        n = 1
    elif isinstance(prompt, (list, tuple)) and prompt:
        n = len(prompt)
    else:
        shape = getattr(params.get("prompt_embeds"), "shape", None)
        if not shape:
            return None
        n = int(shape[0])
    per = params.get("num_images_per_prompt")
    if per is None:
        per = params.get("num_videos_per_prompt", 1)
    return n * per if isinstance(per, int) and per > 0 else None


def marks_for(pipe: Any, params: Mapping[str, Any], *, start: Any, start_unix: float, text_tokens: int | None,
              parent_ctx: Any, cache: tuple[str, caches.Decision] | None) -> RequestMarks:
    """A request's marks from its bound call parameters (sizes default to the pipeline's)."""
    height, width = params.get("height"), params.get("width")
    if height is None or width is None:
        default = default_size(pipe)
        height = height or default
        width = width or default
    frames = params.get("num_frames")
    tokens = params.get("max_sequence_length") or text_tokens or 0
    return RequestMarks(
        start=start,
        start_unix=start_unix,
        height=int(height) if height else None,
        width=int(width) if width else None,
        frames=int(frames) if isinstance(frames, int) and frames > 1 else None,
        steps_hint=params.get("num_inference_steps"),
        cfg_hint=cfg_hint(pipe, params),
        prompt_batch=prompt_batch(params),
        text_tokens=int(tokens),
        parent_ctx=parent_ctx,
        cache=cache,
    )
