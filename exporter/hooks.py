"""The wrappers the patch registry installs: the hot path, so each records only what it must.

Each wrapper looks up the calling thread's request once; outside a request (or when the pipeline
is called on another thread) it is a pass-through.  Hook bodies are the handle's methods, called
through the instance (so a test or ``gpu-check`` can replace one), and never raise into the
pipeline: their errors go to the handle's guard under the hook's name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stepwatch.exporter import patches

if TYPE_CHECKING:  # typing only: instrument imports this module
    from stepwatch.exporter.instrument import Instrumentation

ATTR = "_stepwatch"  # the pipeline's instance attribute holding its Instrumentation


def stage(inst: Instrumentation, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
    """Around a stage call (``te``: encode_prompt, ``vae``: vae.decode): its bounds and memory window."""
    local = inst._local
    enter_name, exit_name = f"{kind}.enter", f"{kind}.exit"

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        req = getattr(local, "req", None)
        if req is not None:
            try:
                inst._stage_enter(req, kind)
            except Exception as e:
                inst._guard.fail(enter_name, e)
        out = fn(*args, **kwargs)
        if req is not None:
            try:
                inst._stage_exit(req, kind)
            except Exception as e:
                inst._guard.fail(exit_name, e)
        return out

    wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapped


def set_timesteps(inst: Instrumentation, fn: Callable[..., Any]) -> Callable[..., Any]:
    """After scheduler.set_timesteps: the planned steps; denoising starts here."""
    local = inst._local

    def set_timesteps(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        req = getattr(local, "req", None)
        if req is not None:
            try:
                inst._denoise_start(req)
            except Exception as e:
                inst._guard.fail(patches.SET_TIMESTEPS, e)
        return out

    set_timesteps.__wrapped__ = fn  # type: ignore[attr-defined]
    return set_timesteps


def step(inst: Instrumentation, fn: Callable[..., Any]) -> Callable[..., Any]:
    """After scheduler.step: the step's mark or, with a cache active, (mark, the cache's state); nothing else.
    Branch counts and decisions are derived from the log at request end (``request.replay``)."""
    local = inst._local
    clock = inst.clock  # its ``mark`` is looked up per call: gpu-check replaces it on the instance

    def step(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        req = getattr(local, "req", None)
        if req is not None:
            try:
                take = req.take
                req.add(clock.mark() if take is None else (clock.mark(), take()))
            except Exception as e:
                inst._guard.fail(patches.STEP, e)
        return out

    step.__wrapped__ = fn  # type: ignore[attr-defined]
    return step


def cache_context(inst: Instrumentation, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Around transformer.cache_context (one per CFG branch): logs the branch name; the pipeline gets the
    original context unchanged.  The branch's cache decision is read with the step's snapshot."""
    local = inst._local

    def cache_context(name: str, *args: Any, **kwargs: Any) -> Any:
        # diffusers passes the name alone; forwarding empty *args/**kwargs would cost more than the hook.
        inner = fn(name, *args, **kwargs) if args or kwargs else fn(name)
        req = getattr(local, "req", None)
        if req is not None:
            try:
                req.add(name if name.__class__ is str else str(name))  # a str in the log is a branch name
            except Exception as e:
                inst._guard.fail("transformer.cache_context", e)
        return inner

    cache_context.__wrapped__ = fn  # type: ignore[attr-defined]
    return cache_context


