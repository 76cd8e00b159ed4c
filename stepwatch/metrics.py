"""Build prometheus_client collectors from the catalog onto an injectable registry."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, Summary
from prometheus_client.core import CounterMetricFamily, Metric

from stepwatch.catalog import METRICS, MetricDef, Owner


class MetricSet:
    """The collectors of one owner (exporter, service or sidecar) on one registry.

    Attribute access uses the catalog name without the ``stepwatch_`` prefix,
    e.g. ``ms.pipeline_step_duration_seconds``.
    """

    def __init__(self, registry: CollectorRegistry, owner: Owner) -> None:
        self.registry = registry
        self._by_name: dict[str, Any] = {}
        for m in METRICS:
            if m.owner != owner or m.scraped:
                continue
            c: Any
            if m.kind == "counter":
                c = Counter(m.name, m.help, m.labels, registry=registry)
            elif m.kind == "gauge":
                c = Gauge(m.name, m.help, m.labels, registry=registry)
            elif m.kind == "histogram":
                c = Histogram(m.name, m.help, m.labels, registry=registry, buckets=m.buckets)
            elif m.kind == "summary":
                c = Summary(m.name, m.help, m.labels, registry=registry)
            else:
                c = Info(m.name, m.help, m.labels, registry=registry)
            self._by_name[m.name.removeprefix("stepwatch_")] = c

    @classmethod
    def shared(cls, registry: CollectorRegistry, owner: Owner) -> MetricSet:
        """One set per (registry, owner): instrumenting again, or a second pipeline, reuses the collectors
        (prometheus_client refuses to register a name twice)."""
        # Kept on the registry itself: a weak-keyed map whose values (the collectors) hold the registry
        # kept every registry alive (bench overhead's crossover leaked one per swap).
        per_owner: dict[str, MetricSet] = registry.__dict__.setdefault("_stepwatch_metric_sets", {})
        ms = per_owner.get(owner)
        if ms is None:
            ms = per_owner[owner] = cls(registry, owner)
        return ms

    def __getattr__(self, key: str) -> Any:
        try:
            return self._by_name[key]
        except KeyError:
            raise AttributeError(key) from None


class ScrapeCounter:
    """A catalog counter read from its source at each scrape (``scraped=True``): a kernel counter such as
    schedstat needs no increments, so nothing is lost between scrapes and costs nothing between them.  A
    source that answers None (no /proc) leaves the series out.  Registered once per registry."""

    def __init__(self, name: str, read: Callable[[], float | None], registry: CollectorRegistry) -> None:
        self.defn: MetricDef = next(m for m in METRICS if m.name == name)
        if not self.defn.scraped or self.defn.kind != "counter" or self.defn.labels:
            raise ValueError(f"{name} is not an unlabelled scraped counter in the catalog")
        self._read = read
        if name not in getattr(registry, "_names_to_collectors", {}):  # a second instrument() on the registry
            registry.register(self)

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.defn.name.removesuffix("_total"), self.defn.help)

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        value = self._read()
        if value is None:
            return
        family = self._family()
        family.add_metric([], value)
        yield family
