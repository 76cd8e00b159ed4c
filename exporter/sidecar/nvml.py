"""GPU readings from NVML, exported at scrape time.

Memory, clocks, temperature and throttling come from the driver, not from the
inference process, so a sidecar reads them.  The provider interface is narrow
(what NVML returns, in NVML's units) so that tests drive the collector with a
fake; the collector converts to base units and never raises at scrape time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stepwatch.catalog import BY_NAME

log = logging.getLogger("stepwatch.sidecar.nvml")

# NVML clock event ("throttle") reason bits -> the bounded `reason` label vocabulary.
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)
_KNOWN_BITS = 0
for _bit, _ in THROTTLE_REASONS:
    _KNOWN_BITS |= _bit
THROTTLE_OTHER = "other"
REASON_LABELS: tuple[str, ...] = (*(name for _, name in THROTTLE_REASONS), THROTTLE_OTHER)

FIELDS = ("memory", "utilization", "sm_clock", "temperature", "power", "throttle", "xid")


class NvmlProvider(Protocol):
    """What the collector needs from NVML, in NVML's own units.  Any method may raise."""

    def init(self) -> None: ...

    def shutdown(self) -> None: ...

    def device_count(self) -> int: ...

    def memory(self, index: int) -> tuple[int, int]:
        """(used, total) in bytes."""
        ...

    def utilization_percent(self, index: int) -> float: ...

    def sm_clock_mhz(self, index: int) -> float: ...

    def temperature_celsius(self, index: int) -> float: ...

    def power_milliwatts(self, index: int) -> float: ...

    def throttle_reasons(self, index: int) -> int:
        """Bitmask of active clock event reasons."""
        ...

    def xid_errors(self, index: int) -> int | None:
        """Cumulative XID errors seen since init, or None where events are not readable."""
        ...


class PynvmlProvider:
    """The real provider on ``pynvml`` (from the ``nvidia-ml-py`` distribution)."""

    def __init__(self) -> None:
        self._nv: Any = None
        self._handles: dict[int, Any] = {}
        self._events: Any = None
        self._xid_supported: set[int] = set()
        self._xid: dict[int, int] = {}

    def init(self) -> None:
        import pynvml  # lazy: optional (sidecar extra); without it the sidecar reports stepwatch_nvml_up 0

        pynvml.nvmlInit()
        self._nv = pynvml
        self._handles = {}
        self._xid = {}
        self._xid_supported = set()
        try:
            self._events = pynvml.nvmlEventSetCreate()
        except Exception:  # events are optional: XIDs become unreadable, nothing else changes
            self._events = None
        if self._events is not None:
            for i in range(self.device_count()):
                try:
                    pynvml.nvmlDeviceRegisterEvents(self._handle(i), pynvml.nvmlEventTypeXidCriticalError,
                                                    self._events)
                    self._xid_supported.add(i)
                    self._xid[i] = 0
                except Exception:
                    continue

    def shutdown(self) -> None:
        nv, self._nv = self._nv, None
        if nv is None:
            return
        if self._events is not None:
            try:
                nv.nvmlEventSetFree(self._events)
            except Exception:
                pass
            self._events = None
        self._handles = {}
        nv.nvmlShutdown()

    def _handle(self, index: int) -> Any:
        h = self._handles.get(index)
        if h is None:
            h = self._handles[index] = self._nv.nvmlDeviceGetHandleByIndex(index)
        return h

    def device_count(self) -> int:
        return int(self._nv.nvmlDeviceGetCount())

    def memory(self, index: int) -> tuple[int, int]:
        info = self._nv.nvmlDeviceGetMemoryInfo(self._handle(index))
        return int(info.used), int(info.total)

    def utilization_percent(self, index: int) -> float:
        return float(self._nv.nvmlDeviceGetUtilizationRates(self._handle(index)).gpu)

    def sm_clock_mhz(self, index: int) -> float:
        return float(self._nv.nvmlDeviceGetClockInfo(self._handle(index), self._nv.NVML_CLOCK_SM))

    def temperature_celsius(self, index: int) -> float:
        return float(self._nv.nvmlDeviceGetTemperature(self._handle(index), self._nv.NVML_TEMPERATURE_GPU))

    def power_milliwatts(self, index: int) -> float:
        return float(self._nv.nvmlDeviceGetPowerUsage(self._handle(index)))

    def throttle_reasons(self, index: int) -> int:
        nv, h = self._nv, self._handle(index)
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if fn is None:
            fn = nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(fn(h))

    def xid_errors(self, index: int) -> int | None:
        if index not in self._xid_supported:
            return None
        self._drain_events()
        return self._xid.get(index, 0)

    def _drain_events(self) -> None:
        """Count the XID events queued since the last read (never blocks)."""
        nv = self._nv
        for _ in range(1000):
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError as e:
                if getattr(e, "value", None) == nv.NVML_ERROR_TIMEOUT:
                    return
                raise
            if data.eventType & nv.nvmlEventTypeXidCriticalError:
                try:
                    i = int(nv.nvmlDeviceGetIndex(data.device))
                except Exception:
                    continue
                self._xid[i] = self._xid.get(i, 0) + 1


