"""What one scrape costs at fleet cardinality (``stepwatch bench exposition``).

A fleet scrapes every pod every 5-15 s, so the series one pod exposes, and the time its
``/metrics`` takes to render, set the cost of the whole monitoring system.  The service
case builds what a busy practice-service pod exposes: the service's own metrics (every
pool of the default config, with requests and queue waits observed) and the in-process
exporter's, from an instrumented stub pipeline (FirstBlockCache, 2 CFG branches) that
served ``shapes`` allowlisted shapes three times each, compiled each one at warm-up, has
a baseline for each, and gathered ``ranks`` ranks per request.  Only rank 0 serves
``/metrics`` (the other ranks send it their numbers once per request), so ranks add
only the per-rank series.  The sidecar case is the NVML collector over 8 GPUs (a table
provider: the hardware this machine lacks) plus one probe set's quality metrics.

A render is what the ``/metrics`` handlers do: ``stepwatch.exposition.Renderer`` of each
registry (the service's and the worker's exporter's; in the service the latter arrives over
one loopback HTTP request, not counted here); the first, which fills its caches, is untimed.
``_created`` series are off, as in the service.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, disable_created_metrics

from stepwatch.bench.overhead import StubPipeline
from stepwatch.catalog import METRICS
from stepwatch.exporter import instrument
from stepwatch.exporter.rank_align import publish_ranks
from stepwatch.exporter.ranks import PerRequestReporter
from stepwatch.exporter.sidecar.nvml import NvmlCollector
from stepwatch.exporter.sidecar.prober import quality_metrics
from stepwatch.exposition import Renderer

RENDERS = 50
SERVICE_CASES = ((1, 1), (16, 1), (50, 1), (1, 8), (16, 8), (50, 8))
SIDECAR_GPUS = 8
REQUESTS_PER_SHAPE = 3
GIB = 1024**3


class _FakeRanks(PerRequestReporter):
    """Rank 0's publication of ``world`` ranks without a process group: rank r works (1 + r/100) as long."""

    def __init__(self, world: int) -> None:
        self.world = world

    def report(self, report: Any, _request: int) -> None:
        steps, m = len(report.step_seconds), self.metrics
        assert m is not None, "instrument() binds the reporter before the first request"
        if not steps:
            return
        per_step = [sum(report.step_seconds) / steps * (1 + r / 100) for r in range(self.world)]
        publish_ranks(per_step, m)
        for r, busy in enumerate(per_step):
            m.rank_busy_seconds_total.labels(rank=str(r)).inc(busy * steps)
            m.rank_steps_total.labels(rank=str(r)).inc(steps)
            m.rank_cpu_wait_seconds_total.labels(rank=str(r)).inc(0)
            m.rank_progress_age_seconds.labels(rank=str(r)).set(0)
            m.rank_collective_wait_seconds.labels(rank=str(r)).set(0)


