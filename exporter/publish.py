"""The publish step: one RequestReport becomes metric observations.

Label children are looked up once per shape (``labels()`` costs more than ``observe()``), and
event counters (OOMs, serving compiles) exist at 0 from a shape's first appearance, so the
first event is an increase that ``rate()`` and ``increase()`` see.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

from stepwatch.exporter.report import RequestReport
from stepwatch.exporter.request import PEAK_STAGES, STAGES
from stepwatch.metrics import ExporterMetrics


def observe_each(hist: Any, amounts: Sequence[float]) -> None:
    """One public observe() per amount: what ``observe_all`` does where prometheus_client's internals are
    not of a tested version (``stepwatch.versions``)."""
    for a in amounts:
        hist.observe(a)


def observe_all(hist: Any, amounts: Sequence[float]) -> None:
    """``hist.observe(a)`` for every amount, with one increment per touched bucket (or of the count, for a
    summary) and one of the sum: prometheus_client's observe() takes a lock per call.  Falls back to
    observe() when the metric does not have prometheus_client's layout."""
    count = getattr(hist, "_count", None)
    if count is not None and not hasattr(hist, "_upper_bounds") and getattr(hist, "_sum", None) is not None:
        if amounts:
            hist._raise_if_not_observable()
            count.inc(len(amounts))
            hist._sum.inc(sum(amounts))
        return
    bounds = getattr(hist, "_upper_bounds", None)
    buckets = getattr(hist, "_buckets", None)
    total = getattr(hist, "_sum", None)
    amount_sum = sum(amounts)
    if (bounds is None or buckets is None or total is None or len(bounds) != len(buckets) or len(amounts) < 2
            or amount_sum != amount_sum):  # a NaN among them (it lands in no bucket): observe() knows how
        for a in amounts:
            hist.observe(a)
        return
    hist._raise_if_not_observable()
    # observe() puts an amount in the first bucket whose bound is >= it, so bucket i holds the amounts
    # <= bounds[i] less those <= bounds[i-1]: counted with one bisect per bound on the sorted amounts,
    # a cost that does not grow with the request's steps.
    ordered = sorted(amounts)
    below = 0
    for i, bound in enumerate(bounds):
        upto = bisect_right(ordered, bound)
        if upto > below:
            buckets[i].inc(upto - below)
            below = upto
            if upto == len(ordered):
                break
    total.inc(amount_sum)


class ShapeChildren:
    """Label children of one shape, looked up once."""

    def __init__(self, m: ExporterMetrics, shape: str) -> None:
        self.ok = m.pipeline_requests_total.labels(shape=shape, outcome="ok")
        self.request = m.pipeline_request_duration_seconds.labels(shape=shape)
        self.stages = {s: m.pipeline_stage_duration_seconds.labels(shape=shape, stage=s) for s in STAGES}
        self.step = m.pipeline_step_duration_seconds.labels(shape=shape)
        self.branches = m.pipeline_cfg_branches.labels(shape=shape)
        self.step_flops = m.ledger_step_flops.labels(shape=shape)
        self.flops = m.ledger_flops_total.labels(shape=shape)
        self._m = m
        self._shape = shape
        self._mfu: Any = None

    @property
    def mfu(self) -> Any:
        """Created on first use: an MFU series at 0 would read as "no useful work", not "unknown"."""
        if self._mfu is None:
            self._mfu = self._m.ledger_mfu_ratio.labels(shape=self._shape)
        return self._mfu


