"""torch.compile attribution, real OOMs under a memory budget, determinism across processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from stepwatch.exporter import instrument
from tests.promtext import scrape, value


def gen(pipe: Any, hw: int, steps: int = 2) -> Any:
    return pipe("w1 w2", height=hw, width=hw, num_inference_steps=steps, max_sequence_length=32, output_type="np")


def _compile_case(backend: str, registry: Any) -> None:
    import torch._dynamo
    import torch._dynamo.utils as du

    from stepwatch.service.pipeline import build_pipeline

    torch._dynamo.reset()
    try:
        pipe = build_pipeline("flux", seed=0)
        inst = instrument(pipe, registry=registry)
        pipe.transformer.compile(backend=backend, dynamic=False)
        frames = lambda: du.counters["frames"]["ok"]  # noqa: E731
        f0 = frames()
        with inst.warmup():
            gen(pipe, 256)
        warm = frames() - f0
        assert warm >= 1
        data = scrape(registry)
        assert value(data, "stepwatch_compile_total", shape="256x256_2s", phase="warmup") == warm
        assert value(data, "stepwatch_compile_total", shape="256x256_2s", phase="serving") == 0
        # Serving: a warmed shape compiles nothing, a new shape compiles exactly what Dynamo reports.
        f1 = frames()
        gen(pipe, 256)
        assert frames() == f1
        gen(pipe, 320)
        new = frames() - f1
        assert new >= 1
        gen(pipe, 320)
        assert frames() - f1 == new
        data = scrape(registry)
        assert value(data, "stepwatch_compile_total", shape="256x256_2s", phase="serving") == 0
        assert value(data, "stepwatch_compile_total", shape="320x320_2s", phase="serving") == new
        assert value(data, "stepwatch_compile_duration_seconds_count", shape="320x320_2s", phase="serving") == new
        assert value(data, "stepwatch_compile_duration_seconds_sum", shape="320x320_2s", phase="serving") > 0
        r = inst.last_report
        assert r is not None and r.compiles == []
    finally:
        torch._dynamo.reset()  # no compiled frames or counters leak into the next test


def test_compile_events_cheap_backend(registry: Any) -> None:
    _compile_case("aot_eager", registry)


@pytest.mark.heavy
def test_compile_events_inductor(registry: Any) -> None:
    _compile_case("inductor", registry)


_OOM_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    from prometheus_client import CollectorRegistry
    from stepwatch.exporter import instrument
    from stepwatch.exporter.memory import _status
    from stepwatch.service.pipeline import build_pipeline
    from tests.promtext import scrape, value

    pipe = build_pipeline("flux", seed=0)
    reg = CollectorRegistry()
    inst = instrument(pipe, registry=reg)
    def gen(hw, tiled):
        (pipe.vae.enable_tiling if tiled else pipe.vae.disable_tiling)()
        return pipe("w1", height=hw, width=hw, num_inference_steps=2, max_sequence_length=32, output_type="np")
    gen(256, False)
    st = _status()
    resource.setrlimit(resource.RLIMIT_AS, (st["VmSize"] + 700 * 2**20, resource.RLIM_INFINITY))
    out = {}
    gen(2048, True)
    out["tiled_ok"] = inst.last_report.outcome
    try:
        gen(2048, False)
        out["untiled"] = "no error"
    except RuntimeError as e:
        out["untiled"] = type(e).__name__ + ": " + str(e)[:200]
    out["failed_stage"] = inst.last_report.failed_stage
    out["oom_ratio"] = inst.last_report.memory_peak_bytes["request"] / inst.last_report.memory_capacity_bytes
    img = gen(512, True).images
    out["next_ok"] = inst.last_report.outcome
    out["next_shape"] = list(img.shape)
    data = scrape(reg)
    out["oom_vae"] = value(data, "stepwatch_oom_total", shape="2048x2048_2s", stage="vae_decode")
    out["ratio_over_090"] = (value(data, "stepwatch_memory_peak_ratio_count", device="cpu")
                             - value(data, "stepwatch_memory_peak_ratio_bucket", device="cpu", le="0.9"))
    out["outcomes"] = {o: value(data, "stepwatch_pipeline_requests_total", shape=s, outcome=o)
                       for s, o in [("2048x2048_2s", "ok"), ("2048x2048_2s", "oom")]}
    print(json.dumps(out))
    """
)


