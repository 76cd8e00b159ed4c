"""Child processes that die with their parent, shared by the service's ranks and the drills' neighbours.

A parent killed by SIGKILL runs no clean-up, so its children would live on: a follower rank
waiting out the gloo timeout, a busy-loop neighbour burning a CPU for good.  Linux's
``prctl(PR_SET_PDEATHSIG)`` has the kernel signal them instead.  Elsewhere the children are
left as before (and the caller may log it).

The signal follows the *thread* that started the child: start such children from a thread
that lives as long as they should (the main thread).
"""

from __future__ import annotations

import ctypes
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent_fn() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child killed with its parent; None where prctl is missing (not Linux).

    prctl is looked up here, in the parent: after a fork only the call itself runs, since loading a
    library or logging in a forked child of a threaded process can deadlock on a lock held by another thread.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    return arm


def die_with_parent() -> bool:
    """Have this process killed when its parent dies; False where that is unavailable."""
    arm = die_with_parent_fn()
    if arm is not None:
        arm()
    return arm is not None
