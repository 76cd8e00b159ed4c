"""The worker's memory budget: the address-space limit it serves under (RLIMIT_AS).

The budget is an address-space limit (RLIMIT_AS) set after warm-up at the
warmed footprint plus a headroom: the CPU stand-in for a GPU's memory.
Compilation is host work, not "device" memory, so the limit is lifted while
torch.compile runs and re-based after.
"""

from __future__ import annotations

import resource
from typing import Any

from torch._dynamo.callback import callback_handler

from stepwatch.exporter.memory import _status

TRIM_SLACK_BYTES = 64 << 20  # above the last trimmed RSS by this much after a request: return freed heap


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
