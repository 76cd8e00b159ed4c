"""How long a process's threads waited for a CPU: the host side of a step delayed by another process.

A GPU pipeline's host thread launches kernels, runs the scheduler and Python between them; another
process on its CPUs (a noisy neighbour, a co-located job, a data loader) makes each of those late, and
neither GPU-Util nor the step time says why.  Linux keeps the answer per thread: schedstat's run delay,
the time a thread was runnable but not running.
"""

from __future__ import annotations

import os


def runqueue_wait_seconds() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU (Linux schedstat), or None.

    Thread-seconds, summed over the process's threads: two threads waiting one second count two.

    A rank starved of CPU (another process on its CPUs, a throttled host) runs its side of every transfer
    late: the ranks then arrive together and wait together, and only this shows who held them up."""
    total = 0
    try:
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/schedstat") as f:
                    total += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # a thread that just ended
    except OSError:
        return None
    return total / 1e9
