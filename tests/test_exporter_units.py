"""The exporter's parts on their own: the patch registry, the pure request-to-report step, publishing.

No model and no torch pipeline: plain objects, float clock marks and a fresh registry.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from stepwatch.bench.overhead import StubPipeline
from stepwatch.exporter import instrument, patches, uninstrument
from stepwatch.exporter.publish import Publisher
from stepwatch.exporter.request import RequestMarks, ResolveContext, resolve
from stepwatch.exporter.shapes import ShapeKey, ShapeLabeler
from stepwatch.metrics import ExporterMetrics
from tests.promtext import absent, scrape, value


class Thing:
    def method(self) -> str:
        return "class"


def test_registry_restores_class_and_instance_attributes() -> None:
    t = Thing()
    t.own = "mine"  # type: ignore[attr-defined]
    reg = patches.PatchRegistry()
    assert reg.register("thing.method", t, "method", lambda: "patched")
    assert reg.register("thing.own", t, "own", "patched")
    sub = type("Sub", (Thing,), {})
    assert reg.register(patches.CALL, t, "__class__", sub)
    assert t.method() == "patched" and type(t) is sub and list(reg) == ["thing.method", "thing.own", patches.CALL]
    reg.remove_all()
    assert len(reg) == 0
    assert type(t) is Thing and "method" not in vars(t) and t.method() == "class"  # the class's again
    assert vars(t) == {"own": "mine"}


def test_registry_is_idempotent_by_name_and_follows_swapped_objects() -> None:
    a, b = Thing(), Thing()
    reg = patches.PatchRegistry()
    built: list[Any] = []

    def wrapper(fn: Any) -> Any:
        built.append(fn)
        return lambda: "wrapped " + fn()

    assert reg.wrap("x.method", a, "method", wrapper)
    assert not reg.wrap("x.method", a, "method", wrapper)  # already there: the wrapper is not even built
    assert len(built) == 1 and reg.holds("x.method", a) and reg.target("x.method") is a
    assert reg.wrap("x.method", b, "method", wrapper)  # another object under the name: the old one is let go
    assert "method" not in vars(a) and b.method() == "wrapped class" and reg.target("x.method") is b
    assert reg.remove("x.method") and not reg.remove("x.method")
    assert "method" not in vars(b)


def test_registry_removal_errors_are_reported_not_raised() -> None:
    errors: list[str] = []
    t = Thing()
    reg = patches.PatchRegistry(on_error=lambda name, e: errors.append(name))
    reg.register("thing.method", t, "method", lambda: "patched")
    del t.method  # someone else removed it first
    reg.remove_all()
    assert errors == ["unpatch.thing.method"]


def test_hook_names() -> None:
    assert patches.cache_context("transformer_2") == "transformer_2.cache_context"
    assert patches.component_of(patches.STEP) == "scheduler"
    assert patches.component_of(patches.VAE_DECODE) == "vae"
    assert patches.component_of(patches.ENCODE_PROMPT) is None and patches.component_of(patches.CALL) is None


def _marks(**kw: Any) -> RequestMarks:
    base: dict[str, Any] = dict(start=10.0, start_unix=1000.0, height=256, width=256, frames=None, steps_hint=3,
                                cfg_hint=False, text_tokens=32, parent_ctx=None, cache=None)
    return RequestMarks(**{**base, **kw})


def _ctx(**kw: Any) -> ResolveContext:
    return ResolveContext(seconds=lambda a, b: b - a, labeler=ShapeLabeler(["256x256_3s_cfg"]), device="cpu", **kw)


def test_resolve_turns_marks_into_a_report() -> None:
    req = _marks(te_spans=[(10.1, 10.2), (10.2, 10.3)], denoise_start=10.4, step_marks=[10.6, 10.8, 11.0],
                 max_branches=2, planned_steps=3, vae_spans=[(11.1, 11.5)], end=11.6,
                 decisions=[(1, "cond", True)], cache=("first_block_cache", lambda b: None),
                 peaks={"prepare": 5, "text_encode": 50, "denoise": 80, "vae_decode": 60, "postprocess": 7},
                 capacity=1000, compiles=[(10.05, 0.5)])
    r = resolve(req, "warmup", _ctx(peak_flops=100.0, step_flops=lambda m, branches: 4.0 * branches))
    rep = r.report
    assert str(rep.shape) == "256x256_3s_cfg" and rep.shape_label == "256x256_3s_cfg" and rep.cfg_branches == 2
    assert rep.seconds == pytest.approx(1.6)
    assert rep.stages == pytest.approx({"text_encode": 0.2, "denoise": 0.6, "vae_decode": 0.4})
    assert rep.step_seconds == pytest.approx([0.2, 0.2, 0.2])
    assert r.step_bounds[0] == pytest.approx((0.4, 0.6)) and r.stage_bounds["vae_decode"] == pytest.approx((1.1, 1.5))
    assert rep.memory_peak_bytes == {"text_encode": 50, "denoise": 80, "vae_decode": 60, "request": 80}
    assert rep.step_flops == 8.0 and rep.mfu == pytest.approx(8.0 / 0.2 / 100.0)
    assert rep.cache == "first_block_cache" and rep.hits == 1 and rep.compiles[0].phase == "warmup"
    assert rep.outcome == "ok" and rep.failed_stage is None and rep.start_unix == 1000.0


def test_resolve_an_oom_counts_the_refused_demand_in_its_stage() -> None:
    req = _marks(denoise_start=10.1, step_marks=[10.2], stage="denoise", outcome="oom", oom_demand=900,
                 error="OutOfMemoryError: ...", peaks={"text_encode": 50, "denoise": 80}, end=10.3)
    rep = resolve(req, "serving", _ctx()).report
    assert rep.failed_stage == "denoise" and rep.outcome == "oom"
    assert rep.memory_peak_bytes["denoise"] == 900 and rep.memory_peak_bytes["request"] == 900
    assert rep.shape_label == "other" and rep.step_flops is None and rep.mfu is None  # not on the allowlist


def test_resolve_without_steps_or_size_has_no_shape() -> None:
    rep = resolve(_marks(height=None, width=None, steps_hint=None, end=10.5), "serving", _ctx()).report
    assert rep.shape is None and rep.step_seconds == [] and rep.stages == {}
    assert rep.memory_peak_bytes == {"request": 0}


def test_publish_writes_one_report() -> None:
    reg = CollectorRegistry()
    pub = Publisher(ExporterMetrics(reg), "cpu")
    req = _marks(denoise_start=10.1, step_marks=[10.2, 10.3, 10.4], max_branches=2, planned_steps=3,
                 decisions=[(2, "cond", True), (2, "uncond", False)], cache=("mag_cache", lambda b: None),
                 peaks={"denoise": 80}, capacity=1000, end=10.5)
    pub.publish(resolve(req, "serving", _ctx()).report)
    d = scrape(reg)
    shape = "256x256_3s_cfg"
    assert value(d, "stepwatch_pipeline_requests_total", shape=shape, outcome="ok") == 1
    assert value(d, "stepwatch_pipeline_step_duration_seconds_count", shape=shape) == 3
    assert value(d, "stepwatch_cache_decisions_total", shape=shape, cache="mag_cache", decision="hit") == 1
    assert value(d, "stepwatch_cache_hit_position_ratio_count") == 1  # all shapes together
    assert value(d, "stepwatch_memory_peak_bytes", device="cpu", stage="denoise") == 80
    assert value(d, "stepwatch_memory_peak_bytes", device="cpu", stage="vae_decode") == 0
    assert value(d, "stepwatch_oom_total", shape=shape, stage="denoise") == 0  # born at 0 with the shape
    assert absent(d, "stepwatch_ledger_mfu_ratio", shape=shape)  # no ledger: unknown, not 0


def test_stub_pipeline_round_trip() -> None:
    """The hooks on a pipeline with no compute: every step counted, then the pipeline exactly as before."""
    pipe = StubPipeline()
    reg = CollectorRegistry()
    inst = instrument(pipe, registry=reg)
    assert sorted(inst.patches) == sorted([patches.ENCODE_PROMPT, patches.SET_TIMESTEPS, patches.STEP,
                                           patches.cache_context("transformer"), patches.VAE_DECODE, patches.CALL,
                                           patches.denoiser_call("transformer")])
    pipe("p", num_inference_steps=5)
    assert inst.last_report is not None and len(inst.last_report.step_seconds) == 5
    assert inst.last_report.cfg_branches == 1
    assert uninstrument(pipe)
    assert type(pipe) is StubPipeline and "encode_prompt" not in vars(pipe) and "_stepwatch" not in vars(pipe)
    assert set(vars(pipe.scheduler)) == {"timesteps"} and vars(pipe.vae) == {}
    assert "cache_context" not in vars(pipe.transformer)
    assert type(pipe.transformer).__qualname__ == "_StubTransformer" and not hasattr(
        type(pipe.transformer), "_stepwatch_original_class")


def test_observe_all_matches_one_observe_per_amount() -> None:
    """The per-request batched histogram write exposes exactly what one observe() per step would."""
    from prometheus_client import Histogram

    from stepwatch.exporter.publish import observe_all

    amounts = [0.0005, 0.2, 0.2, 2.0, -1.0, 1e6, 0.0, 0.001, 0.3]
    one, batched = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("x_seconds", "x", buckets=(0.0005, 0.001, 0.1, 1.0), registry=one)
    h2 = Histogram("x_seconds", "x", buckets=(0.0005, 0.001, 0.1, 1.0), registry=batched)
    for a in amounts:
        h1.observe(a)
    observe_all(h2, amounts)
    d1, d2 = scrape(one), scrape(batched)
    assert {k: v for k, v in d1.items() if "_created" not in k[0]} == {k: v for k, v in d2.items()
                                                                       if "_created" not in k[0]}


class _FbcLike:
    """A reader as caches.Reader: raw ``should_compute`` per branch; a hit is a branch that did not compute."""

    @staticmethod
    def decide(raw: Any) -> bool | None:
        return not bool(raw)


class _TaylorLike:
    @staticmethod
    def decide(raw: Any) -> bool | None:
        current, last_update = raw
        return None if current < 0 else last_update != current


def test_replay_attributes_each_branch_decision_to_its_step() -> None:
    from stepwatch.exporter.request import replay

    log: list[Any] = ["cond", "uncond", (1.0, {"cond": True, "uncond": True}),     # step 0: both computed
                      "cond", "uncond", (2.0, {"cond": False, "uncond": True}),    # step 1: cond reused
                      "cond", "uncond", (3.0, {"cond": False, "uncond": False}),   # step 2: both reused
                      "cond", {"cond": True}]                                      # a trailing branch, no step call
    req = _marks(cache=("first_block_cache", _FbcLike()))
    req.log.extend(log)
    r = replay(req)
    assert r.step_marks == [1.0, 2.0, 3.0] and r.max_branches == 2
    assert r.decisions == [(0, "cond", False), (0, "uncond", False), (1, "cond", True), (1, "uncond", False),
                           (2, "cond", True), (2, "uncond", True), (3, "cond", False)]


def test_replay_reads_taylorseer_state_and_skips_branches_without_a_decision() -> None:
    from stepwatch.exporter.request import replay

    req = _marks(cache=("taylorseer_cache", _TaylorLike()))
    req.log.extend(["cond", (1.0, {"cond": (0, 0)}), "cond", (2.0, {"cond": (1, 0)}), "cond", (3.0, {"cond": (-1, 0)})])
    assert replay(req).decisions == [(0, "cond", False), (1, "cond", True)]


def test_observe_all_leaves_nan_out_of_the_buckets_as_observe_does() -> None:
    from prometheus_client import Histogram

    from stepwatch.exporter.publish import observe_all

    one, batched = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("y_seconds", "y", buckets=(0.1, 1.0), registry=one)
    h2 = Histogram("y_seconds", "y", buckets=(0.1, 1.0), registry=batched)
    for a in (0.05, float("nan"), 0.5):
        h1.observe(a)
    observe_all(h2, [0.05, float("nan"), 0.5])
    assert value(scrape(one), "y_seconds_count") == value(scrape(batched), "y_seconds_count") == 2


def test_shape_keys_are_width_first_like_the_api_size() -> None:
    """A ``size: "1024x768"`` request (1024 wide, 768 high) is labelled 1024x768, not 768x1024."""
    key = ShapeKey(height=768, width=1024, steps=8, cfg=True)
    assert str(key) == "1024x768_8s_cfg"
    assert ShapeKey.parse("1024x768_8s_cfg") == key
    assert str(ShapeKey(height=480, width=832, steps=50, cfg=True, frames=81)) == "832x480x81_50s_cfg"
    pipe = StubPipeline()
    registry = CollectorRegistry()
    instrument(pipe, registry=registry, shapes=["1024x768_4s"])
    pipe("p", height=768, width=1024, num_inference_steps=4)
    labels = {"shape": "1024x768_4s", "outcome": "ok"}
    assert registry.get_sample_value("stepwatch_pipeline_requests_total", labels) == 1


class _RecordingRanks:
    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []
        self.events: list[str] = []
        self.request = -1

    def bind(self, _metrics: Any) -> None:
        self.events.append("bind")

    def begin_request(self) -> int:
        self.request += 1
        self.events.append("begin")
        return self.request

    def end_request(self) -> None:
        self.events.append("end")

    def report(self, report: Any, request: int) -> None:
        self.steps.append((request, len(report.step_seconds)))


def test_a_request_that_cannot_be_resolved_still_reaches_the_rank_reporter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 lets a request's stamps go once every rank reported it: one that cannot be resolved reports 0."""
    lifecycle = importlib.import_module("stepwatch.exporter.lifecycle")  # where a request's marks are resolved

    def broken(*_args: Any) -> Any:
        raise RuntimeError("resolve broke")

    ranks = _RecordingRanks()
    pipe, registry = StubPipeline(), CollectorRegistry()
    instrument(pipe, registry=registry, rank_reporter=ranks)
    pipe("p", num_inference_steps=3)
    monkeypatch.setattr(lifecycle, "resolve", broken)
    pipe("p", num_inference_steps=3)
    assert ranks.steps == [(0, 3), (1, 0)]
    assert ranks.events == ["bind", "begin", "end", "begin", "end"]
    assert registry.get_sample_value("stepwatch_exporter_errors_total", {"component": "resolve"}) == 1


