"""Read the decisions of diffusers' cross-step cache hooks, without changing them.

Each cache keeps per-branch state (keyed by the pipeline's ``cache_context``
name, e.g. "cond"/"uncond").  Right after a branch's transformer call the state
says whether that call reused the cache (hit) or recomputed (miss).  We only
read that state; the hook's own decision is the ground truth.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Decision = Callable[[str], "bool | None"]  # branch name -> hit? (None: no decision recorded)

_FBC = "fbc_leader_block_hook"
_MAG = "mag_cache_leader_block_hook"
_TAYLOR = "taylorseer_cache"


def _state(hook: Any, branch: str) -> Any:
    sm = getattr(hook, "state_manager", None)
    cache = getattr(sm, "_state_cache", None)
    if not cache:
        return None
    return cache.get(branch) or (cache.get("inference") if len(cache) == 1 else None)


def _should_compute_reader(hook: Any) -> Decision:
    def decision(branch: str) -> bool | None:
        st = _state(hook, branch)
        if st is None:
            return None
        return not bool(st.should_compute)

    return decision


def _taylor_reader(hook: Any) -> Decision:
    def decision(branch: str) -> bool | None:
        st = _state(hook, branch)
        if st is None or st.current_step < 0:
            return None
        return st.last_update_step != st.current_step

    return decision


_BLOCK_LISTS = ("transformer_blocks", "blocks", "single_transformer_blocks", "layers")


def _candidate_modules(transformer: Any) -> Any:
    """Cache hooks sit on the first block (FBC/MagCache leaders) or inside blocks (TaylorSeer):
    scanning the first block of each block list is enough and costs microseconds on any model."""
    found = False
    for name in _BLOCK_LISTS:
        blocks = getattr(transformer, name, None)
        if blocks is not None and len(blocks):
            found = True
            yield from blocks[0].modules()
    if not found:
        yield from transformer.modules()


class CacheFinder:
    """find_cache, memoized on the transformer's cache config (diffusers sets it on enable/disable)."""

    def __init__(self) -> None:
        self._key: Any = object()
        self._value: tuple[str, Decision] | None = None

    def __call__(self, transformer: Any) -> tuple[str, Decision] | None:
        # Direct dict lookups: nn.Module.__getattr__ is slow and this runs per request.
        cfg = transformer.__dict__.get("_cache_config")
        head = None
        mods = transformer.__dict__.get("_modules", {})
        for name in _BLOCK_LISTS:
            blocks = mods.get(name)
            if blocks is not None and len(blocks):
                head = blocks[0]
                break
        registry = head.__dict__.get("_diffusers_hook") if head is not None else None
        key = (id(transformer), id(cfg), id(registry), len(getattr(registry, "hooks", ()) or ()))
        if key == self._key:
            return self._value
        value = find_cache(transformer)
        self._key, self._value = key, value
        return value


def find_cache(transformer: Any) -> tuple[str, Decision] | None:
    """The cache hook active on this transformer, as (name, decision reader)."""
    if getattr(transformer, "modules", None) is None:
        return None
    for mod in _candidate_modules(transformer):
        registry = getattr(mod, "_diffusers_hook", None)
        hooks = getattr(registry, "hooks", None)
        if not hooks:
            continue
        if _FBC in hooks:
            return "first_block_cache", _should_compute_reader(hooks[_FBC])
        if _MAG in hooks:
            return "mag_cache", _should_compute_reader(hooks[_MAG])
        if _TAYLOR in hooks:
            return "taylorseer", _taylor_reader(hooks[_TAYLOR])
    return None
