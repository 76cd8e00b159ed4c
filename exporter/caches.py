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


class Reader:
    """A cache's decision reader.  Called with a branch name it reads the decision now (``Decision``);
    ``take()`` copies every branch's raw state in one cheap pass (the per-step hot path), and
    ``decide(raw)`` turns one branch's copy into the decision later, off the hot path."""

    __slots__ = ("_hook", "_states")

    def __init__(self, hook: Any) -> None:
        self._hook = hook
        self._states: dict[str, Any] | None = None  # the state manager's dict: diffusers keeps the same one

    def states(self) -> dict[str, Any]:
        states = self._states
        if states is None:
            states = getattr(getattr(self._hook, "state_manager", None), "_state_cache", None)
            if not isinstance(states, dict):
                return {}
            self._states = states
        return states

    def take(self) -> dict[str, Any]:
        # The attribute read inline (not through _raw), the states dict held: this runs once per step, on
        # the thread that alone changes that dict (the pipeline's).  A loop, not a comprehension: on
        # Python 3.11 a comprehension is a function call of its own (~150 ns of ~450 for two branches).
        states = self._states
        if states is None:
            states = self.states()
        out = {}
        for name, st in states.items():
            out[name] = st.should_compute
        return out

    @staticmethod
    def _raw(st: Any) -> Any:
        return st.should_compute

    @staticmethod
    def decide(raw: Any) -> bool | None:
        return not bool(raw)

    def __call__(self, branch: str) -> bool | None:
        st = _state(self._hook, branch)
        return None if st is None else self.decide(self._raw(st))


class TaylorReader(Reader):
    """TaylorSeer: a hit is a step that reused the last full computation."""

    __slots__ = ()

    def take(self) -> dict[str, Any]:
        states = self._states
        if states is None:
            states = self.states()
        out = {}
        for name, st in states.items():
            out[name] = (st.current_step, st.last_update_step)
        return out

    @staticmethod
    def _raw(st: Any) -> Any:
        return st.current_step, st.last_update_step

    @staticmethod
    def decide(raw: Any) -> bool | None:
        current, last_update = raw
        return None if current < 0 else last_update != current


def branch_raw(snapshot: dict[str, Any], branch: str) -> Any:
    """A branch's entry in a ``take()`` snapshot, with ``_state``'s single-"inference"-state fallback;
    None when the cache kept no state for it."""
    raw = snapshot.get(branch)
    if raw is None and len(snapshot) == 1:
        raw = snapshot.get("inference")
    return raw


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


def no_cache(transformer: Any) -> None:
    """The finder where the version gate turned cache decisions off (stepwatch.versions): no cache is read."""
    return None


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
            return "first_block_cache", Reader(hooks[_FBC])
        if _MAG in hooks:
            return "mag_cache", Reader(hooks[_MAG])
        if _TAYLOR in hooks:
            return "taylorseer", TaylorReader(hooks[_TAYLOR])
    return None