@pytest.mark.parametrize("breaks", ["begin", "end"])
def test_every_request_begins_and_ends_on_the_rank_reporter_whatever_else_fails(
        monkeypatch: pytest.MonkeyPatch, breaks: str) -> None:
    """Every rank must count every request: the reporter's begin comes before the instrumentation's own
    work (which may fail), its end before the rest of the end, and a request whose bookkeeping failed still
    reports 0 steps so the ranks' stamps of it are let go."""
    ranks = _RecordingRanks()
    pipe, registry = StubPipeline(), CollectorRegistry()
    inst = instrument(pipe, registry=registry, rank_reporter=ranks)

    def broken(*_args: Any) -> Any:
        raise RuntimeError(f"{breaks} broke")

    monkeypatch.setattr(inst, "_ensure_component_patches" if breaks == "begin" else "_end_request", broken)
    pipe("p", num_inference_steps=3)
    monkeypatch.undo()
    pipe("p", num_inference_steps=3)
    assert ranks.events == ["bind", "begin", "end", "begin", "end"]
    assert ranks.steps == [(0, 0), (1, 3)]
    component = "request.begin" if breaks == "begin" else "request.end"
    assert registry.get_sample_value("stepwatch_exporter_errors_total", {"component": component}) == 1


def test_the_pipeline_process_cpu_wait_is_read_from_its_source_at_each_scrape() -> None:
    """A scraped counter: the kernel's number as it is at the scrape, no series when the source has none."""
    from stepwatch.exporter.cpu import schedstat_seconds
    from stepwatch.metrics import ScrapeCounter

    registry = CollectorRegistry()
    instrument(StubPipeline(), registry=registry)
    instrument(StubPipeline(), registry=registry)  # a second pipeline on the registry: registered once
    own = value(scrape(registry), "stepwatch_pipeline_cpu_wait_seconds_total")
    assert 0 <= own <= (schedstat_seconds() or (0, 0))[1]
    ran = value(scrape(registry), "stepwatch_pipeline_cpu_run_seconds_total")
    assert 0 < ran <= (schedstat_seconds() or (0, 0))[0]  # this test's own thread has run

    readings = iter([1.5, None, 2.25])
    other = CollectorRegistry()
    ScrapeCounter("stepwatch_pipeline_cpu_wait_seconds_total", lambda: next(readings), other)
    assert value(scrape(other), "stepwatch_pipeline_cpu_wait_seconds_total") == 1.5
    assert absent(scrape(other), "stepwatch_pipeline_cpu_wait_seconds_total")
    assert value(scrape(other), "stepwatch_pipeline_cpu_wait_seconds_total") == 2.25
    with pytest.raises(ValueError, match="not an unlabelled scraped counter"):
        ScrapeCounter("stepwatch_pipeline_requests_total", lambda: 0.0, CollectorRegistry())


