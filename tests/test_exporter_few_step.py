"""What distillation changes, as the exporter sees it: few-step requests, their cache hits, the FLOPs ledger.

Values are read back from the registry; the real tiny FLUX pipeline runs the requests.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from stepwatch.exporter import instrument
from stepwatch.exporter.shapes import ShapeKey
from stepwatch.thresholds import ThresholdsError, load, parse
from tests.promtext import absent, scrape, total, value


def gen(pipe: Any, steps: int, seed: int = 0, **kw: Any) -> Any:
    return pipe("w1 w2 w3", height=256, width=256, num_inference_steps=steps, max_sequence_length=32,
                output_type="np", generator=torch.Generator().manual_seed(seed), **kw)


def test_few_step_line_comes_from_the_thresholds() -> None:
    th = load()
    assert th.few_step_max_steps == 4
    assert ShapeKey.parse("1024x1024_4s").few_step(4)
    assert not ShapeKey.parse("1024x1024_4s_cfg").few_step(4)  # CFG: not a distilled model's request
    assert not ShapeKey.parse("512x512_8s").few_step(4)
    assert ShapeKey.parse("832x480x81_3s").few_step(4)  # FastWan
    raw = {**_raw(), "few_step": {"max_steps": 0}}
    with pytest.raises(ThresholdsError, match=r"few_step\.max_steps"):
        parse(raw)


def _raw() -> dict[str, Any]:
    import yaml

    from stepwatch.thresholds import default_path

    data: dict[str, Any] = yaml.safe_load(default_path().read_text())
    return data


def test_cache_hits_on_few_step_requests_are_counted_apart(clean_flux: Any, registry: Any) -> None:
    """Hits on a 4-step request without CFG count in stepwatch_cache_few_step_hits_total; an 8-step request's
    hits (a model that may use a cache) do not, and warm-up's forced hits never do."""
    from stepwatch.service.cache import apply_cache

    apply_cache(clean_flux, "first_block_cache", 1e9)  # every middle step reuses the cache
    inst = instrument(clean_flux, registry=registry, few_step_max_steps=4)
    with inst.warmup():
        gen(clean_flux, steps=4)
    assert absent(scrape(registry), "stepwatch_cache_few_step_hits_total")
    gen(clean_flux, steps=8)
    data = scrape(registry)
    assert value(data, "stepwatch_cache_decisions_total", shape="256x256_8s", cache="first_block_cache",
                 decision="hit") == 6
    assert absent(data, "stepwatch_cache_few_step_hits_total")
    gen(clean_flux, steps=4)
    r = inst.last_report
    assert r is not None and r.extra.get("few_step") is True and r.hits == 2  # steps 2 and 3 of 4
    data = scrape(registry)
    assert value(data, "stepwatch_cache_few_step_hits_total", shape="256x256_4s", cache="first_block_cache") == 2
    assert total(data, "stepwatch_cache_few_step_hits_total") == 2


def test_a_cancelled_call_is_not_an_error(clean_flux: Any, registry: Any) -> None:
    """A host that stops a call on purpose (a video job cancelled mid-run) raises an exception marked
    ``stepwatch_outcome = "cancelled"``: counted as cancelled, never as an error (the error runbooks read it)."""

    class Cancelled(Exception):
        stepwatch_outcome = "cancelled"

    def stop(_p: Any, i: int, _t: Any, kw: dict[str, Any]) -> dict[str, Any]:
        if i == 1:
            raise Cancelled("cancelled by its client")
        return kw

    instrument(clean_flux, registry=registry)
    with pytest.raises(Cancelled):
        gen(clean_flux, steps=4, callback_on_step_end=stop)
    data = scrape(registry)
    assert value(data, "stepwatch_pipeline_requests_total", shape="256x256_4s", outcome="cancelled") == 1
    assert total(data, "stepwatch_pipeline_requests_total", outcome="error") == 0


def _flux_ledger(guidance_embeds: bool) -> Any:
    from diffusers import FluxTransformer2DModel

    from stepwatch.exporter.ledger import ledger_model

    with torch.device("meta"):
        t = FluxTransformer2DModel(guidance_embeds=guidance_embeds)
    return ledger_model(t)


def test_ledger_flux_dev_to_schnell_per_image() -> None:
    """The seeds: FLUX.1-dev, 28 steps, guidance-distilled (g = 1), 2.08 PFLOP per 1024^2 image; FLUX.1-schnell,
    4 steps, 0.30 PFLOP: the ledger's request totals within 2% of both."""
    dev, schnell = _flux_ledger(True), _flux_ledger(False)
    dev_total = 28 * 1 * dev.forward_flops(4096, 512)  # steps x CFG branches x one forward
    schnell_total = 4 * 1 * schnell.forward_flops(4096, 512)
    assert dev_total == pytest.approx(2.08e15, rel=0.02)
    assert schnell_total == pytest.approx(0.30e15, rel=0.02)
    # Same transformer per token (dev's guidance embedding runs once per sample): 28 / 4 steps.
    assert dev_total / schnell_total == pytest.approx(7.0, rel=1e-4)


def test_ledger_totals_of_a_served_few_step_request(clean_flux: Any, registry: Any) -> None:
    """The exporter's FLOPs counter of a 4-step request without CFG is the ledger's request total."""
    inst = instrument(clean_flux, registry=registry, peak_flops=1e12)
    gen(clean_flux, steps=4)
    lm = inst._ledger
    assert lm is not None
    expected = 4 * lm.forward_flops(lm.tokens(256, 256, None, 8, 4), 32)
    assert value(scrape(registry), "stepwatch_ledger_flops_total", shape="256x256_4s") == pytest.approx(expected)
