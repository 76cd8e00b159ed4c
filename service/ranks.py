"""Two-rank mode: the transformer runs with diffusers' Ulysses context parallelism over gloo.

The worker process is rank 0; it starts the other ranks as its own children.
Only the spawned worker process imports this module (and torch).
Rank 0 talks to the HTTP process and broadcasts every generate/knobs message
to the other ranks (one small collective per request), so all ranks run the
same requests in the same order.  CPU-only torch builds report no
accelerator; diffusers' parallel set-up asks ``torch.accelerator.device_count``
for one, so the ranks report 1 (one CPU "device" each).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from stepwatch.procs import die_with_parent, exit_without_finalizing, free_port
from stepwatch.service.messages import RankProc
from stepwatch.service.worker import Worker, configure_process, start

log = logging.getLogger("stepwatch.service.ranks")


def rank_cpus(world: int, pin: bool) -> list[list[int]]:
    """Each rank's CPUs: a slice of this process's each when pinning (and there are enough), else all."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < world:
        return [cpus] * world
    n = len(cpus) // world
    return [cpus[r * n:(r + 1) * n] for r in range(world)]


def rank_threads(slices: list[list[int]]) -> list[int]:
    """Each rank's torch threads: its CPUs divided among the ranks whose CPUs overlap its own.

    Unpinned ranks all get every CPU; one thread per CPU each would oversubscribe
    the machine ``world`` times over.  Pinned slices are disjoint, so a rank keeps them all.
    """
    sets = [set(s) for s in slices]
    return [max(1, len(s) // sum(1 for o in sets if o & s)) for s in sets]


def _rank_entry(cfg: dict[str, Any], conn: Connection | None, rank: int, world: int, port: int,
                cpus: list[int], threads: int, procs: list[RankProc]) -> None:
    """One rank's process; ``procs`` (every rank's pid and CPUs) is complete on rank 0 only."""
    if rank > 0 and not die_with_parent():  # rank 0 killed by SIGKILL skips the join in ranks_main
        log.debug("PR_SET_PDEATHSIG unavailable; a killed rank 0 leaves rank %d to the gloo timeout", rank)
    configure_process(rank)
    os.sched_setaffinity(0, cpus)
    if not torch.cuda.is_available():
        torch.accelerator.device_count = lambda: 1
        torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    w = Worker(cfg, conn, rank, world)
    w.rank_procs = procs
    ready = start(w)
    if ready is None:
        raise SystemExit(f"rank {rank}: set-up failed")
    if conn is not None:
        conn.send(ready)
        w.serve()
    else:
        w.serve_follower()
    w.close_ranks()
    dist.destroy_process_group()


def _follower_entry(*args: Any) -> None:
    """A follower rank's process: its rank's loop, then out without finalizing (procs.exit_without_finalizing)."""
    _rank_entry(*args)
    exit_without_finalizing(0)


def ranks_main(cfg: dict[str, Any], conn: Any, world: int) -> None:
    """Entry point of the worker process in multi-rank mode: rank 0 here, ranks 1.. as children."""
    port = free_port()
    ctx = mp.get_context("spawn")
    cpus = rank_cpus(world, bool(cfg.get("pin_ranks", True)))
    threads = rank_threads(cpus)
    procs: list[RankProc] = [{"rank": 0, "pid": os.getpid(), "cpus": cpus[0]}]
    children = []
    for r in range(1, world):
        c = ctx.Process(target=_follower_entry, args=(cfg, None, r, world, port, cpus[r], threads[r], []),
                        name=f"stepwatch-rank{r}", daemon=True)
        c.start()
        children.append(c)
        procs.append({"rank": r, "pid": int(c.pid or 0), "cpus": cpus[r]})
    log.info("ranks: %s", ", ".join(f"{p['rank']} pid {p['pid']} cpus {p['cpus']}" for p in procs))
    try:
        _rank_entry(cfg, conn, 0, world, port, cpus[0], threads[0], procs)
    finally:
        for c in children:
            c.join(timeout=10)
            if c.is_alive():
                c.kill()
    exit_without_finalizing(0)  # rank 0's gloo threads too (reached when serving ended; an error raises past it)