def test_warmup_active_follows_the_warmup_phase() -> None:
    """1 inside ``inst.warmup()`` (what the probe runbook's re-warm check reads), 0 outside and after a failure."""
    registry = CollectorRegistry()
    pipe = StubPipeline()
    inst = instrument(pipe, registry=registry)
    assert value(scrape(registry), "stepwatch_pipeline_warmup_active") == 0
    with inst.warmup():
        pipe("p")
        assert value(scrape(registry), "stepwatch_pipeline_warmup_active") == 1
    assert value(scrape(registry), "stepwatch_pipeline_warmup_active") == 0
    with pytest.raises(RuntimeError), inst.warmup():
        raise RuntimeError("a warm-up that failed")
    assert value(scrape(registry), "stepwatch_pipeline_warmup_active") == 0


def test_bench_crossover_moves_the_instrumentation_between_the_two_pipelines() -> None:
    """bench overhead / bench stream: each pipeline spends half the rounds instrumented (two objects built alike
    differ by a few percent on a shared VM; the crossover cancels it), with a discarded call after each swap."""
    from stepwatch.bench.overhead import crossover
    from stepwatch.exporter.instrument import ATTR

    pipes = (StubPipeline(), StubPipeline())
    seen: list[tuple[int, bool]] = []

    def call(p: Any, r: int) -> int:
        seen.append((pipes.index(p), ATTR in p.__dict__))
        return pipes.index(p)

    out, handle = crossover(pipes, call, rounds=4, block=2)
    assert out == {"bare": [1, 1, 0, 0], "inst": [0, 0, 1, 1]}  # pipeline 0 instrumented first, then 1
    assert all(instrumented == (i == (0 if n < 6 else 1)) for n, (i, instrumented) in enumerate(seen))
    assert len(seen) == 4 * 2 + 2 * 2  # two timed calls per round, two discarded per swap
    assert handle is pipes[1].__dict__[ATTR] and ATTR not in pipes[0].__dict__


