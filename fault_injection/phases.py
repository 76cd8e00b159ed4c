"""Where a drill campaign stands: phase k of N and about how long is left.

A campaign is a few stack starts (with their calibration) and the drills on each.  Before the first phase ends
the time left is the sum of typical durations measured on a 2-core host (aot_eager); once phases have run, the
estimate is scaled by how fast this host ran them, so a slower host sees a longer estimate after the first
stack comes up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

# Typical seconds on a 2-core host: a one-rank stack up (service warm-up, quality baseline) and its 70 s
# calibration; a two-rank stack; the practice fleet; one drill with its quiet wait, fault, triage and restore
# (the demo's four: 61-124 s).
STACK_S = {1: 185.0, 2: 200.0}
FLEET_S = 240.0
DRILL_S = 95.0
SPEED_BOUNDS = (0.5, 3.0)  # one odd phase does not swing the whole estimate


@dataclass
class Phases:
    """Announces each phase as ``[k/N] what; about M min left``."""

    planned: list[float]  # estimated seconds of each phase, in order
    say: Callable[[str], None]
    clock: Callable[[], float] = time.monotonic
    k: int = 0
    started: float | None = None
    spent: float = 0.0  # actual seconds of the phases done
    estimated: float = 0.0  # their estimates
    lines: list[str] = field(default_factory=list)

    @classmethod
    def for_groups(cls, groups: list[tuple[int, int]], fleet_drills: int, say: Callable[[str], None],
                   clock: Callable[[], float] = time.monotonic) -> Phases:
        """``groups``: (ranks, drills) per stack, in the order they run; then the fleet's drills, if any."""
        planned: list[float] = []
        for ranks, drills in groups:
            planned += [STACK_S.get(ranks, STACK_S[2])] + [DRILL_S] * drills
        if fleet_drills:
            planned += [FLEET_S] + [DRILL_S] * fleet_drills
        return cls(planned, say, clock)

    def begin(self, what: str) -> None:
        """The next phase starts: close the previous one and say where the campaign stands."""
        now = self.clock()
        if self.started is not None and self.k <= len(self.planned):
            self.spent += now - self.started
            self.estimated += self.planned[self.k - 1]
        self.k += 1
        self.started = now
        line = f"[{self.k}/{len(self.planned)}] {what}; about {self.minutes_left():.0f} min left"
        self.lines.append(line)
        self.say(line)

    def minutes_left(self) -> float:
        """The estimates of this phase and the ones after it, at this host's pace so far."""
        remaining = sum(self.planned[self.k - 1:])
        speed = self.spent / self.estimated if self.estimated else 1.0
        lo, hi = SPEED_BOUNDS
        return max(1.0, remaining * min(hi, max(lo, speed)) / 60)
