"""The practice service over real HTTP: one service per module, knobs restored after each test."""

from __future__ import annotations

import base64
import io
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from tests.promtext import Samples, counter_before, total, value
from tests.servicefixture import ADMIN_TOKEN, ServiceProc


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProc]:
    s = ServiceProc(tmp_path_factory.mktemp("svc"))
    yield s
    s.close()


@pytest.fixture
def restore(svc: ServiceProc) -> Iterator[None]:
    yield
    status, body, _ = svc.knobs(cache="first_block_cache", cache_threshold=0.5, vae_tiling=True,
                                attention_backend="native")
    assert status == 200, body
    # Back at the values it started with: no knob reads as overridden (a value, not a history of label sets).
    m = svc.metrics()
    knobs = ("cache", "cache_threshold", "vae_tiling", "compile", "attention_backend")
    assert {k: value(m, "stepwatch_service_knob_override_active", knob=k) for k in knobs} == dict.fromkeys(knobs, 0)


def png(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_warmed_shape_serves_without_compiling(svc: ServiceProc) -> None:
    before = svc.metrics()
    status, body, _ = svc.generate(size="256x256", seed=3)
    assert status == 200, body
    img = png(body["data"][0]["b64_json"])
    assert img.size == (256, 256) and img.mode == "RGB"
    sw = body["stepwatch"]
    assert sw["shape"] == "256x256_4s" and sw["pool"] == "small" and sw["steps"] == 4
    assert set(sw["stages"]) == {"text_encode", "denoise", "vae_decode"}
    assert sw["fingerprint_id"] and sw["instance_id"]
    after = svc.metrics()
    assert total(after, "stepwatch_compile_total", phase="serving") == total(before, "stepwatch_compile_total",
                                                                             phase="serving")
    assert total(after, "stepwatch_compile_total", shape="256x256_2s", phase="warmup") >= 1  # warm-up: 2 steps
    assert value(after, "stepwatch_pipeline_step_duration_seconds_count", shape="256x256_4s") - counter_before(
        before, "stepwatch_pipeline_step_duration_seconds_count", shape="256x256_4s") == 4
    # Same seed, same deployment -> the same image.
    status2, body2, _ = svc.generate(size="256x256", seed=3)
    assert status2 == 200 and body2["data"][0]["b64_json"] == body["data"][0]["b64_json"]


def test_unwarmed_shape_compiles_while_serving(svc: ServiceProc) -> None:
    # 288x288 is on the allowlist (TEST_CONFIG's small pool) and no other test in this module requests it, so
    # its serving-compile counter starts at 0 whatever ran before on the module's service.
    compiles = ("stepwatch_compile_total", {"shape": "288x288_4s", "phase": "serving"})
    before = svc.metrics()
    assert value(before, compiles[0], **compiles[1]) == 0
    status, body, _ = svc.generate(size="288x288", seed=1)
    assert status == 200, body
    assert body["stepwatch"]["shape"] == "288x288_4s"
    after = svc.metrics()
    new = value(after, compiles[0], **compiles[1])
    assert new >= 1
    status, body, _ = svc.generate(size="288x288", seed=2)
    assert status == 200, body
    again = svc.metrics()
    assert value(again, compiles[0], **compiles[1]) == new  # compiled once


def test_cache_knob_changes_the_hit_rate(svc: ServiceProc, restore: None) -> None:
    def hits_of(n: int) -> tuple[int, int]:
        h = m = 0
        for seed in range(n):
            status, body, _ = svc.generate(size="256x256", seed=seed, steps=8)
            assert status == 200, body
            h += body["stepwatch"]["cache"]["hits"]
            m += body["stepwatch"]["cache"]["misses"]
        return h, m

    low_hits, _ = hits_of(3)
    info0 = svc.get("/v1/stepwatch/info")[1]
    status, body, _ = svc.knobs(cache_threshold=5.0)
    assert status == 200 and body["knobs"]["cache_threshold"] == 5.0
    # A knob change shows in the config id, not in the deployment fingerprint (baselines stay comparable).
    assert body["config_id"] != info0["config_id"] and body["fingerprint_id"] == info0["fingerprint_id"]
    before = svc.metrics()
    high_hits, _ = hits_of(3)
    after = svc.metrics()
    assert high_hits > low_hits
    assert high_hits == 3 * 6  # every step but the first and the last reuses the cache
    assert total(after, "stepwatch_cache_decisions_total", decision="hit") - total(
        before, "stepwatch_cache_decisions_total", decision="hit") == high_hits
    info = svc.get("/v1/stepwatch/info")[1]
    assert info["knobs"]["cache_threshold"] == 5.0
    cfg_info = [ls for (n, ls) in after if n == "stepwatch_service_config_info"]
    assert len(cfg_info) == 1 and ("cache_threshold", "5.0") in cfg_info[0]
    assert ("config_id", body["config_id"]) in cfg_info[0]
    assert value(after, "stepwatch_service_knob_override_active", knob="cache_threshold") == 1
    assert value(after, "stepwatch_service_knob_override_active", knob="cache") == 0


def test_an_attention_kernel_the_device_lacks_fails_requests_with_500_and_the_service_serves_on(
        svc: ServiceProc, restore: None) -> None:
    """The request-error drill's fault: a deploy that forces cuDNN attention on a device without it."""
    before = svc.metrics()
    status, body, _ = svc.knobs(attention_backend="_native_cudnn")
    assert status == 200 and body["knobs"]["attention_backend"] == "_native_cudnn"
    status, body, _ = svc.generate(size="256x256")
    assert status == 500, body
    assert "scaled_dot_product_attention" in body["error"]["message"]
    after = svc.metrics()
    # The request's own error, and on a compiled service the re-warm's first run, which failed the same way.
    assert total(after, "stepwatch_pipeline_requests_total", outcome="error") - total(
        before, "stepwatch_pipeline_requests_total", outcome="error") in (1, 2)
    assert value(after, "stepwatch_service_requests_total", pool="small", code="500") - value(
        before, "stepwatch_service_requests_total", pool="small", code="500") == 1
    assert value(after, "stepwatch_service_knob_override_active", knob="attention_backend") == 1
    assert svc.knobs(attention_backend="warp")[0] == 400
    assert svc.knobs(attention_backend="native")[0] == 200
    assert svc.generate(size="256x256")[0] == 200


def test_vae_tiling_off_oom_fails_the_request_and_the_next_succeeds(svc: ServiceProc, restore: None) -> None:
    status, body, _ = svc.knobs(vae_tiling=False)
    assert status == 200
    before = svc.metrics()
    status, body, _ = svc.generate(size="2048x2048", steps=1)
    assert status == 507, body
    msg = body["error"]["message"]
    assert "out of memory in vae_decode" in msg and "2048x2048" in msg and "enable VAE tiling" in msg
    assert body["error"]["code"] == "out_of_memory"
    status, body, _ = svc.generate(size="256x256")
    assert status == 200
    after = svc.metrics()
    assert total(after, "stepwatch_oom_total", stage="vae_decode") - total(before, "stepwatch_oom_total",
                                                                           stage="vae_decode") == 1
    assert value(after, "stepwatch_service_requests_total", pool="large", code="507") - value(
        before, "stepwatch_service_requests_total", pool="large", code="507") == 1  # both: created at 0 at start
    assert value(after, "stepwatch_worker_restarts_total") == value(before, "stepwatch_worker_restarts_total")
    # The same size with tiling on fits the budget.
    svc.knobs(vae_tiling=True)
    status, body, _ = svc.generate(size="2048x2048", steps=1)
    assert status == 200, body


@pytest.mark.parametrize("body,status,message", [
    (None, 400, "request body is not valid JSON"),
    ({"size": "256x256"}, 400, "'prompt' is required"),
    ({"prompt": "a", "size": "250x256"}, 400, "'size' '250x256': width and height must be positive multiples of 16"),
    ({"prompt": "a", "size": "4096x4096"}, 400, "'size' '4096x4096' is over the maximum"),
    ({"prompt": "a", "n": 7}, 400, "'n' must be between 1 and 4, got 7"),
    ({"prompt": "a", "n": "two"}, 400, "'n' must be an integer, got str"),
    ({"prompt": ["a"]}, 400, "'prompt' must be a string, got list"),
    ({"prompt": "a", "response_format": "url"}, 400, "'response_format' 'url' is not supported"),
])
def test_bad_input_gets_its_exact_4xx(svc: ServiceProc, body: Any, status: int, message: str) -> None:
    raw = b"{not json" if body is None else None
    got, answer, _ = svc.request("POST", "/v1/images/generations", body, raw=raw)
    assert got == status
    assert answer["error"]["message"].startswith(message), answer


def test_http_errors_and_admin_guard(svc: ServiceProc) -> None:
    assert svc.get("/nope")[0] == 404
    assert svc.get("/v1/images/generations")[0] == 405
    assert svc.get("/healthz")[0] == 200 and svc.get("/readyz")[0] == 200
    st, body, _ = svc.request("POST", "/admin/knobs", {"vae_tiling": True}, {"Authorization": "Bearer wrong"})
    assert st == 401
    st, body, _ = svc.request("POST", "/admin/knobs", {"vae_tiling": True})
    assert st == 401
    st, body, _ = svc.knobs(colour="blue")
    assert st == 400 and "unknown knob 'colour'" in body["error"]["message"]
    st, body, _ = svc.knobs(vae_tiling="yes")
    assert st == 400 and "wrong type" in body["error"]["message"]
    st, body, _ = svc.knobs(cache="teacache")
    assert st == 400
    st, body, _ = svc.knobs(rank_delay_seconds={"1": 0.5})  # one rank only
    assert st == 400 and "rank_delay_seconds" in body["error"]["message"]


def test_running_service_serves_its_openapi_schema_and_405_with_allow(svc: ServiceProc) -> None:
    status, schema, _ = svc.get("/openapi.json")
    assert status == 200
    assert "post" in schema["paths"]["/v1/images/generations"]
    status, _, headers = svc.request("PUT", "/v1/images/generations", {"prompt": "x"})
    assert status == 405 and headers.get("allow", headers.get("Allow")) == "POST"


def test_openai_client(svc: ServiceProc) -> None:
    import openai

    client = openai.OpenAI(base_url=svc.url + "/v1", api_key="unused")
    res = client.images.generate(prompt="a red bicycle", n=2, size="256x256", response_format="b64_json",
                                 extra_body={"seed": 5, "steps": 4})
    assert len(res.data) == 2
    for d in res.data:
        assert d.b64_json is not None and png(d.b64_json).size == (256, 256)
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(prompt="a red bicycle", size="250x250", response_format="b64_json")  # type: ignore
    assert "multiples of 16" in str(e.value)


@pytest.mark.heavy
def test_twenty_ooms_in_a_row_keep_serving_and_memory_flat(svc: ServiceProc, restore: None) -> None:
    svc.generate(size="256x256")
    rss0 = svc.get("/v1/stepwatch/info")[1]["worker"]["rss_bytes"]
    svc.knobs(vae_tiling=False)
    for _ in range(20):
        status, body, _ = svc.generate(size="2048x2048", steps=1)
        assert status == 507, body
    status, _, _ = svc.generate(size="256x256")
    assert status == 200
    info = svc.get("/v1/stepwatch/info")[1]
    rss1 = info["worker"]["rss_bytes"]
    assert rss1 - rss0 <= 0.10 * rss0, (rss0, rss1)  # no growth (the worker trims after a large request: less is fine)
    m = svc.metrics()
    assert value(m, "stepwatch_worker_restarts_total") == 0


@pytest.mark.heavy
def test_load_every_request_answered_and_counted(svc: ServiceProc) -> None:
    before = svc.metrics()
    results: list[int] = []
    lock = threading.Lock()
    stop = time.time() + 60
    sizes = ["256x256", "320x320", "256x256", "512x512"]

    def client(i: int) -> None:
        k = 0
        while time.time() < stop:
            status, body, headers = svc.generate(size=sizes[(i + k) % len(sizes)], seed=k, steps=4)
            assert status in (200, 429, 507), body
            if status == 429:
                assert int(headers["Retry-After"]) >= 1
                time.sleep(0.2)
            with lock:
                results.append(status)
            k += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    time.sleep(1.5)  # gauges refresh every second
    after = svc.metrics()
    served = total(after, "stepwatch_service_requests_total") - total(before, "stepwatch_service_requests_total")
    ok = sum(1 for s in results if s == 200)
    assert served == len(results) and ok > 0
    assert total(after, "stepwatch_service_requests_total", code="200") - total(
        before, "stepwatch_service_requests_total", code="200") == ok
    for pool in ("small", "large", "other"):
        assert value(after, "stepwatch_queue_depth", pool=pool) == 0
        assert value(after, "stepwatch_queue_estimated_wait_seconds", pool=pool) == 0
    assert value(after, "stepwatch_queue_wait_seconds_count", pool="small") > counter_before(
        before, "stepwatch_queue_wait_seconds_count", pool="small")


@pytest.mark.heavy
def test_worker_death_fails_in_flight_and_restarts(tmp_path: Path) -> None:
    s = ServiceProc(tmp_path, {"warmup": ["256x256"]})
    try:
        pid = s.get("/v1/stepwatch/info")[1]["worker"]["pid"]
        result: dict[str, Any] = {}

        def slow() -> None:
            result["r"] = s.generate(size="2048x2048", steps=6)

        t = threading.Thread(target=slow)
        t.start()
        time.sleep(2.0)
        os.kill(pid, signal.SIGKILL)
        t.join(timeout=120)
        status, body, headers = result["r"]
        assert status == 503 and "worker died" in body["error"]["message"] and "SIGKILL" in body["error"]["message"]
        assert headers.get("Retry-After")
        s.wait_ready(240)
        status, body, _ = s.generate(size="256x256")
        assert status == 200
        m = s.metrics()
        assert value(m, "stepwatch_worker_restarts_total") == 1
        assert value(m, "stepwatch_worker_up") == 1
        assert s.get("/v1/stepwatch/info")[1]["worker"]["pid"] != pid
    finally:
        s.close()


@pytest.mark.heavy
def test_overload_gets_429_with_retry_after(tmp_path: Path) -> None:
    s = ServiceProc(tmp_path, {"compile": {"enabled": False}, "warmup": ["256x256"],
                               "pools": {"small": {"sizes": ["256x256"], "slo_seconds": 0.4,
                                                   "max_wait_seconds": 0.4}}})
    try:
        results: list[tuple[int, dict[str, str]]] = []
        lock = threading.Lock()

        def burst() -> None:
            st, _, headers = s.generate(size="256x256", steps=8)
            with lock:
                results.append((st, headers))

        threads = [threading.Thread(target=burst) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        codes = [c for c, _ in results]
        assert len(codes) == 16 and set(codes) <= {200, 429}
        assert codes.count(429) >= 1 and codes.count(200) >= 1
        assert all(int(h["Retry-After"]) >= 1 for c, h in results if c == 429)
        m = s.metrics()
        assert value(m, "stepwatch_queue_rejected_total", pool="small") == codes.count(429)
        assert value(m, "stepwatch_service_requests_total", pool="small", code="429") == codes.count(429)
    finally:
        s.close()


def test_bad_config_exits_with_the_key(tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("compile: {backend: tvm}\n")
    p = subprocess.run([sys.executable, "-m", "stepwatch.cli", "serve", "--config", str(bad)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2
    assert "compile.backend: 'tvm' is not one of inductor, aot_eager, eager" in p.stdout + p.stderr


def test_admin_is_off_without_a_token(tmp_path: Path) -> None:
    s = ServiceProc(tmp_path, {"admin_token": None, "compile": {"enabled": False}, "warmup": []})
    try:
        st, body, _ = s.request("POST", "/admin/knobs", {"vae_tiling": False},
                                {"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert st == 404 and "admin endpoint is off" in body["error"]["message"]
    finally:
        s.close()


def rank_steps_settled(s: ServiceProc, since: Samples | None = None, steps: int | None = None,
                       timeout: float = 20.0) -> Samples:
    """Metrics once rank 0 has published every finished request: the per-rank gauges follow a request by
    up to two shipping intervals (the ranks ship their stamps every second), so a scrape right after the
    response may still show the one before.  With ``steps``: until both ranks counted that many steps
    since ``since``; without: until the counters are above zero (the warm-up's steps arrived: on a loaded
    host two scrapes 1.5 s apart can both come before the first shipment) and stop moving."""
    deadline, prev = time.monotonic() + timeout, None
    while True:
        m = s.metrics()
        counts = [total(m, "stepwatch_rank_steps_total", rank=r) - (total(since, "stepwatch_rank_steps_total", rank=r)
                                                                     if since is not None else 0.0)
                  for r in ("0", "1")]
        if (counts == [steps, steps]) if steps is not None else (counts == prev and min(counts) > 0):
            return m
        assert time.monotonic() < deadline, f"rank steps never settled: {counts} (want {steps})"
        prev = counts
        time.sleep(1.5)


# Rank 1's injected delay per step.  Large beside the shared CPU's noise: with 30 ms (7 x 30 = 210 ms expected
# over the delayed request) the busy-time gap once came out 126 ms on a loaded 2-core host, the other rank
# ahead by ~90 ms of noise.  At 80 ms the expected gap is 560 ms and the check asks for half of it.
DELAY_S = 0.08


@pytest.mark.heavy
def test_two_ranks_report_and_a_delayed_rank_shows_as_skew(tmp_path: Path) -> None:
    s = ServiceProc(tmp_path, {"ranks": 2, "compile": {"enabled": False}, "warmup": ["256x256"]})
    try:
        m0 = rank_steps_settled(s)  # the warm-up's steps land a shipping interval after it
        for seed in range(3):
            status, body, _ = s.generate(size="256x256", seed=seed, steps=8)
            assert status == 200, body
        m = rank_steps_settled(s, since=m0, steps=24)
        m_undelayed = m
        r0 = value(m, "stepwatch_rank_step_duration_seconds", rank="0")
        r1 = value(m, "stepwatch_rank_step_duration_seconds", rank="1")
        assert r0 > 0 and r1 > 0  # both ranks report
        assert value(m, "stepwatch_rank_skew_ratio") == pytest.approx((max(r0, r1) - min(r0, r1)) / min(r0, r1))
        assert s.get("/v1/stepwatch/info")[1]["fingerprint"]["parallel_degree"] == 2
        status, body, _ = s.knobs(rank_delay_seconds={"1": DELAY_S})
        assert status == 200, body
        status, body, _ = s.generate(size="256x256", seed=0, steps=8)
        assert status == 200
        m = rank_steps_settled(s, since=m0, steps=32)
        ranks = s.generate(size="256x256", seed=1, steps=8)[1]["stepwatch"]["ranks"]
        assert len(ranks["step_seconds"]) == 2 and ranks["requests_ago"] >= 1, ranks  # the last whole request
        r0 = value(m, "stepwatch_rank_step_duration_seconds", rank="0")
        r1 = value(m, "stepwatch_rank_step_duration_seconds", rank="1")
        assert r1 > r0 * 1.1, (r0, r1)  # rank 1 is the straggler
        assert value(m, "stepwatch_rank_skew_ratio") > 0.1
        assert r1 - r0 == pytest.approx(DELAY_S * 7 / 8, rel=0.5)  # the delay lands in 7 of 8 steps
        # The windowed counters: 4 requests x 8 steps per rank since the first snapshot (warm-up aside);
        # in the delayed request, rank 1's busy time grows by 7 x DELAY_S more than rank 0's.  (Compared over
        # that request alone: the earlier ones leave either rank ahead by the noise of a shared CPU.)
        for rank in ("0", "1"):
            assert value(m, "stepwatch_rank_steps_total", rank=rank) - counter_before(
                m0, "stepwatch_rank_steps_total", rank=rank) == 32

        def busy_in_delayed(rank: str) -> float:
            return value(m, "stepwatch_rank_busy_seconds_total", rank=rank) - value(
                m_undelayed, "stepwatch_rank_busy_seconds_total", rank=rank)

        assert busy_in_delayed("1") - busy_in_delayed("0") > 7 * DELAY_S / 2, (busy_in_delayed("1"),
                                                                               busy_in_delayed("0"))
    finally:
        s.close()


def test_sigterm_fails_what_is_waiting_stops_the_worker_and_exits_0(tmp_path: Path) -> None:
    s = ServiceProc(tmp_path, {"compile": {"enabled": False}, "warmup": [],
                               "pools": {"small": {"sizes": ["256x256"], "slo_seconds": 10, "max_wait_seconds": 600},
                                         "large": {"sizes": ["2048x2048"], "slo_seconds": 60,
                                                   "max_wait_seconds": 600}}})
    try:
        pid = s.get("/v1/stepwatch/info")[1]["worker"]["pid"]
        results: list[tuple[int, Any, dict[str, str]]] = []
        # The first must still run at the SIGTERM: 2048^2 x 6 steps once finished within the 1.9 s before it; at
        # 40 steps it runs for many seconds, and the shutdown fails it like the two queued behind it.
        threads = [threading.Thread(target=lambda size=size, steps=steps: results.append(s.generate(size=size,
                                                                                                   steps=steps)))
                   for size, steps in (("2048x2048", 40), ("256x256", 6), ("256x256", 6))]
        for t in threads:
            t.start()
            time.sleep(0.3)  # the first runs, the others queue behind it
        time.sleep(1.0)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=30) == 0
        for t in threads:
            t.join(timeout=10)
        assert len(results) == 3 and {st for st, _, _ in results} == {503}, results
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        s.close()
