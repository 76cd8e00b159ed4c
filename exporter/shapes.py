"""Shape keys: what fixes a request's cost at admission (H, W, frames, steps, CFG).

Label values are bounded: only shapes on the serving allowlist (or, with no
allowlist, the first ``max_shapes`` seen) become labels; the rest fold into
``other``.  Format: ``{W}x{H}[x{F}]_{steps}s[_cfg]``, width first like the API's ``size`` (OpenAI's
``1024x768`` is 1024 wide), so an alert's label reads as the request that caused it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass

OTHER = "other"
_SHAPE_RE = re.compile(r"^(\d+)x(\d+)(?:x(\d+))?_(\d+)s(_cfg)?$")


@dataclass(frozen=True)
class ShapeKey:
    height: int
    width: int
    steps: int
    cfg: bool
    frames: int | None = None

    def __str__(self) -> str:
        f = f"x{self.frames}" if self.frames else ""
        return f"{self.width}x{self.height}{f}_{self.steps}s" + ("_cfg" if self.cfg else "")

    def few_step(self, max_steps: int) -> bool:
        """A distilled model's request: at most ``max_steps`` steps and no CFG (thresholds' ``few_step``).

        A cross-step cache must never hit on one: with so few steps every step moves the latent a long way."""
        return not self.cfg and self.steps <= max_steps

    @classmethod
    def parse(cls, text: str) -> ShapeKey:
        m = _SHAPE_RE.match(text.strip())
        if not m:
            raise ValueError(f"bad shape key {text!r}: expected WxH[xF]_<steps>s[_cfg] (width first), "
                             "e.g. 1024x768_4s or 128x128x9_4s_cfg")
        w, h, f, s, cfg = m.groups()
        return cls(int(h), int(w), int(s), cfg is not None, int(f) if f else None)


class ShapeLabeler:
    """Maps shape keys to bounded label values."""

    def __init__(self, allowlist: Iterable[str] | None = None, max_shapes: int = 16) -> None:
        self._fixed = allowlist is not None
        self._allowed: set[str] = {str(ShapeKey.parse(s)) for s in allowlist} if allowlist is not None else set()
        self._max = max_shapes
        self._lock = threading.Lock()

    def label(self, key: ShapeKey | None) -> str:
        if key is None:
            return OTHER
        s = str(key)
        if s in self._allowed:
            return s
        if self._fixed:
            return OTHER
        with self._lock:
            if len(self._allowed) < self._max:
                self._allowed.add(s)
                return s
        return OTHER

    @property
    def known(self) -> frozenset[str]:
        return frozenset(self._allowed)
