"""The named patch registry: every attribute stepwatch replaces, by name, and how to put it back.

As diffusers' ``HookRegistry`` names its hooks, every patch here has a name (the constants
below), so instrumenting twice is a no-op and removal restores the exact original objects,
whether the attribute lived on the instance (set it back) or was found on its class (delete
the instance's shadow so lookup reaches the class again).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# Hook names: "<component>.<attribute>", the component being the pipeline's attribute that holds it.
CALL = "pipeline.__call__"  # the instance's class, swapped for a subclass (__call__ is looked up on the type)
ENCODE_PROMPT = "encode_prompt"
SET_TIMESTEPS = "scheduler.set_timesteps"
STEP = "scheduler.step"
VAE_DECODE = "vae.decode"
ENCODE_KV_CACHE = "encode_kv_cache"  # chunked autoregressive video only (exporter/chunks.py)
DENOISERS = ("transformer", "transformer_2", "unet")
DENOISER_CALL = "transformer.__call__"  # the guard's name for the per-call record (hooks.denoiser_class)
# The pipeline attributes whose objects carry patches; a patch on one of them follows that object.
COMPONENTS = ("scheduler", *DENOISERS, "vae")


def cache_context(component: str) -> str:
    """The hook name of a denoiser's ``cache_context`` (one per CFG branch)."""
    return f"{component}.cache_context"


def denoiser_call(component: str) -> str:
    """The hook name of a denoiser's call record: its class swapped, or its compiled call wrapped."""
    return f"{component}.__call__"


def component_of(name: str) -> str | None:
    """The pipeline attribute a hook name patches, or None for patches on the pipeline itself."""
    comp = name.split(".", 1)[0]
    return comp if comp in COMPONENTS else None


_MISSING = object()


@dataclass(frozen=True)
class Patch:
    obj: Any
    attr: str
    original: Any
    restore_by_set: bool  # the object owned the value (or it is a data descriptor like __class__)
    added: bool = False  # the attribute did not exist: removal deletes it


def _restore_by_set(obj: Any, attr: str) -> bool:
    if attr in getattr(obj, "__dict__", {}):
        return True
    for klass in type(obj).__mro__:
        if attr in klass.__dict__:
            return hasattr(klass.__dict__[attr], "__set__")
    return False


class PatchRegistry:
    """Named, reversible attribute patches.  Removal errors go to ``on_error`` and never raise."""

    def __init__(self, on_error: Callable[[str, BaseException], None] | None = None) -> None:
        self._patches: dict[str, Patch] = {}
        self._on_error = on_error

    def __contains__(self, name: str) -> bool:
        return name in self._patches

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._patches))

    def __len__(self) -> int:
        return len(self._patches)

    def target(self, name: str) -> Any:
        """The object the named patch sits on (KeyError when there is none)."""
        return self._patches[name].obj

    def holds(self, name: str, obj: Any) -> bool:
        """True when ``name`` is registered on this very object."""
        p = self._patches.get(name)
        return p is not None and p.obj is obj

    def register(self, name: str, obj: Any, attr: str, replacement: Any) -> bool:
        """Set ``obj.attr = replacement`` under ``name``; False (and nothing done) when already registered
        on this object.  Registered on another object (a swapped component), the old patch is removed first.
        An attribute the object did not have is deleted again on removal."""
        if self.holds(name, obj):
            return False
        if name in self._patches:
            self.remove(name)
        original = getattr(obj, attr, _MISSING)
        added = original is _MISSING
        self._patches[name] = Patch(obj, attr, original, not added and _restore_by_set(obj, attr), added)
        try:
            setattr(obj, attr, replacement)
        except BaseException:
            del self._patches[name]
            raise
        return True

    def wrap(self, name: str, obj: Any, attr: str, wrapper: Callable[[Any], Any]) -> bool:
        """register() with ``wrapper(original)``, built only when the patch is not in place yet."""
        if self.holds(name, obj):
            return False
        return self.register(name, obj, attr, wrapper(getattr(obj, attr)))

    def remove(self, name: str) -> bool:
        """Put the original back; False when ``name`` was not registered."""
        p = self._patches.pop(name, None)
        if p is None:
            return False
        try:
            if p.restore_by_set:
                setattr(p.obj, p.attr, p.original)
            else:
                delattr(p.obj, p.attr)
        except Exception as e:
            if self._on_error is not None:
                self._on_error(f"unpatch.{name}", e)
        return True

    def remove_all(self) -> None:
        """Undo every patch, newest first."""
        for name in reversed(list(self._patches)):
            self.remove(name)
