"""Per-shape cache thresholds (config ``shape_cache``): the working points ``stepwatch sweep`` measured.

The seeds store a lossy option's working point per model x shape x steps, since one threshold hits at
another rate at 50 steps than at 20 and leaves other artifacts at 2048^2 than at 512^2.  So the config may
give a serving shape its own first-block-cache threshold; every other shape runs at ``cache.threshold``.

Decisions, written down here because the config's reader has no one to ask:
- **Thresholds only, and only for ``first_block_cache``.**  Its threshold is edited in place between
  requests (``service/cache.py``): the compiled blocks are untouched, so no recompile.  Another kind's
  hooks would be rebuilt per request (and recompile a compiled service), so a kind per shape is refused.
- **A runtime knob wins.**  While the cache knobs hold the config's start-up values the shapes get their
  own thresholds; once someone sets ``cache`` or ``cache_threshold`` (an incident's mitigation, a drill's
  fault) that value applies to every shape, until the knobs are set back to the start-up values.
- **Keys are serving shapes** (the exporter's label allowlist): a key no request can carry is a typo.
"""

from __future__ import annotations

import math
from typing import Any


class ShapeCacheError(ValueError):
    """A bad ``shape_cache`` entry; str() names the key."""


def check(shape_cache: Any, cache_kind: str, serving: list[str]) -> dict[str, float]:
    """The validated table {shape label: threshold}; raises ShapeCacheError naming the bad key."""
    if shape_cache is None:
        return {}
    if not isinstance(shape_cache, dict):
        raise ShapeCacheError("shape_cache: expected a mapping of serving shape -> {threshold: number}")
    if shape_cache and cache_kind != "first_block_cache":
        raise ShapeCacheError(f"shape_cache: per-shape thresholds need cache.kind first_block_cache (it is "
                              f"{cache_kind}): only its threshold changes between requests without rebuilding "
                              "the cache hooks")
    out: dict[str, float] = {}
    for label, entry in shape_cache.items():
        key = f"shape_cache.{label}"
        if str(label) not in serving:
            raise ShapeCacheError(f"{key}: not a serving shape (known: {', '.join(serving)})")
        if not isinstance(entry, dict) or set(entry) != {"threshold"}:
            raise ShapeCacheError(f"{key}: expected {{threshold: number}}, got {entry!r}")
        t = entry["threshold"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf:
            raise ShapeCacheError(f"{key}.threshold: {t!r} must be a finite number >= 0")
        out[str(label)] = float(t)
    return out


def threshold_for(label: str, table: dict[str, float], knobs: dict[str, Any], startup: tuple[str, float],
                  ) -> float | None:
    """The first-block-cache threshold a request of ``label`` runs at; None: no cache to set."""
    kind, threshold = knobs.get("cache"), knobs.get("cache_threshold")
    if kind != "first_block_cache":
        return None
    if (kind, threshold) == startup and label in table:
        return table[label]
    return None if threshold is None else float(threshold)
