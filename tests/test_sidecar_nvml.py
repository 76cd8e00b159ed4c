"""The NVML collector on a fake provider: base units, failing GPUs, NVML absent."""

from __future__ import annotations

import logging
import sys
import types

import pytest
from prometheus_client import CollectorRegistry

from stepwatch.exporter.sidecar.nvml import REASON_LABELS, NvmlCollector, PynvmlProvider
from tests.fakes import GIB, FakeNvml, FakeNvmlError, collector, gpu
from tests.promtext import scrape, value


def test_values_map_to_base_units(registry: CollectorRegistry) -> None:
    fake = FakeNvml([gpu(), gpu(memory=(123_456_789, 141 * GIB), utilization=3, sm_clock=345, temperature=40,
                                power=71_250, throttle=0x4 | 0x40 | 0x2000, xid=2)])
    collector(registry, fake)
    d = scrape(registry)
    assert value(d, "stepwatch_nvml_up") == 1.0
    assert value(d, "stepwatch_gpu_memory_used_bytes", gpu="0") == 30 * GIB
    assert value(d, "stepwatch_gpu_memory_total_bytes", gpu="0") == 80 * GIB
    assert value(d, "stepwatch_gpu_utilization_ratio", gpu="0") == pytest.approx(0.87)
    assert value(d, "stepwatch_gpu_sm_clock_hertz", gpu="0") == 1.98e9
    assert value(d, "stepwatch_gpu_temperature_celsius", gpu="0") == 71.0
    assert value(d, "stepwatch_gpu_power_watts", gpu="0") == 312.5
    assert value(d, "stepwatch_gpu_memory_used_bytes", gpu="1") == 123_456_789
    assert value(d, "stepwatch_gpu_memory_total_bytes", gpu="1") == 141 * GIB
    assert value(d, "stepwatch_gpu_utilization_ratio", gpu="1") == pytest.approx(0.03)
    assert value(d, "stepwatch_gpu_sm_clock_hertz", gpu="1") == 345e6
    assert value(d, "stepwatch_gpu_power_watts", gpu="1") == 71.25
    # Every reason is a series (0 or 1), so rules see the reason turn on; unknown bits read as `other`.
    active = {r for r in REASON_LABELS if value(d, "stepwatch_gpu_throttle_active", gpu="1", reason=r) == 1}
    assert active == {"sw_power_cap", "hw_thermal_slowdown", "other"}
    assert all(("stepwatch_gpu_throttle_active", frozenset({("gpu", "0"), ("reason", r)})) in d
               for r in REASON_LABELS)
    assert value(d, "stepwatch_gpu_xid_errors_total", gpu="1") == 2
    assert value(d, "stepwatch_gpu_read_errors_total", gpu="0") == 0
    assert ("stepwatch_gpu_read_errors_total", frozenset({("gpu", "1")})) in d