class Publisher:
    """Writes reports into one ExporterMetrics for one device."""

    def __init__(self, metrics: ExporterMetrics, device: str, batched: bool = True) -> None:
        self.metrics = metrics
        self.device = device
        self.observe = observe_all if batched else observe_each  # see stepwatch.versions (batched_observe)
        self.position = metrics.cache_hit_position_ratio
        self.capacity = metrics.memory_capacity_bytes.labels(device=device)
        self.ratio = metrics.memory_peak_ratio.labels(device=device)
        self._children: dict[str, ShapeChildren] = {}
        self._peaks: dict[str, Any] = {}

    def zero_events(self, shape: str) -> None:
        """Event counters of ``shape`` at 0 (for the allowlist: from the start), for the stages where OOMs
        happen; one in ``prepare``/``postprocess`` is born at 1, which the alert's births arm catches."""
        self.metrics.compile_total.labels(shape=shape, phase="serving")
        for stage in STAGES:
            self.metrics.oom_total.labels(shape=shape, stage=stage)

    def children(self, shape: str) -> ShapeChildren:
        c = self._children.get(shape)
        if c is None:
            c = self._children[shape] = ShapeChildren(self.metrics, shape)
            self.zero_events(shape)
        return c

    def publish(self, r: RequestReport) -> None:
        c = self.children(r.shape_label)
        self._timings(r, c)
        if r.cache:
            self._cache(r, r.cache, c)
        for ev in r.compiles:
            self.compile(r.shape_label, ev.phase, ev.seconds)
        self._memory(r)
        if r.step_flops:
            c.step_flops.set(r.step_flops)
            if r.step_seconds:
                c.flops.inc(r.step_flops * len(r.step_seconds))
        if r.mfu is not None:
            c.mfu.set(r.mfu)

    def few_step_hits(self, r: RequestReport) -> None:
        """Cache hits of a few-step (distilled) request: each one is a misconfiguration, counted on its own so
        no baseline is needed to see it."""
        hits = r.hits
        if hits and r.cache:
            self.metrics.cache_few_step_hits_total.labels(shape=r.shape_label, cache=r.cache).inc(hits)

    def compile(self, shape: str, phase: str, seconds: float) -> None:
        self.metrics.compile_total.labels(shape=shape, phase=phase).inc()
        self.metrics.compile_duration_seconds.labels(shape=shape, phase=phase).observe(seconds)

    def _timings(self, r: RequestReport, c: ShapeChildren) -> None:
        if r.outcome == "ok":
            c.ok.inc()
        else:
            self.metrics.pipeline_requests_total.labels(shape=r.shape_label, outcome=r.outcome).inc()
        c.request.observe(r.seconds)
        for stage, sec in r.stages.items():
            c.stages[stage].observe(sec)
        if r.step_seconds:
            self.observe(c.step, r.step_seconds)
            c.branches.set(r.cfg_branches)

    def _cache(self, r: RequestReport, cache: str, c: ShapeChildren) -> None:
        m = self.metrics
        steps = r.shape.steps if r.shape else max(1, len(r.step_seconds))
        positions = [step / steps for step, _branch, hit in r.cache_decisions if hit]  # one pass over the steps
        hits = len(positions)
        misses = len(r.cache_decisions) - hits
        if hits:
            m.cache_decisions_total.labels(shape=r.shape_label, cache=cache, decision="hit").inc(hits)
        if misses:
            m.cache_decisions_total.labels(shape=r.shape_label, cache=cache, decision="miss").inc(misses)
        self.observe(self.position, positions)

    def _memory(self, r: RequestReport) -> None:
        peaks = self._peaks
        for stage in PEAK_STAGES:  # every stage, every request: one it skipped reads 0, not stale
            g = peaks.get(stage)
            if g is None:
                g = peaks[stage] = self.metrics.memory_peak_bytes.labels(device=r.device, stage=stage)
            g.set(r.memory_peak_bytes.get(stage, 0))
        if r.memory_capacity_bytes:
            self.capacity.set(r.memory_capacity_bytes)
            self.ratio.observe(r.memory_peak_bytes.get("request", 0) / r.memory_capacity_bytes)
        if r.outcome == "oom":
            self.metrics.oom_total.labels(shape=r.shape_label, stage=r.failed_stage or "unknown").inc()