@pytest.mark.heavy
def test_oom_under_memory_budget_is_counted_and_reraised() -> None:
    proc = subprocess.run([sys.executable, "-c", _OOM_SCRIPT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tiled_ok"] == "ok"
    assert out["untiled"].startswith("RuntimeError") and "can't allocate memory" in out["untiled"]
    assert out["failed_stage"] == "vae_decode"
    assert out["oom_ratio"] > 0.9  # the memory alert's threshold: demand passed 90% of capacity
    assert out["next_ok"] == "ok" and out["next_shape"] == [1, 512, 512, 3]
    assert out["oom_vae"] == 1
    assert out["ratio_over_090"] >= 1  # the OOM request is in the alert's histogram tail
    assert out["outcomes"] == {"ok": 1, "oom": 1}


_DIGEST_SCRIPT = textwrap.dedent(
    """
    import hashlib, torch
    from stepwatch.service.pipeline import build_pipeline, weights_digest
    pipe = build_pipeline("flux", seed=7)
    img = pipe("w1 w2", height=128, width=128, num_inference_steps=2, max_sequence_length=32, output_type="np",
               generator=torch.Generator().manual_seed(0)).images
    print(weights_digest(pipe), hashlib.sha256(img.tobytes()).hexdigest())
    """
)


def test_two_processes_build_bit_identical_pipelines() -> None:
    outs = [subprocess.run([sys.executable, "-c", _DIGEST_SCRIPT], capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for p in outs:
        assert p.returncode == 0, p.stderr[-2000:]
    a, b = (p.stdout.split() for p in outs)
    assert a == b and len(a[0]) == 64
    from stepwatch.service.pipeline import build_pipeline, weights_digest

    assert weights_digest(build_pipeline("flux", seed=8)) != a[0]  # the seed matters


def test_model_directory_round_trip(tmp_path: Any) -> None:
    """The same factory loads a real model directory (here: the tiny one, saved)."""
    from stepwatch.service.pipeline import build_pipeline, weights_digest

    tiny = build_pipeline("flux", seed=0)
    tiny.save_pretrained(tmp_path / "model")
    loaded = build_pipeline(model=tmp_path / "model")
    assert type(loaded).__name__ == "FluxPipeline"
    assert weights_digest(loaded) == weights_digest(tiny)
    with pytest.raises(FileNotFoundError, match=r"model_index\.json"):
        build_pipeline(model=tmp_path)
    loaded.set_progress_bar_config(disable=True)
    a = loaded("w1", height=128, width=128, num_inference_steps=2, max_sequence_length=32, output_type="np",
               generator=torch.Generator().manual_seed(0)).images
    b = tiny("w1", height=128, width=128, num_inference_steps=2, max_sequence_length=32, output_type="np",
             generator=torch.Generator().manual_seed(0)).images
    # Same weights; transformers' load path may differ in the last float bit of the T5 output.
    assert abs(a - b).max() < 1e-3


def test_gpu_check_dry_run_on_cpu() -> None:
    """The GPU check's code path, on the CPU (the sync check itself needs a GPU)."""
    p = subprocess.run([sys.executable, "-m", "stepwatch.cli", "gpu-check", "--device", "cpu", "--small", "--size",
                        "256", "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["checks"] == {"sync_detector_fires": True, "no_sync_in_hooks": True, "reports_resolved": True,
                             "event_times_match_sync_times": True}
    assert len(out["step_seconds_events"]) == 4 and out["exporter_errors"] == {}
    assert len(out["event_vs_sync_relative_diff"]) == 2
    if not __import__("torch").cuda.is_available():
        p = subprocess.run([sys.executable, "-m", "stepwatch.cli", "gpu-check"], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 2 and "no CUDA device" in p.stdout