def test_one_scrape_walks_the_threads_once_for_both_cpu_counters() -> None:
    from stepwatch.exporter.cpu import SchedstatReader

    walks = iter([(2.0, 0.5), (3.0, 0.75), None])
    calls: list[int] = []

    def read() -> tuple[float, float] | None:
        calls.append(1)
        return next(walks)

    scrape_once = SchedstatReader(read, fresh_s=60.0)
    assert (scrape_once.ran(), scrape_once.waited(), len(calls)) == (2.0, 0.5, 1)  # one scrape: one walk
    every_time = SchedstatReader(read, fresh_s=0.0)
    assert (every_time.waited(), every_time.ran(), len(calls)) == (0.75, None, 3)  # no schedstat: no series


def test_cpu_counters_keep_the_seconds_of_threads_that_ended() -> None:
    """A thread that ends must not take its seconds out of the process's counters (a counter that falls reads
    as a reset); a thread id reused with smaller readings is a new thread."""
    from stepwatch.exporter.cpu import ThreadTotals

    readings = iter([{"1": (10, 4), "2": (6, 2)},
                     {"1": (12, 5)},                # thread 2 ended
                     {"1": (13, 5), "2": (1, 1)},   # id 2 reused by a new thread
                     None])
    totals = ThreadTotals(lambda: next(readings))
    assert [totals() for _ in range(4)] == [(16e-9, 6e-9), (18e-9, 7e-9), (20e-9, 8e-9), None]