def _recording(inst: Instrumentation, call: Callable[..., Any], bound: bool) -> Callable[..., Any]:
    """``call`` preceded by the per-call record (one per CFG branch per step: the hot path, so the record is
    inline and its lookups bound once per handle): the call's batch to the log; the first call's shapes
    through the handle (``_first_call``), once per request.  ``bound``: ``call`` takes the module first (a
    class's __call__), else it is already bound (an instance's compiled call)."""
    local = inst._local
    fail = inst._guard.fail
    first = inst._first_call
    name = patches.DENOISER_CALL

    def recording(*args: Any, **kwargs: Any) -> Any:
        req = getattr(local, "req", None)
        if req is not None:
            try:
                hidden = kwargs.get("hidden_states")
                if hidden is None:
                    hidden = args[bound] if len(args) > bound else kwargs["sample"]
                req.add(int(hidden.shape[0]))
                if req.call_shape is None:
                    first(req, hidden, kwargs)
            except Exception as e:
                fail(name, e)
        return call(*args, **kwargs)

    recording.__wrapped__ = call  # type: ignore[attr-defined]
    return recording


def denoiser_class(inst: Instrumentation, cls: type) -> type:
    """A subclass of the transformer's class whose __call__ records what each call receives before the
    module's own call, outside anything torch.compile traces (one per handle and class)."""
    return _with_call(cls, _recording(inst, cls.__call__, True))


def _with_call(cls: type, call: Callable[..., Any]) -> type:
    """A subclass of ``cls`` that only replaces ``__call__`` (looked up on the type), named as ``cls``."""
    return type(cls.__name__, (cls,), {"__call__": call, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "_stepwatch_original_class": cls})


def compiled_denoiser_call(inst: Instrumentation, fn: Callable[..., Any]) -> Callable[..., Any]:
    """For a transformer already compiled in place (``module.compile()``): the same record around its
    compiled call, on the instance, since swapping its class would fail dynamo's type guard (a recompile)."""
    return _recording(inst, fn, False)


_CLASS_CACHE: dict[type, type] = {}


def _call(inst: Instrumentation, original_call: Callable[..., Any], pipe: Any, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> Any:
    req = None
    try:
        req = inst._begin(args, kwargs)
    except Exception as e:
        inst._guard.fail("request.begin", e)
        inst._local.req = None
    try:
        out = original_call(pipe, *args, **kwargs)
    except BaseException as exc:
        _end(inst, req, exc)
        raise
    _end(inst, req, None)
    return out


def _end(inst: Instrumentation, req: Any, exc: BaseException | None) -> None:
    try:
        if req is not None:
            inst._end(req, exc)
        else:
            inst.end_unbegun()
    except Exception as e:
        inst._guard.fail("request.end", e)


def instrumented_class(cls: type) -> type:
    """A subclass whose __call__ wraps the original one with request bookkeeping (one per class)."""
    sub = _CLASS_CACHE.get(cls)
    if sub is not None:
        return sub
    original_call = cls.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        inst: Instrumentation | None = self.__dict__.get(ATTR)
        if inst is None:
            return original_call(self, *args, **kwargs)
        return _call(inst, original_call, self, args, kwargs)

    __call__.__doc__ = original_call.__doc__
    __call__.__wrapped__ = original_call  # type: ignore[attr-defined]
    sub = _CLASS_CACHE[cls] = _with_call(cls, __call__)
    return sub


def encode_kv_cache(inst: Instrumentation, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Around pipeline.encode_kv_cache (chunked autoregressive video; once per chunk but the last): the chunk's
    frames are out when it starts, and the cache it returns is read for its bytes (tensor sizes only)."""
    local = inst._local

    def encode_kv_cache(*args: Any, **kwargs: Any) -> Any:
        req = getattr(local, "req", None)
        stream = req.stream if req is not None else None
        if stream is not None:
            try:
                stream.outs.append(inst.clock.mark())
            except Exception as e:
                inst._guard.fail(patches.ENCODE_KV_CACHE, e)
        out = fn(*args, **kwargs)
        if req is not None and stream is not None:
            try:
                inst._kv_read(req, out, args[1] if len(args) > 1 else kwargs.get("kv_cache_flag"))
            except Exception as e:
                inst._guard.fail(patches.ENCODE_KV_CACHE, e)
        return out

    encode_kv_cache.__wrapped__ = fn  # type: ignore[attr-defined]
    return encode_kv_cache
