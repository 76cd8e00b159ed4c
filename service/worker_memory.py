"""The worker's memory: the address-space budget it serves under, and giving freed heap back to the OS.

The budget is an address-space limit (RLIMIT_AS) set after warm-up at the
warmed footprint plus a headroom: the CPU stand-in for a GPU's memory.
Compilation is host work, not "device" memory, so the limit is lifted while
torch.compile runs and re-based after.
"""

from __future__ import annotations

import ctypes
import resource
from typing import Any

from torch._dynamo.callback import callback_handler

from stepwatch.exporter.memory import _status

TRIM_SLACK_BYTES = 64 << 20  # above the last trimmed RSS by this much after a request: return freed heap
M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20  # blocks from 1 MiB up get mappings of their own
ARENA_MAX = 2


def malloc_trim() -> None:
    """Give freed heap back to the OS, so an OOM's garbage does not stay resident."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def keep_address_space_returnable() -> bool:
    """Make freed memory give its address space back, as the RLIMIT_AS budget needs.

    glibc raises its mmap threshold to the size of any mapped block freed (up to 32 MiB); from then on blocks
    of that size come from the heap and the per-thread arenas, whose address space stays reserved once freed.
    One 121-frame video job left the worker's address space 450 MB above its start and every later 41-frame job
    out of memory under the budget, although its resident memory came back.  A fixed threshold (which also
    turns the raising off) keeps every block of a MiB and more in a mapping of its own, returned at once when
    freed, and two arenas bound what torch's threads reserve (64 MiB of address space each).  True when glibc
    took both settings; elsewhere nothing changes.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(libc.mallopt(M_ARENA_MAX,
                                                                                                  ARENA_MAX))
    except (OSError, AttributeError):
        return False


def vm_status() -> dict[str, int]:
    return _status()


class Budget:
    """RLIMIT_AS = footprint + headroom, lifted during compiles."""

    def __init__(self, headroom_bytes: int | None) -> None:
        self.headroom = headroom_bytes
        self.limit: int | None = None
        self._lifted = False

    def arm(self) -> None:
        if self.headroom is None:
            return
        self.limit = vm_status()["VmSize"] + self.headroom
        resource.setrlimit(resource.RLIMIT_AS, (self.limit, resource.RLIM_INFINITY))

    def lift(self, _args: Any = None) -> None:
        if self.limit is not None and not self._lifted:
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            self._lifted = True

    def rearm(self, _args: Any = None) -> None:
        if self._lifted:
            self._lifted = False
            self.arm()

    def install_compile_hooks(self) -> None:
        if self.lift not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(self.lift)
            callback_handler.register_end_callback(self.rearm)