@dataclass
class GpuReading:
    """One GPU's values in base units; None where the read failed."""

    index: int
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    utilization_ratio: float | None = None
    sm_clock_hertz: float | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    throttle: dict[str, int] | None = None
    xid_errors: int | None = None
    failed: list[str] = field(default_factory=list)


@dataclass
class NvmlSnapshot:
    up: bool
    gpus: list[GpuReading]
    error: str | None = None


def throttle_labels(mask: int) -> dict[str, int]:
    """Bitmask -> {reason: 0/1} over the bounded vocabulary (unknown bits -> ``other``)."""
    out = {name: int(bool(mask & bit)) for bit, name in THROTTLE_REASONS}
    out[THROTTLE_OTHER] = int(bool(mask & ~_KNOWN_BITS))
    return out


class NvmlReader:
    """Reads every GPU through a provider; what fails is counted and skipped, never raised.

    Init failures (NVML absent, no driver) are logged once and retried at most
    every ``retry_init_s``; each (GPU, field) read failure is logged once.
    """

    def __init__(self, provider: NvmlProvider, *, retry_init_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.provider = provider
        self.retry_init_s = retry_init_s
        self._clock = clock
        self._initialized = False
        self._next_init = 0.0
        self._last_error: str | None = None
        self._logged: set[object] = set()
        self.read_errors: dict[int, int] = {}
        self._lock = threading.Lock()

    def _log_once(self, key: object, msg: str, *args: object) -> None:
        if key in self._logged:
            log.debug(msg, *args)
        else:
            self._logged.add(key)
            log.warning(msg, *args)

    def _ensure_init(self) -> bool:
        if self._initialized:
            return True
        now = self._clock()
        if now < self._next_init:
            return False
        try:
            self.provider.init()
        except Exception as e:
            self._next_init = now + self.retry_init_s
            self._last_error = f"NVML init failed: {_describe(e)}"
            self._log_once("init", "%s; GPU metrics off (stepwatch_nvml_up 0), retrying every %.0f s",
                           self._last_error, self.retry_init_s)
            return False
        self._initialized = True
        if "init" in self._logged:
            log.info("NVML initialized")
            self._logged.discard("init")
        return True

    def read(self) -> NvmlSnapshot:
        with self._lock:
            try:
                return self._read()
            except Exception as e:  # the collector's contract: nothing escapes a scrape
                self._log_once("read", "NVML read failed: %s", _describe(e))
                return NvmlSnapshot(False, [], _describe(e))

    def _read(self) -> NvmlSnapshot:
        if not self._ensure_init():
            return NvmlSnapshot(False, [], self._last_error)
        try:
            count = int(self.provider.device_count())
        except Exception as e:
            self._last_error = f"NVML device count failed: {_describe(e)}"
            self._log_once("count", "%s; re-initializing on a later scrape", self._last_error)
            self.close()
            self._next_init = self._clock() + self.retry_init_s
            return NvmlSnapshot(False, [], self._last_error)
        return NvmlSnapshot(True, [self._read_gpu(i) for i in range(count)])

    def _read_gpu(self, i: int) -> GpuReading:
        p, g = self.provider, GpuReading(i)

        def attempt(name: str, fn: Callable[[], None]) -> None:
            try:
                fn()
            except Exception as e:
                g.failed.append(name)
                self.read_errors[i] = self.read_errors.get(i, 0) + 1
                self._log_once((i, name), "GPU %d: reading %s failed: %s", i, name, _describe(e))

        def memory() -> None:
            used, total = p.memory(i)
            g.memory_used_bytes, g.memory_total_bytes = float(used), float(total)

        def util() -> None:
            g.utilization_ratio = _check(p.utilization_percent(i), 0, 100) / 100.0

        def clock() -> None:
            g.sm_clock_hertz = _check(p.sm_clock_mhz(i), 0, None) * 1e6

        def temp() -> None:
            g.temperature_celsius = _check(p.temperature_celsius(i), -50, 200)

        def power() -> None:
            g.power_watts = _check(p.power_milliwatts(i), 0, None) / 1000.0

        def throttle() -> None:
            g.throttle = throttle_labels(int(p.throttle_reasons(i)))

        def xid() -> None:
            g.xid_errors = p.xid_errors(i)

        for name, fn in zip(FIELDS, (memory, util, clock, temp, power, throttle, xid), strict=True):
            attempt(name, fn)
        self.read_errors.setdefault(i, 0)
        return g

    def close(self) -> None:
        if self._initialized:
            self._initialized = False
            try:
                self.provider.shutdown()
            except Exception as e:
                log.debug("NVML shutdown failed: %s", _describe(e))


def _check(v: float, lo: float | None, hi: float | None) -> float:
    x = float(v)
    if x != x or (lo is not None and x < lo) or (hi is not None and x > hi):
        raise ValueError(f"implausible value {v!r}")
    return x


def _describe(e: BaseException) -> str:
    text = str(e) or ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _family(name: str) -> GaugeMetricFamily | CounterMetricFamily:
    m = BY_NAME[name]
    if m.kind == "counter":
        return CounterMetricFamily(m.name, m.help, labels=list(m.labels))
    return GaugeMetricFamily(m.name, m.help, labels=list(m.labels))


_GAUGES: tuple[tuple[str, str], ...] = (
    ("stepwatch_gpu_memory_used_bytes", "memory_used_bytes"),
    ("stepwatch_gpu_memory_total_bytes", "memory_total_bytes"),
    ("stepwatch_gpu_utilization_ratio", "utilization_ratio"),
    ("stepwatch_gpu_sm_clock_hertz", "sm_clock_hertz"),
    ("stepwatch_gpu_temperature_celsius", "temperature_celsius"),
    ("stepwatch_gpu_power_watts", "power_watts"),
)
METRIC_NAMES: tuple[str, ...] = (
    "stepwatch_nvml_up", *(n for n, _ in _GAUGES), "stepwatch_gpu_throttle_active",
    "stepwatch_gpu_xid_errors_total", "stepwatch_gpu_read_errors_total",
)


class NvmlCollector(Collector):
    """prometheus_client collector: reads NVML at scrape time (like dcgm-exporter)."""

    def __init__(self, provider: NvmlProvider | None = None, *, retry_init_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.reader = NvmlReader(provider if provider is not None else PynvmlProvider(),
                                 retry_init_s=retry_init_s, clock=clock)

    def describe(self) -> Iterable[Metric]:
        return [_family(n) for n in METRIC_NAMES]

    def collect(self) -> Iterator[Metric]:
        snap = self.reader.read()
        yield from families(snap, dict(self.reader.read_errors))

    def close(self) -> None:
        self.reader.close()


def families(snap: NvmlSnapshot, read_errors: dict[int, int]) -> list[Metric]:
    """The exposition of one snapshot (read errors are cumulative, kept by the reader)."""
    up = _family("stepwatch_nvml_up")
    up.add_metric([], 1.0 if snap.up else 0.0)
    out: list[Metric] = [up]
    for name, attr in _GAUGES:
        fam = _family(name)
        for g in snap.gpus:
            v = getattr(g, attr)
            if v is not None:
                fam.add_metric([str(g.index)], v)
        out.append(fam)
    thr = _family("stepwatch_gpu_throttle_active")
    xid = _family("stepwatch_gpu_xid_errors_total")
    for g in snap.gpus:
        for reason, active in (g.throttle or {}).items():
            thr.add_metric([str(g.index), reason], float(active))
        if g.xid_errors is not None:
            xid.add_metric([str(g.index)], float(g.xid_errors))
    errs = _family("stepwatch_gpu_read_errors_total")
    for i, n in sorted(read_errors.items()):
        errs.add_metric([str(i)], float(n))
    out += [thr, xid, errs]
    return out
