"""The rank timing's cost on two real ranks, side by side with the design it replaced.

Two gloo ranks run the tiny FLUX pipeline under Ulysses context parallelism, three variants
interleaved round by round (the order alternates, the same on both ranks): bare, instrumented
with the rank timing before issue 18 (host-timed waits summed under a lock, and one blocking
``all_gather_object`` per request), and instrumented with today's (arrival/departure stamps per
collective shipped by a thread through the store).  Both instrumented variants run the same
exporter; only the rank reporter differs.  The stamping wrapper is module-global in diffusers, so
each variant installs its own just for its request, and today's shipping thread runs only while
its variant is timed (``_Shipping``).  Rank 0 times the requests and writes the paired ratios.
"""

from __future__ import annotations

import importlib
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

from stepwatch.bench.overhead import _ci
from stepwatch.exporter.rank_align import publish_ranks
from stepwatch.exporter.rank_timeline import INTERVAL_S, Timeline, stamping
from stepwatch.exporter.ranks import _TARGET, PerRequestReporter, RankReporter
from stepwatch.procs import exit_without_finalizing, free_port

VARIANTS = ("bare", "before", "now")


class LegacyRankReporter(PerRequestReporter):
    """The per-request alternative (the "before" variant): busy = step time minus host-timed waits, gathered
    per request."""

    def __init__(self, rank: int | None = None, world: int | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank = dist.get_rank() if rank is None else rank
        self.world = dist.get_world_size() if world is None else world
        self._wait = 0.0
        self._lock = threading.Lock()
        self._orig: Any = None

    def install(self) -> None:
        mod = importlib.import_module(_TARGET[0])
        self._orig = getattr(mod, _TARGET[1])
        setattr(mod, _TARGET[1], self.timing(self._orig))

    def timing(self, orig: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``orig`` with its duration added to the wait under the lock: that alternative's hot path."""

        def timed_wait(tensor: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(tensor)
            finally:
                dt = time.perf_counter() - t0
                with self._lock:
                    self._wait += dt

        return timed_wait

    def uninstall(self) -> None:
        if self._orig is not None:
            setattr(importlib.import_module(_TARGET[0]), _TARGET[1], self._orig)
            self._orig = None

    def report(self, report: Any, _request: int) -> None:
        steps = len(report.step_seconds)
        with self._lock:
            wait, self._wait = self._wait, 0.0
        busy = max(0.0, sum(report.step_seconds) - wait) / steps if steps else 0.0
        values: list[Any] = [None] * self.world
        self._dist.all_gather_object(values, (busy, steps))
        if self.rank == 0 and steps:
            assert self.metrics is not None, "instrument() binds the reporter before the first request"
            publish_ranks([float(v[0]) for v in values], self.metrics)


class _Shipping:
    """RankReporter's shipping thread, ticking once per ``interval`` of the time its variant is timed.

    The reporter's own thread ticks on wall time, so it would ship (and contend for the two CPUs)
    while the other variants are timed, and charge them for it.  This one is parked outside ``timed()``,
    and a tick in flight when the request ends finishes before the next variant starts: the "now"
    requests carry the shipping at its service rate, and only they do.
    """

    def __init__(self, tick: Callable[[], None], interval: float = INTERVAL_S) -> None:
        self._tick, self._interval, self._left = tick, interval, interval
        self._cv = threading.Condition()
        self._on = self._closed = False
        self._thread = threading.Thread(target=self._loop, name="stepwatch-ranks-bench", daemon=True)
        self._thread.start()

    @contextmanager
    def timed(self) -> Iterator[None]:
        self._switch(on=True)
        try:
            yield
        finally:
            self._switch(on=False)  # waits for a tick in flight: the thread ticks holding the lock

    def close(self) -> None:
        self._switch(on=False, closed=True)
        self._thread.join()

    def _switch(self, on: bool, closed: bool = False) -> None:
        with self._cv:
            self._on, self._closed = on, self._closed or closed
            self._cv.notify()

    def _loop(self) -> None:
        with self._cv:
            while not self._closed:
                was_on, t0 = self._on, time.perf_counter()
                self._cv.wait(self._left if was_on else None)  # any switch wakes it
                if was_on:  # on from t0 until now: that much of the interval has passed
                    self._left -= time.perf_counter() - t0
                if self._on and self._left <= 0:
                    self._left = self._interval
                    self._tick()


def _pipelines(world: int) -> dict[str, Any]:
    """Three identical tiny FLUX pipelines split over the ranks; two instrumented."""
    from diffusers import ContextParallelConfig
    from prometheus_client import CollectorRegistry

    from stepwatch.exporter import instrument
    from stepwatch.service.pipeline import build_pipeline

    pipes = {}
    for name in VARIANTS:
        pipe = build_pipeline("flux", seed=0)
        pipe.transformer.set_attention_backend("native")
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        pipes[name] = pipe
    now = RankReporter(interval=None)  # shipped by _Shipping, only while "now" is timed
    reporters: dict[str, Any] = {"before": LegacyRankReporter(), "now": now}
    for name, rep in reporters.items():
        rep.uninstall()  # installed per request below: the wrapper is module-global
        instrument(pipes[name], registry=CollectorRegistry(), rank_reporter=rep)
    return {"pipes": pipes, "reporters": reporters, "shipping": _Shipping(now.tick)}


def _timed_request(setup: dict[str, Any], name: str, size: int, steps: int, seed: int) -> float:
    """Seconds of one request of variant ``name``; today's shipping thread runs only during "now"'s."""
    import torch

    shipping = setup["shipping"].timed() if name == "now" else nullcontext()
    with shipping:
        t0 = time.perf_counter()
        setup["pipes"][name]("w1 w2 w3", height=size, width=size, num_inference_steps=steps,
                             max_sequence_length=32, output_type="np", generator=torch.Generator().manual_seed(seed))
        return time.perf_counter() - t0


def _rank(rank: int, world: int, port: int, out: str, rounds: int, size: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.accelerator.device_count = lambda: 1  # CPU ranks, as service/ranks.py
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    setup = _pipelines(world)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(-2, rounds):  # two warm-up rounds, not timed
        order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
        for name in order:
            rep = setup["reporters"].get(name)
            if rep is not None:
                rep.install()
            dist.barrier()
            seconds = _timed_request(setup, name, size, steps, seed=max(r, 0))
            if r >= 0:
                times[name].append(seconds)
            if rep is not None:
                rep.uninstall()
    setup["shipping"].close()
    setup["reporters"]["now"].close()
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()
    exit_without_finalizing(0)  # gloo's threads must not outlive into finalization (stepwatch/procs.py)


def per_collective_ns(calls: int = 200_000) -> dict[str, float]:
    """The hot path alone: one wrapped wait around a no-op, bare / before / now, interleaved (ns per call)."""
    def noop(t: Any) -> Any:
        return t

    tl = Timeline()
    tl.begin()
    fns = {"bare": noop, "before": LegacyRankReporter(0, 2).timing(noop), "now": stamping(noop, tl)}
    per: dict[str, list[float]] = {k: [] for k in fns}
    batch = calls // 20
    for r in range(20):
        for name in (VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))):
            fn, t0 = fns[name], time.perf_counter()
            for _ in range(batch):
                fn(None)
            per[name].append((time.perf_counter() - t0) / batch * 1e9)
            tl.marks.clear()
    return {k: round(statistics.median(v), 1) for k, v in per.items()}


def two_rank_case(rounds: int = 40, size: int = 256, steps: int = 4) -> dict[str, Any]:
    """Paired ratios of request time: today's rank timing / the previous one, and each / bare."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        mp.spawn(_rank, args=(2, free_port(), str(out), rounds, size, steps), nprocs=2, join=True)
        times: dict[str, list[float]] = json.loads(out.read_text())
    result: dict[str, Any] = {"shape": f"{size}x{size}_{steps}s", "ranks": 2, "rounds": rounds,
                              "request_ms": {v: round(statistics.median(times[v]) * 1e3, 3) for v in VARIANTS},
                              "per_collective_ns": per_collective_ns()}
    for a, b in (("now", "before"), ("now", "bare"), ("before", "bare")):
        ratios = [x / y for x, y in zip(times[a], times[b], strict=True)]
        lo, hi = _ci(ratios)
        result[f"ratio_{a}_to_{b}"] = round(statistics.median(ratios), 4)
        result[f"ratio_{a}_to_{b}_ci95"] = [round(lo, 4), round(hi, 4)]
    return result
