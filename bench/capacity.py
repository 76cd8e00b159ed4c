"""The seeds' capacity arithmetic: seconds per image from the FLOPs ledger, and instances from GPU-seconds.

Instances are set by GPU-seconds, not by latency: ``QPS x seconds per image x headroom`` GPUs serve a load,
whatever the parallel degree (sequence parallelism on 4 GPUs cuts the latency 4x and leaves the GPU-seconds,
and so the count, as they were).  The headroom (1.3) keeps the queue short at the peak.  A ledger gives the
seconds a step costs at a given MFU: ``FLOPs per step / (peak FLOP/s x MFU)``.  tests/test_evaluate.py checks
both against the seeds' worked example one (FLUX.1-dev 1024^2 on H100s at 100 QPS).
"""

from __future__ import annotations

HEADROOM = 1.3
H100_BF16_DENSE_FLOPS = 989e12  # H100 SXM, dense BF16 tensor-core peak


def gpus_for(qps: float, gpu_seconds: float, headroom: float = HEADROOM) -> float:
    """GPUs that serve ``qps`` requests per second of ``gpu_seconds`` each, with ``headroom``."""
    if qps < 0 or gpu_seconds < 0 or headroom < 1:
        raise ValueError("qps and gpu_seconds must be >= 0 and headroom >= 1")
    return qps * gpu_seconds * headroom


def machines_for(gpus: float, per_machine: int = 8) -> int:
    """Machines of ``per_machine`` GPUs for ``gpus``, to the nearest one as the seeds round (234 GPUs: 29 of 8;
    the headroom already covers the fraction)."""
    return max(1, round(gpus / per_machine)) if gpus else 0


def seconds_from_ledger(flops_per_step: float, steps: int, peak_flops: float, mfu: float) -> float:
    """Denoising seconds of one request: its steps' FLOPs at ``mfu`` of ``peak_flops``."""
    if not 0 < mfu <= 1 or peak_flops <= 0:
        raise ValueError("mfu must be within (0, 1] and peak_flops > 0")
    return flops_per_step * steps / (peak_flops * mfu)