def _shapes(n: int) -> list[tuple[int, int]]:
    """``n`` distinct (height, width), multiples of 64 like a serving allowlist."""
    return [(256 + 64 * (i // 10), 256 + 64 * (i % 10)) for i in range(n)]


def _exporter_registry(shapes: int, ranks: int, steps: int = 8) -> CollectorRegistry:
    registry = CollectorRegistry()
    sizes = _shapes(shapes)
    keys = [f"{w}x{h}_{steps}s_cfg" for h, w in sizes]  # the stub runs 2 CFG branches
    pipe = StubPipeline(branches=2, cache=True)
    inst = instrument(pipe, registry=registry, shapes=keys, max_shapes=len(keys),
                      rank_reporter=_FakeRanks(ranks) if ranks > 1 else None,
                      baselines={k: {"step_seconds": 0.5, "cache_hit_ratio": 0.4} for k in keys})
    for key, (h, w) in zip(keys, sizes, strict=True):
        inst.publisher.compile(key, "warmup", 30.0)
        for _ in range(REQUESTS_PER_SHAPE):
            pipe("w1 w2", height=h, width=w, num_inference_steps=steps)
    for key in keys:  # a request labelled "other" would make the case cheaper than it claims
        if registry.get_sample_value("stepwatch_pipeline_requests_total", {"shape": key, "outcome": "ok"}) \
                != REQUESTS_PER_SHAPE:
            raise RuntimeError(f"bench exposition: the requests of {key} were not labelled with their shape")
    return registry


def _service_registry() -> CollectorRegistry:
    from stepwatch.service import config  # the service's config and metric set, not started
    from stepwatch.service.engine import Service

    service = Service(config.load())
    for pool in service.cfg.all_pools():
        service.m.service_requests_total.labels(pool=pool.name, code="200").inc(REQUESTS_PER_SHAPE)
        service.m.service_request_duration_seconds.labels(pool=pool.name).observe(2.0)
        service.m.queue_wait_seconds.labels(pool=pool.name).observe(0.1)
    service.m.service_ready.set(1)
    # The config info and the knob-override gauges, as a running service publishes them once its worker is ready.
    service.knobs = {"cache": "first_block_cache", "cache_threshold": 0.7, "vae_tiling": True, "compile": True}
    service.started_knobs = dict(service.knobs)
    service.publish_config()
    return service.registry


class _TableNvml:
    """The NVML provider interface answered from constants: ``gpus`` idle H100-like devices."""

    def __init__(self, gpus: int) -> None:
        self.gpus = gpus

    def init(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def device_count(self) -> int:
        return self.gpus

    def memory(self, index: int) -> tuple[int, int]:
        return 20 * GIB, 80 * GIB

    def utilization_percent(self, index: int) -> float:
        return 97.0

    def sm_clock_mhz(self, index: int) -> float:
        return 1980.0

    def temperature_celsius(self, index: int) -> float:
        return 61.0

    def power_milliwatts(self, index: int) -> float:
        return 540_000.0

    def throttle_reasons(self, index: int) -> int:
        return 0

    def xid_errors(self, index: int) -> int | None:
        return 0


# Label values of one probe set's quality series; a label not named here gets "x".
_QUALITY_VALUES = {"probe_set": ("default",), "instance_id": ("practice:8000",), "stat": ("p50", "p10", "min"),
                   "reason": ("connect", "timeout", "bad_response", "baseline")}


def _label_sets(labels: tuple[str, ...]) -> Iterator[dict[str, str]]:
    sets: list[dict[str, str]] = [{}]
    for name in labels:
        sets = [s | {name: v} for s in sets for v in _QUALITY_VALUES.get(name, ("x",))]
    yield from sets


def _sidecar_registry(gpus: int) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(NvmlCollector(_TableNvml(gpus)))
    quality = quality_metrics(registry)
    for m in METRICS:
        if m.owner != "sidecar" or not m.name.startswith("stepwatch_quality_"):
            continue
        metric = getattr(quality, m.name.removeprefix("stepwatch_"))
        for labels in _label_sets(m.labels):
            child = metric.labels(**labels) if labels else metric
            (child.observe if m.kind == "histogram" else child.inc if m.kind == "counter" else child.set)(1.0)
    return registry


def measure(render: Callable[[], bytes], renders: int = RENDERS) -> dict[str, Any]:
    """Series (sample lines), bytes, and the median and p99 time of ``renders`` renders."""
    text = render()
    times = []
    for _ in range(renders):
        t0 = time.perf_counter()
        render()
        times.append(time.perf_counter() - t0)
    times.sort()
    series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
    return {"series": series, "bytes": len(text), "render_ms_median": round(statistics.median(times) * 1e3, 2),
            "render_ms_p99": round(times[min(len(times) - 1, int(0.99 * len(times)))] * 1e3, 2)}


def service_case(shapes: int, ranks: int, renders: int = RENDERS) -> dict[str, Any]:
    service, exporter = Renderer(_service_registry()), Renderer(_exporter_registry(shapes, ranks))
    out = measure(lambda: service.render() + exporter.render(), renders)
    return {"target": "service", "shapes": shapes, "ranks": ranks} | out


def sidecar_case(gpus: int = SIDECAR_GPUS, renders: int = RENDERS) -> dict[str, Any]:
    renderer = Renderer(_sidecar_registry(gpus))
    return {"target": "sidecar", "shapes": 0, "ranks": 0, "gpus": gpus} | measure(renderer.render, renders)


def run_all(service_cases: tuple[tuple[int, int], ...] = SERVICE_CASES, renders: int = RENDERS,
            progress: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    disable_created_metrics()  # process-wide, as the service and the sidecar run
    cases = []
    for shapes, ranks in service_cases:
        cases.append(service_case(shapes, ranks, renders))
        if progress:
            progress(cases[-1])
    cases.append(sidecar_case(renders=renders))
    if progress:
        progress(cases[-1])
    return cases