def test_rank_waits_are_the_totals_that_keep_ended_threads() -> None:
    """The rank reporter reads its per-request CPU waits from ThreadTotals (a plain sum over the live threads
    fell when one ended, and a request's waits were clamped to 0), from two threads at once: one lock."""
    import threading

    from stepwatch.exporter.cpu import ThreadTotals
    from stepwatch.exporter.ranks import RankReporter

    reporter = RankReporter(channel=None, interval=None, rank=0, world=1, hook=False)
    assert isinstance(getattr(reporter.timeline.cpu_wait, "__self__", None), ThreadTotals)
    reporter.close()
    # A reading is one walk of /proc: a second reader must wait for the first to finish (else both could add
    # an ended thread's seconds). The first reader is held inside its walk; the second must not start one.
    inside, release, walks = threading.Event(), threading.Event(), []

    def read() -> dict[str, tuple[int, int]]:
        walks.append(1)
        if len(walks) == 2:  # the first reader's second walk: hold it there
            inside.set()
            release.wait(10)
        return {"1": (10, 4), "2": (6, 2)} if len(walks) == 1 else {"1": (12, 5)}

    totals = ThreadTotals(read)
    assert totals.waited() == 6e-9
    seen: list[float | None] = []
    first = threading.Thread(target=lambda: seen.append(totals.waited()))
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=lambda: seen.append(totals.waited()))
    second.start()
    time.sleep(0.2)
    assert len(walks) == 2  # the second reader waits for the lock, not inside a walk of its own
    release.set()
    first.join()
    second.join()
    assert seen == [7e-9, 7e-9]  # thread 2's seconds counted once


def test_cpu_counters_never_fall_when_real_threads_end() -> None:
    import threading

    from stepwatch.exporter.cpu import ThreadTotals, schedstat_seconds

    totals = ThreadTotals()
    if totals() is None:
        pytest.skip("no schedstat here")

    def burn() -> None:
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            pass

    threads = [threading.Thread(target=burn) for _ in range(4)]
    for t in threads:
        t.start()
    during = totals()
    for t in threads:
        t.join()
    live_sum = schedstat_seconds()
    after = totals()
    assert during is not None and after is not None and live_sum is not None
    assert after[0] >= during[0] and after[1] >= during[1]
    assert after[0] >= live_sum[0]  # the ended threads' seconds stay in
