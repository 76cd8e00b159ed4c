"""Build prometheus_client collectors from the catalog onto an injectable registry."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import ClassVar, Literal, overload

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, Summary
from prometheus_client.core import CounterMetricFamily, Metric

from stepwatch.catalog import METRICS, MetricDef, Owner
from stepwatch.metric_fields import ExporterFields, ServiceFields, SidecarFields, StreamFields
from stepwatch.metric_fields_gen import attribute, owned

Collector = Counter | Gauge | Histogram | Summary | Info


def collector(m: MetricDef, registry: CollectorRegistry) -> Collector:
    """The prometheus_client collector of catalog entry ``m``, registered on ``registry``."""
    if m.kind == "counter":
        return Counter(m.name, m.help, m.labels, registry=registry)
    if m.kind == "gauge":
        return Gauge(m.name, m.help, m.labels, registry=registry)
    if m.kind == "histogram":
        return Histogram(m.name, m.help, m.labels, registry=registry, buckets=m.buckets)
    if m.kind == "summary":
        return Summary(m.name, m.help, m.labels, registry=registry)
    return Info(m.name, m.help, m.labels, registry=registry)


class MetricSet:
    """The collectors of one owner (exporter, stream, service or sidecar) on one registry.

    Each collector is an attribute named as in the catalog without the ``stepwatch_`` prefix,
    e.g. ``ms.pipeline_step_duration_seconds``.  Use the owner's class (``ExporterMetrics``, ...) or
    ``MetricSet.shared``: their attributes are declared, with their collector types, in the generated
    stepwatch/metric_fields.py, so mypy rejects a misspelled metric or a method its kind lacks.
    """

    OWNER: ClassVar[Owner]

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        for m in owned(self.OWNER):
            setattr(self, attribute(m), collector(m, registry))

    @overload
    @classmethod
    def shared(cls, registry: CollectorRegistry, owner: Literal["exporter"]) -> ExporterMetrics: ...
    @overload
    @classmethod
    def shared(cls, registry: CollectorRegistry, owner: Literal["stream"]) -> StreamMetrics: ...
    @overload
    @classmethod
    def shared(cls, registry: CollectorRegistry, owner: Literal["service"]) -> ServiceMetrics: ...
    @overload
    @classmethod
    def shared(cls, registry: CollectorRegistry, owner: Literal["sidecar"]) -> SidecarMetrics: ...
    @classmethod
    def shared(cls, registry: CollectorRegistry, owner: Owner) -> MetricSet:
        """One set per (registry, owner): instrumenting again, or a second pipeline, reuses the collectors
        (prometheus_client refuses to register a name twice)."""
        # Kept on the registry itself: a weak-keyed map whose values (the collectors) hold the registry
        # kept every registry alive (bench overhead's crossover leaked one per swap).
        per_owner: dict[str, MetricSet] = registry.__dict__.setdefault("_stepwatch_metric_sets", {})
        ms = per_owner.get(owner)
        if ms is None:
            ms = per_owner[owner] = BY_OWNER[owner](registry)
        return ms


class ExporterMetrics(MetricSet, ExporterFields):
    """The in-process exporter's collectors."""

    OWNER = "exporter"


class StreamMetrics(MetricSet, StreamFields):
    """The exporter's chunked-video collectors, registered only where such a pipeline is instrumented."""

    OWNER = "stream"


class ServiceMetrics(MetricSet, ServiceFields):
    """The practice service's collectors."""

    OWNER = "service"


class SidecarMetrics(MetricSet, SidecarFields):
    """The sidecar's collectors (the prober's quality series and the NVML ones)."""

    OWNER = "sidecar"


BY_OWNER: dict[Owner, type[MetricSet]] = {
    "exporter": ExporterMetrics, "stream": StreamMetrics, "service": ServiceMetrics, "sidecar": SidecarMetrics,
}


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
