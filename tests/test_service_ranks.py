"""Two ranks with FirstBlockCache: every rank takes the same path, so none waits in a collective alone.

diffusers' FirstBlockCache decides on each rank's shard of the first block's residual; without the
practice service's agreement (service/cache.py) the fifth request of this traffic (256^2, seed 4)
has rank 0 and rank 1 disagree at step 3, and the rank that computes waits in an attention all-to-all
until gloo's timeout: the two-rank deadlock.  With it, both ranks see the same decisions, the cache
still hits, and every request's rank stamps reach rank 0 (the exporter itself adds no collective).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from stepwatch.procs import exit_without_finalizing, free_port

pytestmark = pytest.mark.heavy

PROMPTS = ("a red fox in snow", "city at night", "a bowl of fruit", "mountain lake", "portrait of a cat")
REQUESTS = 8


def _rank(rank: int, world: int, port: int, out: str, pin: list[int] | None = None) -> None:
    import torch
    import torch.distributed as dist
    from diffusers import ContextParallelConfig
    from prometheus_client import CollectorRegistry

    from stepwatch.exporter import instrument
    from stepwatch.exporter.ranks import RankReporter
    from stepwatch.service.cache import apply_cache
    from stepwatch.service.pipeline import build_pipeline, prompt_words

    if pin is not None:
        os.sched_setaffinity(0, {pin[rank]})
    torch.set_num_threads(1)
    torch.accelerator.device_count = lambda: 1  # type: ignore[method-assign]  # CPU ranks, as service/ranks.py
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    pipe = build_pipeline("flux", seed=0)
    pipe.transformer.set_attention_backend("native")
    pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    apply_cache(pipe, "first_block_cache", 0.7)
    registry = CollectorRegistry()
    reporter = RankReporter()
    inst = instrument(pipe, registry=registry, rank_reporter=reporter)
    decisions: list[list[tuple[int, str, bool]]] = []
    for i in range(REQUESTS):
        size = (256, 512)[i % 2]
        pipe(prompt_words(PROMPTS[i % len(PROMPTS)]), height=size, width=size, num_inference_steps=8,
             max_sequence_length=32, output_type="np", generator=torch.Generator().manual_seed(i))
        decisions.append(list(inst.last_report.cache_decisions))
    deadline = time.time() + 10  # the last request's stamps reach rank 0 within a tick or two
    while rank == 0 and reporter.aligner is not None and reporter.aligner.requests and time.time() < deadline:
        time.sleep(0.2)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, decisions)
    reporter.close()
    if rank == 0:
        busy = {r: registry.get_sample_value("stepwatch_rank_busy_seconds_total", {"rank": str(r)}) for r in "01"}
        Path(out).write_text(json.dumps({"decisions": gathered, "rank_seconds": reporter.last, "busy": busy,
                                         "pending": len(reporter.aligner.requests) if reporter.aligner else -1}))
    dist.destroy_process_group()
    exit_without_finalizing(0)  # gloo's threads must not outlive into finalization (stepwatch/procs.py)


def test_two_ranks_agree_on_every_cache_decision_and_never_hang(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    out = tmp_path / "ranks.json"
    mp.spawn(_rank, args=(2, free_port(), str(out)), nprocs=2, join=True)
    result = json.loads(out.read_text())
    rank0, rank1 = result["decisions"]
    assert len(rank0) == len(rank1) == REQUESTS  # every request ended on both ranks
    assert rank0 == rank1  # same step, branch and hit everywhere
    assert sum(hit for req in rank0 for _step, _branch, hit in req) > 0  # the cache still hits
    assert len(result["rank_seconds"]) == 2 and result["pending"] == 0  # every request's stamps arrived
    assert all(b > 0 for b in result["busy"].values())


def test_a_crowded_rank_is_charged_its_busy_time(tmp_path: Path) -> None:
    """The straggler-neighbour drill's point, in seconds: each rank pinned to a CPU of its own (as the service
    pins them), a busy loop beside rank 1; rank 1's busy seconds must pass the rank-skew line, 1.1x rank 0's.

    This spawn is also the reproducer of the two-rank abort: a rank crowded on its CPU had its gloo thread
    free the last all-gather after finalization began (stepwatch/procs.exit_without_finalizing).  The
    operator's long run of it runs by name: ``stepwatch bench soak --ranks 2 --hogs 1 --minutes 3``."""
    import torch.multiprocessing as mp

    from stepwatch.fault_injection.neighbours import start_neighbours

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: the ranks cannot have one each")
    out = tmp_path / "ranks.json"
    hogs = start_neighbours([cpus[1]], 1)
    try:
        mp.spawn(_rank, args=(2, free_port(), str(out), cpus[:2]), nprocs=2, join=True)
    finally:
        for p in hogs:
            p.kill()
            p.wait()
    busy = json.loads(out.read_text())["busy"]
    assert busy["1"] > 1.1 * busy["0"], busy


class _SleepsInFinalization:
    """Held in a module global of rank 1: its ``__del__`` runs in module teardown, after finalization has begun,
    and lets go of the GIL there (as finalization's own flushes and joins may)."""

    def __init__(self) -> None:
        self.sleep = time.sleep  # module globals may be gone by then

    def __del__(self) -> None:
        self.sleep(2.0)


_HELD: list[_SleepsInFinalization] = []


