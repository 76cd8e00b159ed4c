"""CPU neighbours: busy-loop processes pinned beside the worker, as another job on the same machine would be."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from stepwatch.fault_injection.drill import DrillResult
from stepwatch.fault_injection.stack import LocalStack
from stepwatch.procs import die_with_parent_fn

log = logging.getLogger("stepwatch.drills")

# A CPU-bound process pinned to one CPU: the straggler the seeds describe ("another process on that GPU").
BUSY_LOOP = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def start_neighbours(cpus: list[int], per_cpu: int) -> list[subprocess.Popen[bytes]]:
    """Busy-loop processes pinned to ``cpus``; each dies with this process, so a drill runner killed
    by SIGKILL (no restore) does not leave them burning the CPUs.

    Each runs in a session of its own, as another job or pod would: with the kernel's autogroup
    scheduling (a session is a scheduling group), loops sharing the drill runner's session would share
    one group's CPU time between them all, and a worker with its own session would barely notice them
    (measured: four loops per CPU made a one-rank worker 1.14x slower)."""
    arm = die_with_parent_fn()
    if arm is None:
        log.info("PR_SET_PDEATHSIG unavailable: CPU neighbours outlive a killed drill runner")
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(cpu)], preexec_fn=arm, start_new_session=True)
            for cpu in cpus for _ in range(per_cpu)]


def crowd_worker(stack: LocalStack, r: DrillResult, per_cpu: int) -> list[int]:
    """``per_cpu`` busy loops on each CPU of the one-rank worker (its affinity), kept in ``r`` for
    ``stop_neighbours``; returns the CPUs."""
    cpus = sorted(os.sched_getaffinity(int(stack.info()["worker"]["pid"])))
    r.details["_neighbours"] = start_neighbours(cpus, per_cpu)
    return cpus


def stop_neighbours(r: DrillResult) -> None:
    """Kill the busy loops a drill started (``start_neighbours``, kept in ``r.details["_neighbours"]``)."""
    for p in r.details.pop("_neighbours", []):
        p.kill()
        p.wait()
