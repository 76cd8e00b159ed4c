"""The practice service's cross-step cache knob, on diffusers' own cache hooks.

Production caches (TeaCache, FirstBlockCache) always compute the first and the
last step: the first has nothing to reuse, and a reused last step leaves its
error in the final image.  diffusers' FirstBlockCache does not protect the last
step, so ``apply_cache`` adds that guard around the hook's own decision.
Changing only the threshold of the active cache edits it in place: the blocks'
forward is untouched, so a compiled transformer is not recompiled.

With context parallelism (``ranks`` > 1) diffusers' FirstBlockCache decides on each
rank's own shard of the first block's residual, and nothing makes the ranks agree: one
rank can skip the remaining blocks while another computes them, and the one computing
then waits forever in an attention all-to-all the other never enters (the two-rank
deadlock; reproduced in tests/test_service_ranks.py).  So with more than one rank the
guard also makes the decision collective: the remaining blocks are computed when any
rank wants them (one all-reduce of one integer per step, on every rank).  MagCache
(with calibrated ratios) and TaylorSeer decide from the step index alone, so ranks agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Stamp = Callable[[Callable[..., Any]], Callable[..., Any]]
KINDS = ("none", "first_block_cache", "mag_cache", "taylorseer")
_FBC_LEADER = "fbc_leader_block_hook"


class _LastStepGuard:
    """Wraps FBCHeadBlockHook._should_compute_remaining_blocks: compute the final step, and with ``sync``
    compute whenever any rank would."""

    def __init__(self, hook: Any, scheduler: Any, sync: bool = False, stamp: Stamp | None = None) -> None:
        self._hook = hook
        self._orig = hook._should_compute_remaining_blocks
        self._scheduler = scheduler
        self._sync = sync
        self._reduce = stamp(_all_reduce_max) if stamp is not None else _all_reduce_max

    def _decide(self, residual: Any) -> bool:
        state = self._hook.state_manager.get_state()
        calls = getattr(state, "_stepwatch_calls", 0) + 1
        state._stepwatch_calls = calls
        ts = getattr(self._scheduler, "timesteps", None)
        steps = len(ts) if ts is not None else 0
        if steps and calls >= steps:
            return True  # every rank reaches its last step at the same call: no agreement needed
        compute = bool(self._orig(residual))
        return _any_rank(compute, residual.device, self._reduce) if self._sync else compute

    def install(self) -> None:
        import torch  # here: the HTTP process imports this module (for KINDS) and must not load torch

        self._hook._should_compute_remaining_blocks = torch.compiler.disable(self._decide)


def _any_rank(flag: bool, device: Any, reduce: Callable[[Any], None]) -> bool:
    """True on every rank when it is True on any: one all-reduce (MAX) of one integer."""
    import torch

    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    reduce(t)
    return bool(t.item())


def _all_reduce_max(t: Any) -> None:
    import torch.distributed as dist

    dist.all_reduce(t, op=dist.ReduceOp.MAX)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _leader(transformer: Any, name: str) -> Any:
    for mod in transformer.modules():
        hooks = getattr(getattr(mod, "_diffusers_hook", None), "hooks", None)
        if hooks and name in hooks:
            return hooks[name]
    return None


def current(transformer: Any) -> tuple[str, float | None]:
    """(kind, threshold) of the cache active on the transformer."""
    cfg = getattr(transformer, "_cache_config", None)
    if cfg is None:
        return "none", None
    name = type(cfg).__name__
    kind = {"FirstBlockCacheConfig": "first_block_cache", "MagCacheConfig": "mag_cache",
            "TaylorSeerCacheConfig": "taylorseer"}.get(name, name)
    return kind, getattr(cfg, "threshold", None)


def apply_cache(pipe: Any, kind: str, threshold: float | None = None, steps: int = 4,
                stamp: Stamp | None = None) -> None:
    """Set the cache of ``pipe.transformer`` to ``kind`` at ``threshold`` (replacing any other).

    ``steps`` is the step count MagCache interpolates its ratios to.  ``stamp`` (with ranks: the rank
    reporter's ``stamp``) marks the ranks' agreement all-reduce as a collective for the stall signals.
    """
    if kind not in KINDS:
        raise ValueError(f"cache kind {kind!r}: choose one of {', '.join(KINDS)}")
    # Here: the HTTP process imports this module (for KINDS) and must not load diffusers and torch.
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

    tr = pipe.transformer
    active, _ = current(tr)
    if kind == active and kind == "first_block_cache" and threshold is not None:
        hook = _leader(tr, _FBC_LEADER)
        if hook is not None:
            hook.threshold = float(threshold)
            tr._cache_config.threshold = float(threshold)
            return
    if active != "none":
        tr.disable_cache()
    if kind == "none":
        return
    if kind == "first_block_cache":
        tr.enable_cache(FirstBlockCacheConfig(threshold=0.05 if threshold is None else float(threshold)))
        hook = _leader(tr, _FBC_LEADER)
        if hook is not None:
            _LastStepGuard(hook, pipe.scheduler, sync=_world_size() > 1, stamp=stamp).install()
    elif kind == "mag_cache":
        tr.enable_cache(MagCacheConfig(threshold=0.06 if threshold is None else float(threshold),
                                       num_inference_steps=steps, mag_ratios=FLUX_MAG_RATIOS,
                                       retention_ratio=0.2))
    else:
        interval = max(1, int(threshold)) if threshold is not None else 2
        tr.enable_cache(TaylorSeerCacheConfig(cache_interval=interval, disable_cache_before_step=1,
                                              disable_cache_after_step=max(1, steps - 1)))
