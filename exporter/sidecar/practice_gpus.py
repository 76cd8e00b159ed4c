"""Stand-in GPUs for the practice stack: an NvmlProvider whose state is a JSON file.

The practice service runs on CPUs, so NVML has nothing to report and every GPU check of the
runbooks answers "no data".  A drill that means "rank 1's GPU throttles" needs NVML to say so,
the way a real driver does: this provider reads its devices from a file the drill writes
(``stepwatch sidecar --practice-gpus FILE``), on every scrape.  No file is no NVML at all (the
sidecar then exports what it exports on a CPU host, ``stepwatch_nvml_up 0``, and looks for the file
again every second); a file with ``count: 0`` is NVML with no GPU.  It is the one fake of the
sidecar's GPU side, behind the same interface as pynvml; it is never used unless named.

    {"count": 2, "throttle": {"1": ["sw_thermal_slowdown"]}, "sm_clock_mhz": {"1": 1110}}

``throttle`` names reasons of nvml.THROTTLE_REASONS per device index; ``sm_clock_mhz`` overrides
a device's clock (default DEFAULT_CLOCK_MHZ).  Memory, utilization, temperature and power are
fixed, plausible values: nothing on the practice stack reads them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stepwatch.exporter.sidecar.nvml import THROTTLE_REASONS

DEFAULT_CLOCK_MHZ = 1980.0
TOTAL_BYTES = 141 * 2**30
_BITS = {name: bit for bit, name in THROTTLE_REASONS}


class PracticeGpuError(ValueError):
    pass


def parse_state(data: Any, where: str) -> dict[str, Any]:
    """The file's content, checked: a clear error names the file and the key."""
    if data is None:
        return {"count": 0, "throttle": {}, "sm_clock_mhz": {}}
    if not isinstance(data, dict) or set(data) - {"count", "throttle", "sm_clock_mhz"}:
        raise PracticeGpuError(f"{where}: an object with count, throttle, sm_clock_mhz")
    count = data.get("count", 0)
    if not isinstance(count, int) or count < 0:
        raise PracticeGpuError(f"{where}: count is a whole number of GPUs, got {count!r}")
    throttle = {int(k): list(v) for k, v in (data.get("throttle") or {}).items()}
    unknown = sorted({r for rs in throttle.values() for r in rs} - set(_BITS))
    if unknown:
        raise PracticeGpuError(f"{where}: unknown throttle reason(s) {unknown}; known: {sorted(_BITS)}")
    clocks = {int(k): float(v) for k, v in (data.get("sm_clock_mhz") or {}).items()}
    return {"count": count, "throttle": throttle, "sm_clock_mhz": clocks}


def write_state(path: Path, count: int, throttle: dict[int, list[str]] | None = None,
                sm_clock_mhz: dict[int, float] | None = None) -> None:
    """What a drill calls: the devices the sidecar reports from its next scrape on (written atomically)."""
    data = {"count": count, "throttle": {str(k): v for k, v in (throttle or {}).items()},
            "sm_clock_mhz": {str(k): v for k, v in (sm_clock_mhz or {}).items()}}
    parse_state(data, str(path))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


class PracticeGpus:
    """NvmlProvider over the state file; a malformed file raises (the reader counts it as a read error)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._cached: tuple[int, dict[str, Any]] | None = None  # (mtime_ns, state): read once per change

    def _state(self) -> dict[str, Any]:
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return parse_state(None, str(self.path))
        if self._cached is not None and self._cached[0] == mtime:
            return self._cached[1]
        text = self.path.read_text()
        try:
            state = parse_state(json.loads(text) if text.strip() else None, str(self.path))
        except json.JSONDecodeError as e:
            raise PracticeGpuError(f"{self.path}: not JSON ({e})") from None
        self._cached = (mtime, state)
        return state

    def init(self) -> None:
        if not self.path.exists():
            raise PracticeGpuError(f"{self.path}: no stand-in GPUs yet (no state file)")
        self._state()

    def shutdown(self) -> None:
        pass

    def device_count(self) -> int:
        return int(self._state()["count"])

    def memory(self, index: int) -> tuple[int, int]:
        return 0, TOTAL_BYTES

    def utilization_percent(self, index: int) -> float:
        return 0.0

    def sm_clock_mhz(self, index: int) -> float:
        return float(self._state()["sm_clock_mhz"].get(index, DEFAULT_CLOCK_MHZ))

    def temperature_celsius(self, index: int) -> float:
        return 40.0

    def power_milliwatts(self, index: int) -> float:
        return 100_000.0

    def throttle_reasons(self, index: int) -> int:
        mask = 0
        for reason in self._state()["throttle"].get(index, []):
            mask |= _BITS[reason]
        return mask

    def xid_errors(self, index: int) -> int | None:
        return 0