def test_one_failing_gpu_still_returns_the_others(registry: CollectorRegistry,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeNvml([gpu(), gpu(), gpu(temperature=66)], failing_gpus={1}, failing={(2, "power")})
    collector(registry, fake)
    with caplog.at_level(logging.WARNING, logger="stepwatch.sidecar.nvml"):
        d = scrape(registry)
        d = scrape(registry)
    assert value(d, "stepwatch_nvml_up") == 1
    assert value(d, "stepwatch_gpu_sm_clock_hertz", gpu="0") == 1.98e9
    assert ("stepwatch_gpu_sm_clock_hertz", frozenset({("gpu", "1")})) not in d
    assert ("stepwatch_gpu_memory_used_bytes", frozenset({("gpu", "1")})) not in d
    assert value(d, "stepwatch_gpu_temperature_celsius", gpu="2") == 66
    assert ("stepwatch_gpu_power_watts", frozenset({("gpu", "2")})) not in d
    # Seven fields per read, two scrapes; GPU 2 lost one field per scrape.
    assert value(d, "stepwatch_gpu_read_errors_total", gpu="1") == 14
    assert value(d, "stepwatch_gpu_read_errors_total", gpu="2") == 2
    assert value(d, "stepwatch_gpu_read_errors_total", gpu="0") == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 8  # once per (GPU, field), not once per scrape
    assert any("GPU 2: reading power failed" in r.getMessage() for r in warnings)


def test_implausible_values_are_read_errors(registry: CollectorRegistry) -> None:
    collector(registry, FakeNvml([gpu(utilization=150, temperature=float("nan"))]))
    d = scrape(registry)
    assert ("stepwatch_gpu_utilization_ratio", frozenset({("gpu", "0")})) not in d
    assert ("stepwatch_gpu_temperature_celsius", frozenset({("gpu", "0")})) not in d
    assert value(d, "stepwatch_gpu_read_errors_total", gpu="0") == 2
    assert value(d, "stepwatch_gpu_sm_clock_hertz", gpu="0") == 1.98e9


def test_xid_unreadable_gives_no_series(registry: CollectorRegistry) -> None:
    collector(registry, FakeNvml([gpu(xid=None)]))
    d = scrape(registry)
    assert ("stepwatch_gpu_xid_errors_total", frozenset({("gpu", "0")})) not in d
    assert value(d, "stepwatch_gpu_read_errors_total", gpu="0") == 0


def test_init_failure_is_up_0_logged_once_and_retried(registry: CollectorRegistry,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    fake = FakeNvml([gpu()], init_error=FakeNvmlError("NVML Shared Library Not Found"))
    c = collector(registry, fake, retry_init_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="stepwatch.sidecar.nvml"):
        for _ in range(5):
            d = scrape(registry)
            assert value(d, "stepwatch_nvml_up") == 0
            assert not any(n.startswith("stepwatch_gpu_memory") for n, _ in d)
    assert fake.inits == 1  # no retry storm: the next try waits retry_init_s
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    assert "NVML Shared Library Not Found" in caplog.records[0].getMessage()
    now[0] += 61
    fake.init_error = None
    d = scrape(registry)
    assert value(d, "stepwatch_nvml_up") == 1
    assert value(d, "stepwatch_gpu_temperature_celsius", gpu="0") == 71
    c.close()
    assert fake.shutdowns == 1


def test_device_count_failure_is_up_0(registry: CollectorRegistry) -> None:
    fake = FakeNvml([gpu()], count_error=FakeNvmlError("driver gone"))
    collector(registry, fake)
    d = scrape(registry)
    assert value(d, "stepwatch_nvml_up") == 0
    assert fake.shutdowns == 1  # re-initialized on a later scrape


def test_provider_raising_anything_never_escapes_a_scrape(registry: CollectorRegistry) -> None:
    class Broken(FakeNvml):
        def memory(self, i: int) -> tuple[int, int]:
            raise RuntimeError("boom")

        def throttle_reasons(self, i: int) -> int:
            return "not a number"  # type: ignore[return-value]

    collector(registry, Broken([gpu()]))
    d = scrape(registry)
    assert value(d, "stepwatch_nvml_up") == 1
    assert value(d, "stepwatch_gpu_read_errors_total", gpu="0") == 2


def test_duplicate_registration_is_refused() -> None:
    from stepwatch.exporter.sidecar.prober import quality_metrics

    reg = CollectorRegistry()
    reg.register(NvmlCollector(FakeNvml([])))
    quality_metrics(reg)  # the prober's metrics share the registry without clashing
    with pytest.raises(ValueError, match="Duplicated"):
        reg.register(NvmlCollector(FakeNvml([])))


def test_real_provider_without_nvml_reports_up_0(registry: CollectorRegistry) -> None:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("NVML is present on this machine")
    except Exception:
        pass
    collector(registry, PynvmlProvider())
    d = scrape(registry)
    assert value(d, "stepwatch_nvml_up") == 0


def test_nvml_check_exits_0_without_nvml(capsys: pytest.CaptureFixture[str]) -> None:
    from stepwatch.exporter.sidecar import nvml_check

    rc = nvml_check.main([])
    out = capsys.readouterr().out
    assert rc == 0
    assert "NVML is not available here" in out or "NVML initialized" in out


class FakePynvml(types.ModuleType):
    """Just enough of the ``pynvml`` module (nvidia-ml-py) to drive the real provider without a GPU."""

    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_TIMEOUT = 10
    nvmlEventTypeXidCriticalError = 0x8

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.events: list[types.SimpleNamespace] = []
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> tuple[str, int]:
        return ("handle", i)

    def nvmlDeviceGetIndex(self, h: tuple[str, int]) -> int:
        return h[1]

    def nvmlDeviceGetMemoryInfo(self, h: tuple[str, int]) -> types.SimpleNamespace:
        return types.SimpleNamespace(used=(h[1] + 1) * GIB, total=80 * GIB, free=0)

    def nvmlDeviceGetUtilizationRates(self, h: tuple[str, int]) -> types.SimpleNamespace:
        return types.SimpleNamespace(gpu=50 + h[1], memory=10)

    def nvmlDeviceGetClockInfo(self, h: tuple[str, int], kind: int) -> int:
        assert kind == self.NVML_CLOCK_SM
        return 1755

    def nvmlDeviceGetTemperature(self, h: tuple[str, int], sensor: int) -> int:
        return 60

    def nvmlDeviceGetPowerUsage(self, h: tuple[str, int]) -> int:
        return 450_000

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: tuple[str, int]) -> int:
        return 0x20 if h[1] == 1 else 0

    def nvmlEventSetCreate(self) -> str:
        return "eventset"

    def nvmlEventSetFree(self, s: str) -> None:
        self.calls.append("free")

    def nvmlDeviceRegisterEvents(self, h: tuple[str, int], types_: int, s: str) -> None:
        if h[1] == 1:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)

    def nvmlEventSetWait_v2(self, s: str, timeout_ms: int) -> types.SimpleNamespace:
        assert timeout_ms == 0  # never blocks a scrape
        if not self.events:
            raise self.NVMLError(self.NVML_ERROR_TIMEOUT)
        return self.events.pop(0)


