"""``stepwatch bench ledger``: eight diffusers families, CFG on and off, against FlopCounterMode.

The bench itself runs here (tiny models, seconds); a ledger that reads the request's size instead of what the
transformer received (PixArt's resolution binning) must fail it, and the transformer's call record must
survive a module compiled in place without a recompile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from stepwatch.bench import ledger as bench_ledger
from stepwatch.bench.ledger_families import FAMILIES
from stepwatch.bench.overhead import StubPipeline
from stepwatch.exporter import instrument, uninstrument
from stepwatch.exporter.request import RequestMarks, StepFlops


def test_every_family_labels_counts_and_ledgers_right(capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench_ledger.run(argparse.Namespace(family=None, real=False, json=True))
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = out["families"]
    assert rc == 0
    assert len({r["name"] for r in rows}) == 8 and len(rows) == 16
    assert {r["cfg_kind"] for r in rows} == {"true", "batched"}
    for r in rows:
        assert set(r) >= {"name", "pipeline", "label_ok", "cfg_branches_ok", "steps_ok", "ledger_flops",
                          "counted_flops", "ratio"}
        assert r["label_ok"] and r["cfg_branches_ok"] and r["steps_ok"], r
        assert 0.9 <= r["ratio"] <= 1.1, r
        assert r["calls"] == bench_ledger.STEPS * (2 if r["cfg"] and r["cfg_kind"] == "true" else 1)
    # The baseline, 2 x every parameter x the request's tokens, misses most families by more than 10%.
    assert sum(not 0.9 <= r["naive_ratio"] <= 1.1 for r in rows) >= 12


def _from_request_size(self: StepFlops, req: RequestMarks, samples: int) -> float:
    """The ledger as it was: tokens from the request's height and width at 8x, not from the call."""
    n = self.model.tokens(req.height or 0, req.width or 0, req.frames, 8, 4)
    return samples * self.model.forward_flops(n, req.text_tokens)


def test_a_ledger_of_the_request_size_fails_on_resolution_binning(monkeypatch: pytest.MonkeyPatch) -> None:
    """PixArt bins a 64^2 request to 256^2: counted from the request's size, the ratio is far below 0.9."""
    monkeypatch.setattr(StepFlops, "__call__", _from_request_size)
    fam = next(f for f in FAMILIES if f.name == "pixart-sigma")
    row = bench_ledger.check_family(fam, fam.build(), cfg=True)
    assert row["label"] == "64x64_2s_cfg" and row["cfg_branches_ok"]  # the label stays the request's
    assert row["ratio"] < 0.2 and not bench_ledger.passes(row)


class TinyTransformer(torch.nn.Module):
    """A real module with the hooks' cache_context, compiled in place before it is instrumented."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def cache_context(self, name: str) -> Any:
        return contextlib.nullcontext()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden_states).relu()


def test_a_transformer_compiled_in_place_is_recorded_without_a_recompile() -> None:
    from torch._dynamo.utils import counters

    pipe = StubPipeline(branches=2)
    tiny = TinyTransformer()
    tiny.compile(backend="eager", dynamic=False)
    pipe.transformer = tiny
    pipe.latents = lambda: torch.zeros(1, 4, 8)  # type: ignore[method-assign]
    pipe("p", num_inference_steps=3)  # compiles once
    graphs = counters["stats"]["unique_graphs"]
    compiled = vars(tiny)["_compiled_call_impl"]
    inst = instrument(pipe, registry=CollectorRegistry())
    assert vars(tiny)["_compiled_call_impl"] is not compiled
    try:
        pipe("p", num_inference_steps=3)
    finally:
        uninstrument(pipe)
    report = inst.last_report
    assert report is not None and report.cfg_branches == 2 and report.shape_label == "256x256_3s_cfg"
    assert counters["stats"]["unique_graphs"] == graphs  # the class kept, the compiled call wrapped
    assert type(tiny) is TinyTransformer and vars(tiny)["_compiled_call_impl"] is compiled  # unwrapped again
    pipe("p", num_inference_steps=3)
    assert counters["stats"]["unique_graphs"] == graphs


def test_an_eager_transformer_gets_its_class_back() -> None:
    pipe = StubPipeline()
    pipe.transformer = TinyTransformer()
    pipe.latents = lambda: torch.zeros(1, 4, 8)  # type: ignore[method-assign]
    inst = instrument(pipe, registry=CollectorRegistry())
    assert type(pipe.transformer) is not TinyTransformer and isinstance(pipe.transformer, TinyTransformer)
    pipe("p", num_inference_steps=2)
    assert inst.last_report is not None and inst.last_report.cfg_branches == 1
    uninstrument(pipe)
    assert type(pipe.transformer) is TinyTransformer


def test_a_call_without_a_shape_is_counted_and_never_raises() -> None:
    pipe = StubPipeline()
    pipe.latents = lambda: SimpleNamespace()  # type: ignore[method-assign]  # no shape
    registry = CollectorRegistry()
    inst = instrument(pipe, registry=registry)
    pipe("p", num_inference_steps=2)
    uninstrument(pipe)
    assert inst.last_report is not None and inst.last_report.cfg_branches == 1
    assert registry.get_sample_value("stepwatch_exporter_errors_total",
                                     {"component": "transformer.__call__"}) == 2
