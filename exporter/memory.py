"""Peak memory per request and per stage, and the capacity it is measured against.

CUDA: the caching allocator's peak allocated bytes, reset at each boundary.
CPU: the process high-water mark (VmHWM), reset through /proc/self/clear_refs.
On CPU the capacity is what the worker may still touch: with an address-space
budget (RLIMIT_AS) it is resident memory plus the address space left, since an
allocation beyond that fails whatever the RSS; else the cgroup limit or RAM.
"""

from __future__ import annotations

import os
import re
import resource
from typing import Any, Protocol

_OOM_PATTERNS = ("can't allocate memory", "out of memory", "not enough memory", "cannot allocate memory")
_BYTES_RE = re.compile(r"tried to allocate (\d+) bytes", re.I)
_UNITS_RE = re.compile(r"tried to allocate ([\d.]+) ?(GiB|MiB|KiB|B)\b", re.I)
_UNIT = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    if isinstance(exc, RuntimeError):
        msg = str(exc).lower()
        return any(p in msg for p in _OOM_PATTERNS)
    return False


def oom_requested_bytes(exc: BaseException) -> int | None:
    """The allocation that failed, parsed from the allocator's message."""
    msg = str(exc)
    m = _BYTES_RE.search(msg)
    if m:
        return int(m.group(1))
    m = _UNITS_RE.search(msg)
    if m:
        return int(float(m.group(1)) * _UNIT[m.group(2).lower()])
    return None


class MemoryProbe(Protocol):
    device: str

    def reset_peak(self, check: bool = False) -> None: ...

    def peak_bytes(self) -> int: ...

    def in_use_bytes(self) -> int: ...

    def capacity_bytes(self) -> int: ...


class _ProcStatus:
    """/proc/self/status read through one open descriptor (pread regenerates it): ~5 us a read."""

    def __init__(self) -> None:
        self._fd: int | None = None

    def read(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for line in self._raw().split(b"\n"):
            if line.startswith(b"Vm"):
                k, v = line.split(b":", 1)
                out[k.decode()] = int(v.split()[0]) * 1024
        return out

    def field(self, name: bytes) -> int:
        raw = self._raw()
        i = raw.find(name)
        if i < 0:
            return 0
        j = raw.find(b"\n", i)
        return int(raw[i + len(name) + 1:j].split()[0]) * 1024

    def _raw(self) -> bytes:
        if self._fd is None:
            self._fd = os.open("/proc/self/status", os.O_RDONLY)
        return os.pread(self._fd, 8192, 0)


_STATUS = _ProcStatus()


def _status() -> dict[str, int]:
    return _STATUS.read()


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                v = f.read().strip()
        except OSError:
            continue
        if v.isdigit() and int(v) < (1 << 60):
            return int(v)
    return None


def _ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


class ProcessMemory:
    """Host memory of this process (Linux procfs).

    The high-water mark is reset through /proc/self/clear_refs and read with
    getrusage (0.7 us) when that is exact: getrusage reports max(mm high-water,
    a per-process maximum that exiting threads leave behind).  When the latter
    is stale (above the RSS right after a reset) the window falls back to
    VmHWM from /proc/self/status (~7 us).
    """

    device = "cpu"
    _SLACK = 8 << 20

    def __init__(self) -> None:
        self._clear_fd: int | None = None
        self._statm_fd: int | None = None
        self._can_reset = True
        self._fast = False
        self._checked = False
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._static_capacity = _cgroup_limit() or _ram()

    def reset_peak(self, check: bool = False) -> None:
        """Start a new window.  ``check`` (once per request, at its start) also decides whether getrusage is
        exact now: only a thread's exit makes it stale, and in a real request each check cost ~30 us (three
        syscalls on a heap the model just churned), so the stage boundaries skip it."""
        if not self._can_reset:
            return
        try:
            if self._clear_fd is None:
                self._clear_fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
            os.write(self._clear_fd, b"5")
        except OSError:
            self._can_reset = False  # peak then covers the process lifetime; still an upper bound
            self._fast = False
            return
        if check or not self._checked:
            self._checked = True
            self._fast = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 <= self.in_use_bytes() \
                + self._SLACK

    def peak_bytes(self) -> int:
        if self._fast:
            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        return _STATUS.field(b"VmHWM")

    def in_use_bytes(self) -> int:
        if self._statm_fd is None:
            self._statm_fd = os.open("/proc/self/statm", os.O_RDONLY)
        return int(os.pread(self._statm_fd, 128, 0).split()[1]) * self._page

    def capacity_bytes(self) -> int:
        soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            st = _status()
            return st.get("VmRSS", 0) + max(0, soft - st.get("VmSize", 0))
        return self._static_capacity


class CudaMemory:
    """Peak allocated bytes on one CUDA device; no synchronization involved."""

    def __init__(self, index: int) -> None:
        import torch  # lazy: importing stepwatch.exporter must not import torch (sidecar, rules tools)

        self._cuda: Any = torch.cuda
        self._index = index
        self.device = f"cuda:{index}"
        self._total = int(torch.cuda.get_device_properties(index).total_memory)

    def reset_peak(self, check: bool = False) -> None:
        self._cuda.reset_peak_memory_stats(self._index)

    def peak_bytes(self) -> int:
        return int(self._cuda.max_memory_allocated(self._index))

    def in_use_bytes(self) -> int:
        return int(self._cuda.memory_allocated(self._index))

    def capacity_bytes(self) -> int:
        return self._total


def probe_for(device: Any) -> MemoryProbe:
    if getattr(device, "type", None) == "cuda":
        idx = device.index if device.index is not None else 0
        return CudaMemory(idx)
    return ProcessMemory()
