"""Every drill by name: the seeds' three (fault_injection/seed_drills.py), the ones beyond them on the worker's
capacity and ranks (fault_injection/worker_drills.py), the rival faults (fault_injection/rivals.py), the video and
few-step ones (fault_injection/video_drills.py), the streaming ones (fault_injection/stream_drills.py),
the fleet ones (fault_injection/fleet_drills.py), the day-two ones (fault_injection/day_two.py).

``stepwatch drill`` and the scenario recorder read the drills from here; each drill's alerts, cause and
knob values come from its block in runbooks/drills.md.
"""

from __future__ import annotations

from stepwatch.fault_injection.day_two import DAY_TWO_DRILLS
from stepwatch.fault_injection.drill import Drill
from stepwatch.fault_injection.fleet_drills import FLEET_DRILLS
from stepwatch.fault_injection.rivals import RIVALS
from stepwatch.fault_injection.seed_drills import CacheThreshold, OffMenuResolution, VaeTilingOom
from stepwatch.fault_injection.stream_drills import STREAM_DRILLS
from stepwatch.fault_injection.video_drills import VIDEO_DRILLS
from stepwatch.fault_injection.worker_drills import QueueOverload, Straggler, StragglerNeighbour, WorkerStall

SEED_FAULTS: tuple[type[Drill], ...] = (CacheThreshold, OffMenuResolution, VaeTilingOom, QueueOverload, Straggler,
                                        StragglerNeighbour, WorkerStall)
# The rivals last: gpu-throttle must be the last drill on its stack (its throttle stays in the look-back).
DRILLS: dict[str, type[Drill]] = {d.name: d for d in (*SEED_FAULTS, *VIDEO_DRILLS, *STREAM_DRILLS, *FLEET_DRILLS,
                                                     *DAY_TWO_DRILLS, *RIVALS)}
SEED_DRILLS = ("cache-threshold", "off-menu-resolution", "vae-tiling-oom")
# ``stepwatch demo``: the seeds' three and one rival that fires an alert cache-threshold also fires
# (CacheHitRateShift), with another cause: triage must tell the two apart.
DEMO_DRILLS = (*SEED_DRILLS, "prompt-mix-shift")
# Run by name only: on 2 CPU cores the request computes ~90 s before it runs out of memory (four 2048^2
# images), past the 60 s goal; its recording is still a triage case (a GPU fails it in seconds).  compile-off:
# on the 2-core stack, compiled kernels wait for the CPU beside Prometheus, the prober and the clients, so
# eager steps read only 1.1-1.4x of them: detected after 71 s (compile-off-18), or not at all in 4 minutes.
BY_NAME_ONLY = ("shape-too-large", "compile-off")
ALL_DRILLS = tuple(n for n in DRILLS if n not in BY_NAME_ONLY)
RIVAL_DRILLS = tuple(d.name for d in RIVALS if d.name not in BY_NAME_ONLY)
FLEET_DRILL_NAMES = tuple(d.name for d in FLEET_DRILLS)  # on the practice fleet (campaign: one fleet start)
