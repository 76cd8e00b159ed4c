"""Every drill by name: the seeds' three, the ones beyond them, and the rival faults (fault_injection/rivals.py).

``stepwatch drill`` and the scenario recorder read the drills from here; each drill's alerts, cause and
knob values come from its block in runbooks/drills.md.
"""

from __future__ import annotations

from stepwatch.fault_injection.drills import SEED_FAULTS, Drill
from stepwatch.fault_injection.rivals import RIVALS

DRILLS: dict[str, type[Drill]] = {d.name: d for d in (*SEED_FAULTS, *RIVALS)}
SEED_DRILLS = ("cache-threshold", "off-menu-resolution", "vae-tiling-oom")
ALL_DRILLS = tuple(DRILLS)
RIVAL_DRILLS = tuple(d.name for d in RIVALS)
