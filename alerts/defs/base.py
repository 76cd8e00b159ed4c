"""What an alert definition is, and the pieces its promtool scenarios are built from.

An :class:`AlertDef` holds everything about one alert that is code rather than numbers
or prose (those stay in stepwatch/thresholds.yaml): how its PromQL is built, the labels its
series carry, whether it reads the profile's rate window, its promtool scenarios, and the
triage causes it is the real story of.  The modules next to this one hold one AlertDef
per alert, grouped by subsystem.

A scenario (:class:`Case`) is stated relative to the thresholds and ``for:`` of its
profile (:class:`Timing`): one series just over the threshold fires with its exact
labels, one just under never does, and one evaluation before ``for:`` elapses nothing
fires yet.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from stepwatch.alerts.promql import num
from stepwatch.thresholds import AlertSpec, Thresholds, ThresholdsError, parse_duration

# Jobs and instances the scenarios' series come from.
SVC, SIDECAR = "stepwatch-service", "stepwatch-sidecar"
I1, I2, I3, SC = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.1:9465"


@dataclass
class Series:
    name: str
    labels: dict[str, str]
    values: str

    def text(self) -> str:
        return self.name + "{" + ", ".join(f'{k}="{v}"' for k, v in self.labels.items()) + "}"


@dataclass
class Expect:
    at: int  # seconds
    firing: list[tuple[dict[str, str], float]] = field(default_factory=list)  # (series labels, $value)
    why: str = ""


@dataclass
class Case:
    key: str
    title: str
    series: list[Series]
    expects: list[Expect]


class Timing:
    """Times of one profile for one alert, in seconds, and sample-count helpers.

    ``s``/``e`` scrape and evaluation interval, ``F`` the alert's ``for:``, ``W`` the
    profile's rate window, ``Wa`` the alert's own window (or ``W``), ``T`` its threshold.
    """

    def __init__(self, th: Thresholds, spec: AlertSpec, profile: str) -> None:
        p = th.profiles[profile]
        self.th, self.spec, self.profile = th, spec, profile
        self.s = int(parse_duration(p.scrape_interval))
        self.e = int(parse_duration(p.evaluation_interval))
        if self.s != self.e:
            raise ValueError(f"profiles.{profile}: the generated tests assume scrape == evaluation interval")
        self.F = int(spec.for_seconds(profile))
        self.W = int(parse_duration(p.rate_window))
        self.Wa = int(parse_duration(spec.window[profile])) if profile in spec.window else self.W
        self.T = spec.threshold

    def align(self, t: float) -> int:
        return int(math.ceil(t / self.s) * self.s)

    def n(self, end: int) -> int:
        """Samples (after the first) so a series covers ``end`` plus margin."""
        return end // self.s + 2


ExprBuilder = Callable[[Thresholds, AlertSpec, str], str]
CaseBuilder = Callable[[Timing], list[Case]]


@dataclass(frozen=True)
class AlertDef:
    """One alert as code; its numbers and text are the thresholds.yaml block of the same key.

    ``labels``: the labels its series carry besides ``job`` (the runbook checks' placeholders
    and the description templates may use only these).  ``rate_based``: it reads the
    profile's rate window (the others read gauges, or count events over their own window).
    ``explains``: runbook causes that name this alert as the real story, so triage files an
    incident with that cause under this alert's incident ("most errors are OOMs" -> the OOM one).
    """

    key: str
    expr: ExprBuilder
    labels: tuple[str, ...]
    cases: CaseBuilder
    rate_based: bool = False
    explains: tuple[str, ...] = ()


# ----- expression helpers ---------------------------------------------------------------------

def rate_window(th: Thresholds, profile: str) -> str:
    return th.profiles[profile].rate_window


def need_window(spec: AlertSpec, profile: str) -> str:
    """The alert's own window (event-counting alerts), or a clear error naming the key."""
    if profile not in spec.window:
        raise ThresholdsError(f"alerts.{spec.key}.window: missing (this alert counts events over a window)")
    return spec.window[profile]


# ----- series values (promtool's expanding notation) ------------------------------------------

def ramp(step: float, n: int, start: float = 0) -> str:
    return f"{num(start)}+{num(step)}x{n}"


def const(v: float, n: int) -> str:
    return f"{num(v)}x{n}"


def jump(v0: float, at_index: int, v1: float, n: int) -> str:
    """v0 at samples 0..at_index-1, v1 from at_index on (n+1 samples in all)."""
    return f"{num(v0)}x{at_index - 1} {num(v1)}x{n - at_index}"


def born(at_index: int, v: float, n: int) -> str:
    """No sample before at_index, then v."""
    return f"_x{at_index} {num(v)}x{n - at_index}"


def gap(v: float, at_index: int, back_index: int, n: int) -> str:
    """v, then a staleness marker at at_index and no sample until back_index, then v again (n+1 samples)."""
    return f"{num(v)}x{at_index - 1} stale _x{back_index - at_index - 1} {num(v)}x{n - back_index}"


def up(n: int, *instances: tuple[str, str]) -> list[Series]:
    return [Series("up", {"job": j, "instance": i}, const(1, n)) for j, i in instances]


def pending(p: Timing) -> Expect:
    """Nothing fires one evaluation before ``for:`` elapses (at 0 when ``for:`` is 0)."""
    return Expect(p.F - p.e, [], "for: not elapsed") if p.F else Expect(0, [], "pending")


def events_case(p: Timing, metric: str, old: dict[str, str], new: dict[str, str], inc: dict[str, str],
                quiet: list[Series] | None = None) -> Case:
    """An event alert: old constant since start; new born at 1 at t_b; inc 1 -> 2 at t_c.

    Checks that a restarted Prometheus stays quiet, that a counter born at 1 fires, that an
    increasing one fires, and that both clear a window later.
    """
    kb = p.align(p.Wa + 2 * p.s) // p.s
    kc = kb + p.align(p.Wa + 2 * p.s) // p.s
    tb, tc = kb * p.s, kc * p.s
    # A counter missing from a window of scrapes (a frozen worker's metrics) and back at the same value.
    ka = (tc + p.Wa + p.e) // p.s + 1
    kr = ka + p.Wa // p.s + 1
    n = p.n(kr * p.s + p.Wa + 2 * p.s)
    base, other = {"job": SVC, "instance": I1}, {"job": SVC, "instance": I2}
    series = up(n, (SVC, I1), (SVC, I2)) + [
        Series(metric, {**base, **old}, const(2, n)),
        Series(metric, {**base, **new}, born(kb, 1, n)),
        Series(metric, {**base, **inc}, jump(1, kc, 2, n)),
        Series(metric, {**other, **old}, gap(1, ka, kr, n)),
    ] + (quiet or [])
    return Case(p.spec.key, "old counter quiet after a Prometheus restart; a new label set born at 1 fires; an "
                "increase fires; both clear a window later; a counter back after a gap is not new", series, [
                    Expect(p.e, [], "restarted Prometheus: no history, old counters are not new"),
                    Expect(tb - p.e, [], "before the event"),
                    Expect(tb, [({**base, **new}, 1.0)], "born at 1"),
                    Expect(tc, [({**base, **inc}, 1.0)], "increased"),
                    Expect(tc + p.Wa + p.e, [], "a window later"),
                    Expect(kr * p.s, [], "back after a window without samples: not a new counter"),
                    Expect(kr * p.s + p.e, [], "still not"),
                ])
