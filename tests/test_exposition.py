"""The fast /metrics renderer writes exactly what prometheus_client writes, and serves it."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, Summary, generate_latest
from prometheus_client.core import GaugeMetricFamily

from stepwatch.bench.overhead import StubPipeline
from stepwatch.exporter import instrument
from stepwatch.exporter.sidecar.nvml import NvmlCollector
from stepwatch.exposition import Renderer, serve_metrics
from tests.fakes import FakeNvml


def _odd_registry() -> CollectorRegistry:
    """Every kind, awkward label values (quotes, backslashes, newlines, UTF-8), NaN and infinities,
    and _created samples (on by default in a fresh process: moved to their own gauge families)."""
    reg = CollectorRegistry()
    c = Counter("odd_things_total", "Things with a \\ backslash\nand a newline in the help.", ["what"], registry=reg)
    c.labels('say "hi"').inc()
    c.labels("back\\slash\nnew line").inc(2)
    c.labels("ünïcødé ✓").inc(0.5)
    g = Gauge("odd_level_ratio", "Levels.", ["a", "b"], registry=reg)
    g.labels(b="2", a="1").set(float("nan"))
    g.labels(a="x", b="y").set(float("inf"))
    g.labels(a="z", b="").set(-1e-9)
    h = Histogram("odd_wait_seconds", "Waits.", ["pool"], buckets=(0.1, 1.0), registry=reg)
    h.labels("p").observe(0.5)
    Summary("odd_step_seconds", "Steps.", registry=reg).observe(3.0)
    Info("odd_build", "Build.", registry=reg).info({"version": "1.0", "note": 'a "b"'})
    return reg


def test_renders_byte_for_byte_what_generate_latest_renders() -> None:
    reg = _odd_registry()
    renderer = Renderer(reg)
    assert renderer.render() == generate_latest(reg)
    reg._names_to_collectors["odd_things_total"].labels("later").inc()  # a new series after the cache filled
    Gauge("odd_late_bytes", "Registered after the first render.", registry=reg).set(7)
    assert renderer.render() == generate_latest(reg)


def test_exporter_and_sidecar_registries_render_identically(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    # The CPU wait and run counters are read from schedstat at each scrape: held still, so two renders compare.
    monkeypatch.setattr(sys.modules["stepwatch.exporter.instrument"], "ThreadTotals", lambda: lambda: (2.5, 1.5))
    reg = CollectorRegistry()
    pipe = StubPipeline(branches=2, cache=True)
    instrument(pipe, registry=reg, shapes=["256x256_4s_cfg", "512x256_4s_cfg"])
    pipe("p", height=256, width=256, num_inference_steps=4)
    pipe("p", height=256, width=512, num_inference_steps=4)
    reg.register(NvmlCollector(FakeNvml([{"memory": (1, 2), "utilization": 50.0, "sm_clock": 1500.0,
                                          "temperature": 60.0, "power": 300_000.0, "throttle": 0, "xid": 0}])))
    renderer = Renderer(reg)
    for _ in range(2):  # cold, then from the caches
        assert renderer.render() == generate_latest(reg)


def _series(text: bytes) -> int:
    return sum(1 for line in text.splitlines() if not line.startswith(b"#"))


def test_a_cache_past_its_bound_forgets_series_that_went_away() -> None:
    reg = _odd_registry()
    gauge = reg._names_to_collectors["odd_level_ratio"]
    for renderer, bounded in ((Renderer(reg), False), (Renderer(reg, max_series=3), True)):
        for i in range(20):
            gauge.labels(a=f"churn{i}", b="x").set(i)
        renderer.render()
        for i in range(20):
            gauge.remove(f"churn{i}", "x")
        text = renderer.render()
        assert text == generate_latest(reg)
        assert (len(renderer._prefixes) == _series(text)) is bounded  # unbounded: the 20 gone are still held


class _Stamped:
    def collect(self) -> list[GaugeMetricFamily]:
        fam = GaugeMetricFamily("odd_stamped_ratio", "A sample with its own timestamp.")
        fam.add_metric([], 0.5, timestamp=1700000000.5)
        return [fam]


def test_a_timestamped_sample_takes_generate_latests_own_path() -> None:
    reg = _odd_registry()
    reg.register(_Stamped())
    assert Renderer(reg).render() == generate_latest(reg)


@pytest.fixture
def served() -> Iterator[tuple[str, CollectorRegistry]]:
    reg = _odd_registry()
    server, thread = serve_metrics(0, "127.0.0.1", reg)
    try:
        yield f"http://127.0.0.1:{server.server_port}", reg
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_serves_the_rendering_on_metrics_and_refuses_other_paths(served: tuple[str, CollectorRegistry]) -> None:
    url, reg = served
    r = httpx.get(f"{url}/metrics", timeout=5, headers={"Accept-Encoding": "identity"})
    assert r.status_code == 200 and r.content == generate_latest(reg)
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "content-encoding" not in r.headers
    z = httpx.get(f"{url}/metrics", timeout=5, headers={"Accept-Encoding": "gzip"})  # as Prometheus asks
    assert z.headers["content-encoding"] == "gzip" and z.content == generate_latest(reg)  # httpx inflates it
    assert httpx.get(f"{url}/nothing", timeout=5).status_code == 404


class _Broken:
    def collect(self) -> list[GaugeMetricFamily]:
        raise RuntimeError("collector on fire")


def test_a_broken_collector_gets_a_500_and_the_server_keeps_serving(served: tuple[str, CollectorRegistry]) -> None:
    url, reg = served
    broken = _Broken()
    reg.register(broken)
    r = httpx.get(f"{url}/metrics", timeout=5)
    assert r.status_code == 500 and "collector on fire" in r.text
    reg.unregister(broken)
    assert httpx.get(f"{url}/metrics", timeout=5).status_code == 200


def test_a_scraper_that_hung_up_leaves_no_traceback_and_other_errors_still_do(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A scrape that timed out on a loaded host writes no BrokenPipe traceback into the service's log."""
    server = serve_metrics(0, "127.0.0.1", CollectorRegistry())[0]
    try:
        for error in (BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "reset"), RuntimeError("ours")):
            try:
                raise error
            except Exception:
                server.handle_error(None, ("127.0.0.1", 1))
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert "RuntimeError: ours" in err and "Broken pipe" not in err and "reset" not in err, err


def test_serves_on_ipv6_loopback_too() -> None:
    import socket

    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    reg = _odd_registry()
    try:
        server, thread = serve_metrics(0, "::1", reg)
    except OSError as e:  # IPv6 compiled in but no ::1 configured
        pytest.skip(f"no IPv6 loopback here: {e}")
    try:
        r = httpx.get(f"http://[::1]:{server.server_port}/metrics", timeout=5)
        assert r.status_code == 200 and r.content == generate_latest(reg)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
