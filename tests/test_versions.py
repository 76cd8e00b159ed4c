"""The version gate: on an untested version only the signal that reads private state is off, once warned and
counted; everything else keeps working."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from prometheus_client import CollectorRegistry

from stepwatch import versions
from stepwatch.bench.overhead import StubPipeline
from stepwatch.exporter import instrument, uninstrument
from tests.test_bench_ledger import TinyTransformer


@pytest.mark.parametrize(("text", "parsed"), [
    ("2.13.0+cpu", (2, 13, 0)), ("0.43.0.dev0", (0, 43, 0)), ("0.42.1", (0, 42, 1)), ("", ()),
    ("0.26", (0, 26)), ("3.0rc1", (3, 0)),
])
def test_versions_parse_to_release_numbers(text: str, parsed: tuple[int, ...]) -> None:
    assert versions.parse(text) == parsed


def test_ranges_are_half_open() -> None:
    gate = versions.GATES["cache_decisions"]
    assert versions.in_range(gate.lowest, gate)
    assert versions.in_range("0.42.9", gate)
    assert not versions.in_range(gate.below, gate) and not versions.in_range("0.43.0.dev0", gate)
    assert not versions.in_range("0.35.2", gate)


def test_the_installed_versions_are_the_tested_ones() -> None:
    """The suite runs on the versions it claims: a new release in CI must fail here, not misread quietly."""
    rows = versions.report()
    assert {r["signal"] for r in rows} == set(versions.GATES)
    assert all(r["on"] for r in rows), rows


@pytest.fixture
def untested(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[str]]:
    """Make the named distributions report a version past every gate's range."""
    names: set[str] = set()
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda d: "99.0" if d in names else real(d))
    yield names


def _errors(registry: CollectorRegistry, component: str) -> float | None:
    return registry.get_sample_value("stepwatch_exporter_errors_total", {"component": component})


def test_an_untested_diffusers_turns_cache_decisions_off_only(untested: set[str],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    untested.add("diffusers")
    pipe = StubPipeline(branches=2, cache=True)
    registry = CollectorRegistry()
    with caplog.at_level(logging.WARNING, logger="stepwatch.versions"):
        inst = instrument(pipe, registry=registry)
    pipe("p", num_inference_steps=4)
    uninstrument(pipe)
    report = inst.last_report
    assert report is not None and report.cache is None and report.cache_decisions == []
    assert len(report.step_seconds) == 4 and report.cfg_branches == 2  # the rest is measured as ever
    assert _errors(registry, "version.cache_decisions") == 1
    assert _errors(registry, "version.batched_observe") is None
    warned = [r for r in caplog.records if "cache_decisions" in r.getMessage()]
    assert len(warned) == 1 and "diffusers 99.0 is outside the tested range" in warned[0].getMessage()


def test_an_untested_prometheus_client_observes_one_by_one(untested: set[str]) -> None:
    untested.add("prometheus-client")
    pipe = StubPipeline()
    registry = CollectorRegistry()
    inst = instrument(pipe, registry=registry)
    pipe("p", num_inference_steps=5)
    uninstrument(pipe)
    assert inst.publisher.observe.__name__ == "observe_each"
    assert registry.get_sample_value("stepwatch_pipeline_step_duration_seconds_count", {"shape": "256x256_5s"}) == 5
    assert _errors(registry, "version.batched_observe") == 1


def test_an_untested_torch_leaves_a_module_compiled_in_place_alone(untested: set[str]) -> None:
    untested.add("torch")
    pipe = StubPipeline(branches=2)
    tiny = TinyTransformer()
    tiny.compile(backend="eager", dynamic=False)
    compiled = vars(tiny)["_compiled_call_impl"]
    pipe.transformer = tiny
    pipe.latents = lambda: torch.zeros(1, 4, 8)  # type: ignore[method-assign]
    registry = CollectorRegistry()
    inst = instrument(pipe, registry=registry)
    assert vars(tiny)["_compiled_call_impl"] is compiled and type(tiny) is TinyTransformer
    pipe("p", num_inference_steps=2)
    uninstrument(pipe)
    assert inst.last_report is not None and inst.last_report.cfg_branches == 2  # from the two cache_contexts
    assert _errors(registry, "version.compiled_call") == 1


def test_an_untested_uvicorn_serves_without_the_stall_timeout(untested: set[str]) -> None:
    from stepwatch.service.app import make_server

    class _Svc:
        def stop(self) -> None:
            pass

    untested.add("uvicorn")
    server = make_server(_Svc())  # type: ignore[arg-type]
    assert server.config.http == "h11"
    untested.clear()
    assert make_server(_Svc()).config.http.__name__ == "StallTimeoutH11"  # type: ignore[arg-type]