@pytest.fixture
def fake_pynvml(monkeypatch: pytest.MonkeyPatch) -> FakePynvml:
    mod = FakePynvml()
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    return mod


def test_real_provider_on_a_fake_pynvml(registry: CollectorRegistry, fake_pynvml: FakePynvml) -> None:
    c = collector(registry, PynvmlProvider())
    d = scrape(registry)
    assert value(d, "stepwatch_nvml_up") == 1
    assert value(d, "stepwatch_gpu_memory_used_bytes", gpu="1") == 2 * GIB
    assert value(d, "stepwatch_gpu_utilization_ratio", gpu="1") == pytest.approx(0.51)
    assert value(d, "stepwatch_gpu_sm_clock_hertz", gpu="0") == 1.755e9
    assert value(d, "stepwatch_gpu_power_watts", gpu="0") == 450.0
    assert value(d, "stepwatch_gpu_throttle_active", gpu="1", reason="sw_thermal_slowdown") == 1
    assert value(d, "stepwatch_gpu_xid_errors_total", gpu="0") == 0
    assert ("stepwatch_gpu_xid_errors_total", frozenset({("gpu", "1")})) not in d  # events not supported there
    xid = types.SimpleNamespace(device=("handle", 0), eventType=0x8, eventData=79)
    fake_pynvml.events += [xid, xid]
    d = scrape(registry)
    assert value(d, "stepwatch_gpu_xid_errors_total", gpu="0") == 2
    assert value(d, "stepwatch_gpu_read_errors_total", gpu="0") == 0
    c.close()
    assert fake_pynvml.calls[-2:] == ["free", "shutdown"]


def test_nvml_check_prints_what_it_reads(fake_pynvml: FakePynvml, capsys: pytest.CaptureFixture[str]) -> None:
    from stepwatch.exporter.sidecar import nvml_check

    assert nvml_check.main(["--strict"]) == 0
    out = capsys.readouterr().out
    assert "NVML initialized: 2 GPU(s)" in out
    assert "SM clock MHz                 1755" in out
    assert "sw_thermal_slowdown" in out
    assert 'stepwatch_gpu_power_watts{gpu="0"} 450.0' in out
