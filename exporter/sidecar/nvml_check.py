"""Print what the real NVML provider reads, and what the collector exports from it.

For a machine with a GPU (``python -m stepwatch.exporter.sidecar.nvml_check``):
checks that every field the sidecar exports is readable there, in base units.
Without NVML it says so and exits 0, so it is safe anywhere.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from stepwatch.exporter.sidecar.nvml import NvmlCollector, PynvmlProvider, throttle_labels


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepwatch.exporter.sidecar.nvml_check", description=__doc__)
    parser.add_argument("--strict", action="store_true", help="exit 1 if any field of any GPU is unreadable")
    args = parser.parse_args(argv)
    provider = PynvmlProvider()
    try:
        provider.init()
    except Exception as e:
        print(f"NVML is not available here ({type(e).__name__}: {e}); nothing to check. "
              "The sidecar reports stepwatch_nvml_up 0 on such machines.")
        return 0
    def throttle(i: int) -> str:
        mask = provider.throttle_reasons(i)
        return f"0x{mask:x} active: {[r for r, on in throttle_labels(mask).items() if on] or 'none'}"

    reads: list[tuple[str, Callable[[int], Any]]] = [
        ("memory (used, total) bytes", provider.memory),
        ("utilization %", provider.utilization_percent),
        ("SM clock MHz", provider.sm_clock_mhz),
        ("temperature C", provider.temperature_celsius),
        ("power mW", provider.power_milliwatts),
        ("throttle reasons", throttle),
        ("XID errors since init", provider.xid_errors),
    ]
    unreadable = 0
    try:
        n = provider.device_count()
        print(f"NVML initialized: {n} GPU(s)")
        for i in range(n):
            print(f"GPU {i}:")
            for label, fn in reads:
                try:
                    print(f"  {label:28s} {fn(i)}")
                except Exception as e:
                    unreadable += 1
                    print(f"  {label:28s} UNREADABLE: {type(e).__name__}: {e}")
    finally:
        provider.shutdown()

    registry = CollectorRegistry()
    collector = NvmlCollector(PynvmlProvider())
    registry.register(collector)
    print("\nexposition (what /metrics serves):")
    print(generate_latest(registry).decode())
    collector.close()
    if unreadable:
        print(f"{unreadable} field(s) unreadable (counted in stepwatch_gpu_read_errors_total by the sidecar)")
    return 1 if (unreadable and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
