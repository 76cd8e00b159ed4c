"""Service building blocks without processes: config validation, request validation, admission."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from stepwatch.exporter.ledger import LedgerModel
from stepwatch.service import api
from stepwatch.service.config import ConfigError, PoolConfig, load, parse
from stepwatch.service.knobs import KnobGate
from stepwatch.service.queue import LedgerParams, Predictor, QueueFull, Scheduler


def test_embedded_default_config_is_valid() -> None:
    cfg = load()
    assert cfg.port == 8000 and cfg.host == "127.0.0.1"
    assert cfg.pool_for("512x512").name == "small" and cfg.pool_for("2048x2048").name == "large"
    assert cfg.pool_for("384x384").name == "other"
    assert "512x512_8s" in cfg.serving_shapes() and "512x512_8s_cfg" in cfg.serving_shapes()
    assert parse(cfg.to_raw()) == cfg  # what the worker receives parses back identically
    assert not any(s.startswith("512x512_50s") for s in cfg.serving_shapes())  # 50 steps fold into "other"


def test_served_steps_get_shape_labels_of_their_own() -> None:
    cfg = parse({"pools": {"small": {"sizes": ["256x256"]}}, "served_steps": [50, 28], "warmup": []})
    assert cfg.serving_shapes() == ["256x256_28s", "256x256_28s_cfg", "256x256_50s", "256x256_50s_cfg",
                                    "256x256_8s", "256x256_8s_cfg"]
    assert parse(cfg.to_raw()) == cfg


@pytest.mark.parametrize("raw,key", [
    ({"port": "80"}, "port"),
    ({"compile": {"backend": "tvm"}}, "compile.backend"),
    ({"compile": {"speed": 1}}, "compile.speed"),
    ({"cache": {"kind": "teacache"}}, "cache.kind"),
    ({"warmup": ["500x500"]}, "warmup[0]"),
    ({"pools": {"small": {"sizes": ["256x256"], "slo_seconds": -1}}}, "pools.small.slo_seconds"),
    ({"pools": {"a": {"sizes": ["256x256"]}, "b": {"sizes": ["256x256"]}}}, "pools.b.sizes"),
    ({"pools": {"Big Pool": {"sizes": []}}}, "pools.Big Pool"),
    ({"ranks": 3}, "ranks"),
    ({"served_steps": [8, 51]}, "served_steps"),
    ({"served_steps": 50}, "served_steps"),
    ({"admin_token": "short"}, "admin_token"),
    ({"memory_budget_mb": 0}, "memory_budget_mb"),
    ({"colour": "blue"}, "colour"),
    ({"model": "/nonexistent/model"}, "model"),
    ({"pools": {"other": {"sizes": ["256x256"]}}}, "pools.other"),
    ({"other_pool": {"sizes": ["256x256"]}}, "other_pool.sizes"),
    ({"pools": {"a": {"sizes": ["4096x4096"]}}}, "pools.a.sizes[0]"),
    ({"request_timeout_seconds": "600"}, "request_timeout_seconds"),
    ({"request_timeout_seconds": 0}, "request_timeout_seconds"),
    ({"queue": {"max_queued": 0}}, "queue.max_queued"),
    ({"queue": {"aging": -1}}, "queue.aging"),
    ({"cache": {"threshold": -0.1}}, "cache.threshold"),
    ({"default_size": "2048x2048", "max_pixels": 1024 * 1024}, "default_size"),
    ({"max_side": 0}, "max_side"),
    ({"dtype": "float33"}, "dtype"),
    ({"baselines": "/nonexistent/baselines.yaml"}, "baselines"),
    ({"thresholds_profile": "staging"}, "thresholds_profile"),
    ({"thresholds": "/nonexistent/thresholds.yaml"}, "thresholds"),
    ({"weights_damage": {"layer": "transformer_blocks.0"}}, "weights_damage"),
    ({"weights_damage": {"layer": "transformer_blocks.0", "noise": 0}}, "weights_damage"),
    ({"weights_damage": {"layer": "", "noise": 1.0}}, "weights_damage"),
])
def test_bad_config_names_the_key(raw: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse(raw)
    assert str(e.value).startswith(key + ":") or str(e.value).startswith(key + " "), str(e.value)


def test_pool_sizes_are_canonical() -> None:
    cfg = parse({"pools": {"a": {"sizes": ["0512X512"]}}})
    assert cfg.pools[0].sizes == ["512x512"] and cfg.pool_for("512x512").name == "a"


def test_config_file_errors(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load(bad)


CFG = parse({"max_n": 4, "max_side": 2048, "default_size": "512x512", "default_steps": 8})


@pytest.mark.parametrize("body,param,code", [
    ({}, "prompt", "missing_required_parameter"),
    ({"prompt": 3}, "prompt", "invalid_type"),
    ({"prompt": "  "}, "prompt", "invalid_value"),
    ({"prompt": "x" * 5000}, "prompt", "invalid_value"),
    ({"prompt": "a", "size": "250x256"}, "size", "invalid_size"),
    ({"prompt": "a", "size": "big"}, "size", "invalid_size"),
    ({"prompt": "a", "size": "\u00b2x512"}, "size", "invalid_size"),  # '²'.isdigit() is True, int('²') fails
    ({"prompt": "a \ud800"}, "prompt", "invalid_value"),  # a lone surrogate: valid JSON, not encodable
    ({"prompt": "a", "size": 512}, "size", "invalid_type"),
    ({"prompt": "a", "size": "4096x4096"}, "size", "size_too_large"),
    ({"prompt": "a", "n": 0}, "n", "invalid_value"),
    ({"prompt": "a", "n": 9}, "n", "invalid_value"),
    ({"prompt": "a", "n": "2"}, "n", "invalid_type"),
    ({"prompt": "a", "n": True}, "n", "invalid_type"),
    ({"prompt": "a", "steps": 0}, "steps", "invalid_value"),
    ({"prompt": "a", "guidance_scale": "high"}, "guidance_scale", "invalid_type"),
    ({"prompt": "a", "seed": -1}, "seed", "invalid_value"),
    ({"prompt": "a", "response_format": "url"}, "response_format", "invalid_value"),
])
def test_bad_requests_get_400_with_the_field(body: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(api.ApiError) as e:
        api.validate(body, CFG)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code)
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_good_request_defaults_and_shape() -> None:
    r = api.validate({"prompt": "a cat", "size": "1024x768", "guidance_scale": 3.5, "seed": 7,
                      "model": "ignored", "quality": "hd"}, CFG)
    assert (r.width, r.height, r.steps, r.n, r.seed) == (1024, 768, 8, 1, 7)
    assert r.shape == "1024x768_8s_cfg" and r.size == "1024x768"  # width first, as the API's size
    with pytest.raises(api.ApiError) as e:
        api.parse_json(b"{not json")
    assert e.value.status == 400 and e.value.code == "invalid_json"
    with pytest.raises(api.ApiError) as e:
        api.parse_json(b"[1, 2]")
    assert e.value.code == "invalid_json"
    with pytest.raises(api.ApiError) as e:
        api.parse_json(b" " * (api.MAX_BODY_BYTES + 1))
    assert e.value.status == 413


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def req(size: int, steps: int = 8) -> api.GenerationRequest:
    return api.GenerationRequest("p", 1, size, size, steps, 1.0, 0)


def make_scheduler(clock: FakeClock, policy: str = "spf", aging: float = 1.0) -> Scheduler:
    pred = Predictor()
    for size, sec in ((256, 1.0), (512, 4.0), (1024, 16.0)):
        for _ in range(3):
            pred.observe(req(size), sec, {})
    pools = [PoolConfig("small", ["256x256", "512x512"], 10, 40), PoolConfig("large", ["1024x1024"], 60, 120)]
    return Scheduler(pools, pred, policy, aging, clock=clock)


def test_shortest_predicted_first() -> None:
    clock = FakeClock()
    s = make_scheduler(clock)
    big = s.submit(req(1024), "large")
    mid = s.submit(req(512), "small")
    small = s.submit(req(256), "small")
    assert [s.take(0), s.take(0), s.take(0)] == [small, mid, big]


def test_aging_prevents_starvation() -> None:
    clock = FakeClock()
    s = make_scheduler(clock)
    big = s.submit(req(1024), "large")  # predicted 16 s
    clock.t += 20  # it has waited 20 s: priority 16 - 20 = -4
    s.submit(req(256), "small")  # predicted 1 s, priority 1
    assert s.take(0) is big


def test_fifo_policy() -> None:
    clock = FakeClock()
    s = make_scheduler(clock, policy="fifo")
    big = s.submit(req(1024), "large")
    small = s.submit(req(256), "small")
    assert [s.take(0), s.take(0)] == [big, small]


def test_estimated_wait_and_hard_limit() -> None:
    clock = FakeClock()
    s = make_scheduler(clock)
    s.submit(req(512), "small")  # 4 s
    s.submit(req(512), "small")  # 4 s
    s.submit(req(1024), "large")  # 16 s
    snap = s.snapshot()
    # A typical small request waits for the two small ones (the large one goes after it).
    assert snap["small"]["estimated_wait"] == pytest.approx(8.0)
    # A typical large request waits for everything queued (its own pool and the shorter ones).
    assert snap["large"]["estimated_wait"] == pytest.approx(24.0)
    assert snap["small"]["depth"] == 2 and snap["large"]["depth"] == 1
    t = s.take(0)
    assert t is not None and t.predicted == pytest.approx(4.0)
    clock.t += 1  # in flight for 1 s: 3 s left
    assert s.snapshot()["small"]["estimated_wait"] == pytest.approx(3.0 + 4.0)
    # Fill the small pool to 3 + 10 x 4 = 43 s of wait, past its 40 s limit: refused with a retry hint.
    for _ in range(9):
        s.submit(req(512), "small")
    with pytest.raises(QueueFull) as e:
        s.submit(req(512), "small")
    assert e.value.estimated_wait == pytest.approx(43.0) and e.value.retry_after == 3
    s.done(t)


def test_predictor_uses_ledger_for_unseen_shapes() -> None:
    pred = Predictor()
    model = LedgerModel("flux", {"joint": 1e6}, {"joint": 64.0}, (1, 2, 2))
    pred.ledger = LedgerParams(model, vae_scale=8, text_tokens=32)
    r256 = req(256)
    flops = pred.ledger.step_flops(256, 256, False) * 8
    pred.observe(r256, 2.0, {"denoise": 1.0})
    # Unseen 512^2: denoise scales with FLOPs at the observed rate, the rest with pixels.
    r512 = req(512)
    expected = pred.ledger.step_flops(512, 512, False) * 8 / flops + 1.0 * 4
    assert pred.predict(r512) == pytest.approx(expected)
    for _ in range(3):
        pred.observe(r512, 9.0, {"denoise": 5.0})
    assert pred.predict(r512) == 9.0  # enough observations: the shape's median wins


def test_ranks_sharing_cpus_split_the_threads() -> None:
    """Unpinned ranks each see every CPU; one thread per CPU each would oversubscribe the machine."""
    from stepwatch.service.ranks import rank_threads  # imports torch: only this test pays for it

    assert rank_threads([[0, 1, 2, 3], [0, 1, 2, 3]]) == [2, 2]
    assert rank_threads([[0, 1], [2, 3]]) == [2, 2]
    assert rank_threads([[0], [0]]) == [1, 1]
    assert rank_threads([[0, 1, 2, 3]]) == [4]


def test_a_knob_call_goes_before_the_next_generation_and_after_the_one_in_flight() -> None:
    """A re-warming knob call must never be timed as a generation in flight (the cache-off drill's false stall)."""
    gate, order = KnobGate(), []
    in_flight, knob_waiting = threading.Event(), threading.Event()

    def generation(name: str, hold: float) -> None:
        with gate.generation():
            order.append(f"{name} starts")
            in_flight.set()
            time.sleep(hold)
            order.append(f"{name} ends")

    def knob_call() -> None:
        knob_waiting.set()
        with gate.knobs():
            order.append("knobs start")
            time.sleep(0.2)  # a re-warm
            order.append("knobs end")

    first = threading.Thread(target=generation, args=("g1", 0.3))
    first.start()
    in_flight.wait(5)
    knob = threading.Thread(target=knob_call)
    knob.start()
    knob_waiting.wait(5)
    time.sleep(0.05)
    second = threading.Thread(target=generation, args=("g2", 0.0))  # queued behind the knob call
    second.start()
    for t in (first, knob, second):
        t.join(5)
    assert order == ["g1 starts", "g1 ends", "knobs start", "knobs end", "g2 starts", "g2 ends"]


def test_a_client_is_told_an_errors_first_line_with_no_path_or_traceback() -> None:
    from stepwatch.service.messages import internal_message

    try:
        raise RuntimeError('No kernel for scaled_dot_product_attention\n  File "/srv/app/x.py", line 3, in f')
    except RuntimeError as e:
        said = internal_message(e)
    assert "scaled_dot_product_attention" in said and "RuntimeError" in said
    assert "/srv" not in said and "File" not in said
    assert internal_message(OSError("cannot open /opt/models/flux/vae.bin: no such file")) == (
        "internal error (OSError: cannot open <path>: no such file); the service's log has the details")
    try:
        try:
            raise RuntimeError("No viable backend for scaled_dot_product_attention was found")
        except RuntimeError as inner:
            raise ValueError("RuntimeError when making fake tensor call") from inner
    except ValueError as e:
        said = internal_message(e)
    assert said == ("internal error (ValueError: RuntimeError when making fake tensor call <- RuntimeError: No viable "
                    "backend for scaled_dot_product_attention was found); the service's log has the details")


def test_damaged_weights_change_one_module_and_not_the_digest_taken_before() -> None:
    """The replica-bad-weights fault: noise on the named module's weight matrices only; an unknown module is
    refused by name."""
    import torch

    from stepwatch.service.pipeline import build_pipeline, damage_weights

    pipe = build_pipeline("flux", seed=0)
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    assert damage_weights(pipe, "transformer_blocks.0", 1.0) > 0
    after = pipe.transformer.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("transformer_blocks.0.") for k in changed)
    with pytest.raises(ValueError, match=r"no module 'blocks\.9'"):
        damage_weights(pipe, "blocks.9", 1.0)