def _gather_then_end(rank: int, world: int, port: int, flag: str, finalize: bool) -> None:
    """The abort's mechanism made certain: a gloo thread waits for the GIL when finalization begins.

    Rank 1 enqueues an all-gather whose tensors only gloo still holds, and its main thread keeps the GIL
    (a switch interval of 1000 s, nothing written, nothing waited on) while rank 0 joins; rank 1's gloo thread
    completes the all-gather, frees it, and waits for the GIL to drop the tensors' Python objects.  The
    main thread then ends: by finalization, which lets go of the GIL only once the interpreter is finalizing
    (the thread is then made to exit inside a noexcept destructor: abort), or by ``exit_without_finalizing``.
    A thread that asks for the GIL only after finalization began is safe: torch then leaks the objects."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    if rank == 0:
        deadline = time.time() + 50
        while not Path(flag).exists() and time.time() < deadline:
            time.sleep(0.01)
        dist.all_gather([torch.empty(1000) for _ in range(world)], torch.ones(1000))
        exit_without_finalizing(0)
    _HELD.append(_SleepsInFinalization())
    sys.setswitchinterval(1000.0)
    dist.all_gather([torch.empty(1000) for _ in range(world)], torch.ones(1000), async_op=True)
    Path(flag).touch()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 2.0:  # rank 0 joins; the gloo thread completes and waits for the GIL
        pass
    if not finalize:
        exit_without_finalizing(0)


def _aborts(finalize: bool, runs: int, tmp_path: Path) -> int:
    import torch.multiprocessing as mp

    aborts = 0
    for run in range(runs):
        flag = tmp_path / f"{'finalize' if finalize else 'exit'}-{run}"
        try:
            mp.spawn(_gather_then_end, args=(2, free_port(), str(flag), finalize), nprocs=2, join=True)
        except mp.ProcessExitedException as e:
            assert "SIGABRT" in str(e), e
            aborts += 1
    return aborts


def test_a_rank_ends_without_finalizing_so_gloo_cannot_abort_it(tmp_path: Path) -> None:
    """The two-rank abort ("terminate called without an active exception"; the core's backtrace:
    ~AsyncAllgatherWork in ProcessGroupGloo::runLoop under PyThread_exit_thread): a rank whose gloo thread
    waits for the GIL when finalization begins aborts, every time; a rank that ends with
    ``exit_without_finalizing`` never does."""
    assert _aborts(finalize=True, runs=2, tmp_path=tmp_path) == 2
    assert _aborts(finalize=False, runs=3, tmp_path=tmp_path) == 0


def _compiled_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from diffusers import ContextParallelConfig
    from prometheus_client import CollectorRegistry

    from stepwatch.exporter import instrument
    from stepwatch.exporter.ranks import RankReporter
    from stepwatch.service.pipeline import build_pipeline

    torch.set_num_threads(1)
    torch.accelerator.device_count = lambda: 1  # type: ignore[method-assign]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    pipe = build_pipeline("flux", seed=0)
    pipe.transformer.set_attention_backend("native")
    pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    registry = CollectorRegistry()
    reporter = RankReporter(interval=None)  # ticked below, so every request's stamps stay to be counted
    instrument(pipe, registry=registry, rank_reporter=reporter)

    def run(seed: int) -> None:
        pipe("a red fox", height=256, width=256, num_inference_steps=4, max_sequence_length=32,
             output_type="np", generator=torch.Generator().manual_seed(seed))

    run(0)  # eager
    pipe.transformer.compile_repeated_blocks(backend="aot_eager", dynamic=False)  # as the service compiles
    run(1)  # compiles
    run(2)  # compiled
    stamps = {q: [list(m) for m in marks] for q, marks in reporter.timeline.by_request.items()}
    for _ in range(2):  # rank 1 ships, then rank 0 aligns and publishes
        if rank == 1:
            reporter.tick()
        dist.barrier()
        if rank == 0:
            reporter.tick()
    if rank == 0:
        Path(out).write_text(json.dumps({
            "stamps": stamps, "pending": len(reporter.aligner.requests) if reporter.aligner else -1,
            "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
            "per_step": {r: registry.get_sample_value("stepwatch_rank_step_duration_seconds", {"rank": r})
                         for r in "01"}}))
    reporter.close()
    dist.destroy_process_group()
    exit_without_finalizing(0)


def test_the_stamps_survive_torch_compile_on_two_ranks(tmp_path: Path) -> None:
    """The wrapped wait runs inside regionally compiled blocks: Dynamo must neither drop the stamps nor
    fold the clock into a constant.  Every request, eager or compiled, stamps the same collectives with
    real, increasing times, and rank 0 publishes the compiled request's per-rank figures."""
    import torch.multiprocessing as mp

    out = tmp_path / "compiled.json"
    mp.spawn(_compiled_rank, args=(2, free_port(), str(out)), nprocs=2, join=True)
    result = json.loads(out.read_text())
    counts = {q: len(marks) for q, marks in result["stamps"].items()}
    assert set(counts) == {"0", "1", "2"} and len(set(counts.values())) == 1 and counts["0"] > 0, counts
    for marks in result["stamps"].values():
        times = [t for pair in marks for t in pair]
        assert times == sorted(times) and len(set(times)) > len(times) // 2, marks[:4]  # real clock reads
    assert result["graphs"] > 0, result["graphs"]  # Dynamo did compile the blocks the stamps run in
    assert result["pending"] == 0 and all(v is not None and v > 0 for v in result["per_step"].values()), result
