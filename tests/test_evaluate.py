"""Pre-launch evaluation on the tiny practice pipelines: the report, the sweep and its working point, the written
config, determinism, and the seeds' worked example as arithmetic.  Eager and at 64^2, so seconds, not minutes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from stepwatch.bench import capacity, determinism, sweep_output
from stepwatch.bench.eval_quality import json_safe
from stepwatch.bench.eval_runner import Runner, Setting, parse_shape
from stepwatch.bench.evaluate import evaluate, to_markdown
from stepwatch.bench.sweep import Gate, run_sweep, sweep_shape
from stepwatch.cli import main
from stepwatch.service.config import ConfigError, default_path, load
from stepwatch.thresholds import load as load_thresholds

EAGER = {"compile": {"enabled": False}}
VALUES = [0.3, 0.7, 0.9, 1.6]
# An A/A's speedup at 6 items of 64^2 ranged 0.958-1.067 in 40 runs (sd 0.03); a 95% interval misses 1 one run in
# twenty by design, so a test asserts the estimate within 5 sd, not the interval.
AA_MARGIN = 0.15


@pytest.fixture(scope="module")
def cfg() -> Any:
    return load(overrides=EAGER)


@pytest.fixture(scope="module")
def swept(cfg: Any) -> dict[str, Any]:
    return run_sweep(cfg, "cache-threshold", [parse_shape("64x64", cfg)], load_thresholds(), VALUES, images=6)


def test_worked_example_one_from_the_ledger_and_the_instance_formula() -> None:
    """Seeds, article three, example one: FLUX.1-dev 1024^2, 28 steps, eager MFU 0.31 on an H100 -> 6.7 s; after
    compile, FP8 and a 1.6x cache, 1.8 s -> 100 x 1.8 x 1.3 = ~230 GPUs (29 machines of 8); schnell 0.8 s -> ~105."""
    from stepwatch.bench.ledger_real import REAL_CONFIGS, real_row

    flops = real_row(REAL_CONFIGS[0])["ledger_flops"]
    eager = capacity.seconds_from_ledger(flops, 28, capacity.H100_BF16_DENSE_FLOPS, 0.31)
    assert eager == pytest.approx(6.7, rel=0.03)
    dev = capacity.gpus_for(100, 1.8)
    assert dev == pytest.approx(234) and round(dev, -1) == 230 and capacity.machines_for(dev) == 29
    assert capacity.gpus_for(100, 0.8) == pytest.approx(104) and abs(capacity.gpus_for(100, 0.8) - 105) < 2
    with pytest.raises(ValueError):
        capacity.gpus_for(100, 1.8, headroom=0.5)


def test_evaluate_reports_every_field_per_shape(cfg: Any) -> None:
    shapes = [parse_shape("64x64", cfg), parse_shape("64x64x5", cfg)]
    rep = evaluate(cfg, shapes, images=4)
    json.dumps(json_safe(rep), allow_nan=False)
    assert rep["engine"].startswith("diffusers ") and rep["precision"] == "float32"
    assert rep["device"]["type"] == "cpu" and rep["shapes"][0]["compile"] == "off (eager)"
    assert "not measured" in rep["lpips"]
    image, video = rep["shapes"]
    assert (image["shape"], image["steps"], image["cfg"], image["kind"]) == ("64x64_8s", 8, "off", "image")
    assert image["cache"]["kind"] == "first_block_cache" and image["cache"]["threshold"] == 0.7
    assert 0 < image["cache"]["hit_ratio"] < 1
    assert image["step_ms"]["n"] == 4 * 8 and image["step_ms"]["median"] > 0
    assert all(image["stages_ms"][k] > 0 for k in ("text_encode", "denoise", "vae_decode"))
    assert image["end_to_end_s"] > 0 and image["peak_memory_gib"] > 0
    assert image["throughput"]["unit"] == "images" and image["throughput"]["per_second_per_device"] > 0
    q = image["quality"]
    assert 20 < q["psnr"]["p10"] <= q["psnr"]["p50"] and q["psnr"]["p10_interval"][0] <= q["psnr"]["p10"]
    assert 0 < q["ssim"]["p10"] <= 1 and q["identical"] < 4  # the cache hit: not the baseline's bytes
    assert video["frames"] == 5 and video["throughput"]["unit"] == "frames" and "worst_frame" in video["quality"]
    text = to_markdown(rep)
    assert "## 64x64_8s" in text and "per step" in text and "PSNR p50" in text


def test_a_lossless_config_reads_identical_and_no_speedup() -> None:
    """The control: no lossy option configured, so the set rendered again (an A/A) is the baseline's byte for
    byte, at about the same speed; and the first-block cache at threshold 0 (the baseline when a first-block cache
    is configured) gives the cache-off image."""
    cfg = load(overrides={**EAGER, "cache": {"kind": "none", "threshold": 0.5}})
    shape = parse_shape("64x64", cfg)
    runner = Runner(cfg)
    off = runner.render(shape, Setting("none", None), 2)
    zero = runner.render(shape, Setting("first_block_cache", 0.0), 2)
    assert np.array_equal(off.output, zero.output) and zero.decisions == 8 and zero.hits == 0
    row = evaluate(cfg, [shape], images=4)["shapes"][0]
    assert row["quality"]["identical"] == 4 and math.isinf(row["quality"]["psnr"]["p10"])
    assert row["speedup_vs_baseline"]["ratio"] == pytest.approx(1.0, abs=AA_MARGIN)


def test_sweep_curve_intervals_and_a_working_point_inside_the_gate(swept: dict[str, Any]) -> None:
    row = swept["shapes"][0]
    assert [p["value"] for p in row["curve"]] == VALUES
    for p in row["curve"]:
        lo, hi = p["speedup_interval"]
        assert lo <= p["speedup"] <= hi
        qlo, qhi = p["quality"]["psnr"]["p10_interval"]
        assert qlo <= p["quality"]["psnr"]["p10"] <= qhi
    aa = row["a_a"]
    assert aa["speedup"] == pytest.approx(1.0, abs=AA_MARGIN) and math.isinf(aa["quality"]["psnr"]["p10"])
    hits = [p["hit_ratio"] for p in row["curve"]]
    assert hits == sorted(hits) and hits[-1] > hits[0]  # a higher threshold reuses more steps
    passing = [p for p in row["curve"] if p["quality"]["psnr"]["p10_interval"][0] >= 30.0]
    assert passing and len(passing) < len(row["curve"])  # the gate separates the values
    wp = row["working_point"]
    assert wp["value"] == max(passing, key=lambda p: p["speedup"])["value"]
    assert wp["psnr_p10"] >= row["gate"]["psnr_db"] == 30.0


def test_a_gate_nothing_meets_leaves_no_working_point(cfg: Any) -> None:
    runner = Runner(cfg)
    row = sweep_shape(runner, "cache-threshold", [0.7, 1.6], parse_shape("64x64", cfg), 3, Gate(500.0, None, "x"))
    assert row["working_point"] is None and "gate" in row["why_none"]


def test_a_cache_is_not_swept_on_a_few_step_shape(cfg: Any) -> None:
    res = run_sweep(cfg, "cache-threshold", [parse_shape("64x64_4s", cfg)], load_thresholds(), [0.7], images=2)
    assert "few-step" in res["shapes"][0]["skipped"]


def test_write_config_stores_the_working_point_and_the_alert_baselines(swept: dict[str, Any], tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load(default_path().read_text())
    raw["pools"]["small"]["sizes"].append("64x64")  # the swept shape must be one the service serves
    Path("source.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="not a serving shape"):
        sweep_output.write_config(swept, None, "unserved.yaml")
    out, base, _ = sweep_output.write_config(swept, "source.yaml", "tuned.yaml")
    wp = swept["shapes"][0]["working_point"]
    tuned = load(out)
    assert tuned.shape_cache == {"64x64_8s": {"threshold": float(wp["value"])}}
    assert tuned.baselines == str(base) and base.name == "tuned.baselines.yaml"
    shapes = yaml.safe_load(base.read_text())["shapes"]
    assert shapes["64x64_8s"]["step_seconds"] == pytest.approx(wp["step_seconds"], rel=1e-3)
    assert shapes["64x64_8s"]["cache_hit_ratio"] == pytest.approx(wp["hit_ratio"], abs=1e-3)
    assert Setting("first_block_cache", float(wp["value"])) == _configured(tuned)
    nothing = {**swept, "shapes": [{**swept["shapes"][0], "working_point": None}]}
    with pytest.raises(ConfigError):
        sweep_output.write_config(nothing, "source.yaml", "none.yaml")
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(("none", "unserved"))]


def _configured(cfg: Any) -> Setting:
    from stepwatch.bench.eval_runner import configured

    return configured(cfg, parse_shape("64x64", cfg))


def test_the_curve_is_drawn(swept: dict[str, Any], tmp_path: Path) -> None:
    png = sweep_output.plot(swept, tmp_path / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_the_cli_prints_json_curves_and_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sweep", "cache-threshold", "--shapes", "64x64", "--images", "3", "--no-compile", "--json",
            "--plot", str(tmp_path / "c.png"), "--values", "0.3", "0.7", "0.9", "1.6"]
    assert main(argv) == 0
    row = json.loads(capsys.readouterr().out)["shapes"][0]
    assert len(row["curve"]) == 4 and all(len(p["speedup_interval"]) == 2 for p in row["curve"])
    for bad in (["evaluate", "--images", "0"], ["evaluate", "--shapes", "63x64"],
                ["sweep", "cache-threshold", "--values", "-1", "--shapes", "64x64", "--no-compile"],
                ["sweep", "cache-kind", "--values", "lru", "--shapes", "64x64", "--no-compile"],
                ["sweep", "cache-threshold", "--values", "high", "--shapes", "64x64", "--no-compile"],
                ["sweep", "steps", "--gate", "lossy_iii", "--shapes", "64x64", "--no-compile"]):
        assert main(bad) == 2, bad
        err = capsys.readouterr().err
        assert err.startswith("stepwatch ") and "Traceback" not in err


def test_determinism_within_a_deployment_and_across_a_restart(cfg: Any) -> None:
    rep = determinism.determinism(cfg, [parse_shape("64x64", cfg)], images=2)
    assert rep["bit_exact"] is True and rep["suspects"] == []
    row = rep["shapes"][0]
    assert row["within_deployment"] == [] and row["across_restart"] == [] and len(row["digests"]) == 2
    assert rep["settings"]["first"]["threads"] == rep["settings"]["restart"]["threads"]


def test_a_difference_is_named_with_its_psnr_and_its_suspects(cfg: Any) -> None:
    a = [np.zeros((8, 8, 3), np.uint8), np.full((8, 8, 3), 100, np.uint8)]
    b = [a[0].copy(), a[1].copy()]
    b[1][0, 0, 0] = 110
    diff = determinism.compare(a, b)
    assert [d["item"] for d in diff] == [1] and 40 < diff[0]["psnr"] < 80
    here = {"threads": 2, "torch": "2.13.0", "deterministic_algorithms": False}
    named = determinism.suspects(cfg, here, {**here, "threads": 1})
    assert any("threads differs" in s for s in named)


def test_the_worker_runs_each_shape_at_its_own_threshold_until_a_knob_says_otherwise() -> None:
    from types import SimpleNamespace

    from stepwatch.service.api import GenerationRequest
    from stepwatch.service.cache import _leader, apply_cache, current
    from stepwatch.service.worker_requests import Requests

    tuned = load(overrides={**EAGER, "shape_cache": {"512x512_8s": {"threshold": 0.3}}})
    pipe, _ = Runner(tuned).pipeline(False)
    apply_cache(pipe, "first_block_cache", 0.7)
    hook = _leader(pipe.transformer, "fbc_leader_block_hook")
    worker = SimpleNamespace(cfg=tuned, knobs={"cache": "first_block_cache", "cache_threshold": 0.7}, pipe=pipe,
                             _stamp=None)

    def threshold_after(width: int) -> float | None:
        Requests._shape_cache(worker, GenerationRequest("p", 1, width, width, 8, 1.0, 0))  # type: ignore[arg-type]
        return current(pipe.transformer)[1]

    assert threshold_after(512) == 0.3 and threshold_after(256) == 0.7 and threshold_after(512) == 0.3
    assert _leader(pipe.transformer, "fbc_leader_block_hook") is hook  # edited in place: nothing recompiles
    worker.knobs["cache_threshold"] = 0.9  # an operator's knob applies to every shape
    assert threshold_after(512) == 0.9 and threshold_after(256) == 0.9
    worker.knobs["cache_threshold"] = 0.7  # back at the start-up value: the shapes' own again
    assert threshold_after(512) == 0.3


@pytest.mark.parametrize(("shape_cache", "cache", "says"), [
    ({"500x500_8s": {"threshold": 0.5}}, None, "not a serving shape"),
    ({"512x512_8s": {"threshold": -1}}, None, "must be a finite number"),
    ({"512x512_8s": {"kind": "mag_cache"}}, None, "expected {threshold: number}"),
    ({"512x512_8s": {"threshold": 0.5}}, {"kind": "mag_cache", "threshold": 0.06}, "need cache.kind first_block"),
])
def test_a_bad_shape_cache_is_refused_with_its_key(shape_cache: Any, cache: Any, says: str) -> None:
    with pytest.raises(ConfigError, match="shape_cache") as e:
        load(overrides={"shape_cache": shape_cache, "cache": cache})
    assert says in str(e.value)


def test_a_tuned_config_serves_its_hits_without_recompiling() -> None:
    """The worker's warm-up forces cache hits so that no hit compiles while serving; a shape's own threshold must
    not undo that forcing (it did: every 512^2 request of a swept config recompiled, and paged)."""
    from dataclasses import asdict

    from stepwatch.service.api import GenerationRequest
    from stepwatch.service.worker import Worker

    raw = {"warmup": ["256x256"], "pools": {"small": {"sizes": ["256x256"]}}, "memory_budget_mb": None,
           "compile": {"enabled": True, "backend": "eager"}, "video": {"enabled": False},
           "cache": {"kind": "first_block_cache", "threshold": 0.7}, "shape_cache": {"256x256_8s": {"threshold": 1.6}}}
    worker = Worker(raw, conn=None)
    worker.setup()
    try:
        for seed in (1, 2):
            req = asdict(GenerationRequest("a red fox", 1, 256, 256, 8, 1.0, seed))
            assert worker.generate({"op": "generate", "id": str(seed), "request": req})["op"] == "result"
            rep = worker.inst.last_report
            hits = "".join("H" if h else "." for _, _, h in rep.cache_decisions)
            assert "HH" in hits and rep.compiles == [], (hits, rep.compiles)
    finally:
        worker.inst.remove()


def test_cache_kind_and_steps_sweeps(cfg: Any, tmp_path: Path) -> None:
    """Every kind hits and keeps some quality; fewer steps are faster and, on the practice model, under the gate;
    a kind sweep writes ``cache.kind``, a steps sweep labels its baselines with the working steps."""
    th, shape = load_thresholds(), parse_shape("64x64", cfg)
    kinds = run_sweep(cfg, "cache-kind", [shape], th, None, images=3)
    curve = kinds["shapes"][0]["curve"]
    assert [p["value"] for p in curve] == ["first_block_cache", "mag_cache", "taylorseer"]
    assert all(p["hit_ratio"] > 0 and p["quality"]["psnr"]["p10"] > 20 for p in curve)
    steps = run_sweep(cfg, "steps", [shape], th, ["2", "6"], images=3)["shapes"][0]
    two, six = steps["curve"]
    assert two["speedup"] > six["speedup"] > 1 and two["quality"]["psnr"]["p10"] < six["quality"]["psnr"]["p10"]
    wp = kinds["shapes"][0]["working_point"]
    raw = yaml.safe_load(default_path().read_text())
    raw["pools"]["small"]["sizes"].append("64x64")
    (tmp_path / "src.yaml").write_text(yaml.safe_dump(raw))
    out, _, _ = sweep_output.write_config(kinds, str(tmp_path / "src.yaml"), tmp_path / "kind.yaml")
    assert load(out).cache.kind == wp["value"]
    fake = {"sweep": "steps", "shapes": [{"shape": "64x64_8s_cfg", "working_point": {**wp, "value": 6}}]}
    assert list(sweep_output.baselines(fake)["shapes"]) == ["64x64_6s_cfg"]
