"""Capture the quality baseline: run the probe set once and store its images.

The images are stored with the service's deployment fingerprint (from
``GET /v1/stepwatch/info``) and sha256 checksums; the sidecar compares later
probes with them.  Rerun after every deployment change (image, libraries,
compile, parallel degree), since outputs are only reproducible within one.
A failed capture leaves the previous baseline untouched.  The command line is
``cli_capture`` (``stepwatch baseline capture``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from numpy.typing import NDArray

from stepwatch.exporter.sidecar.baseline import BaselineStore
from stepwatch.exporter.sidecar.client import ProbeError, ServiceClient, ServiceInfo
from stepwatch.exporter.sidecar.config import ProbeSet
from stepwatch.exporter.sidecar.quality import psnr

log = logging.getLogger("stepwatch.sidecar.capture")

DEFAULT_OUT = "baselines"
DEFAULT_TIMEOUT_S = 120.0
# A repeated probe must reproduce the capture; anything below this means the service is not deterministic.
DETERMINISM_MIN_DB = 60.0


class CaptureError(RuntimeError):
    """The capture could not be completed; nothing was written."""


@dataclass
class CaptureResult:
    path: Path
    fingerprint_id: str
    instance_id: str
    probes: int
    cost_seconds: float
    gpus: int
    repeat_psnr_db: float | None


def _probe_all(client: ServiceClient, probe_set: ProbeSet, info: ServiceInfo, timeout_s: float,
               ) -> tuple[dict[str, Any], list[float], list[float]]:
    """Every probe once, all answered by the fingerprint read before: (frames by probe, service seconds, walls)."""
    outputs: dict[str, Any] = {}
    seconds: list[float] = []
    walls: list[float] = []
    for item in probe_set.items:
        try:
            gen = client.generate(item, timeout_s)
        except ProbeError as e:
            raise CaptureError(f"probe {item.id}: {e}") from None
        if gen.fingerprint_id is not None and gen.fingerprint_id != info.fingerprint_id:
            raise CaptureError(f"probe {item.id} was answered by fingerprint {gen.fingerprint_id}, not "
                               f"{info.fingerprint_id}: the deployment changed or a balancer mixes deployments")
        outputs[item.id] = gen.frames
        seconds.append(gen.service_seconds if gen.service_seconds is not None else gen.wall_seconds)
        walls.append(gen.wall_seconds)
    return outputs, seconds, walls


def _repeat_psnr(client: ServiceClient, probe_set: ProbeSet, outputs: dict[str, list[NDArray[Any]]],
                 timeout_s: float) -> float:
    """The first probe again: a deterministic service reproduces it (PSNR at least DETERMINISM_MIN_DB)."""
    first = probe_set.items[0]
    try:
        again = client.generate(first, timeout_s)
    except ProbeError as e:
        raise CaptureError(f"repeat of probe {first.id}: {e}") from None
    repeat = min(psnr(a, b) for a, b in zip(again.frames, outputs[first.id], strict=False))
    if repeat < DETERMINISM_MIN_DB:
        raise CaptureError(f"the same probe twice gives PSNR {repeat:.1f} dB (< {DETERMINISM_MIN_DB:g}): the "
                           "service is not deterministic for a seed, so probes would read noise as quality "
                           "loss; nothing stored")
    return repeat


def _info(client: ServiceClient, timeout_s: float, what: str) -> ServiceInfo:
    try:
        return client.info(min(timeout_s, 10.0))
    except ProbeError as e:
        raise CaptureError(f"{what}: {e}") from None


def capture_baseline(target: str, probe_set: ProbeSet, out: str | Path, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                     verify: bool = True) -> CaptureResult:
    """Run ``probe_set`` against ``target`` and store it under ``out``; raises ``CaptureError``."""
    client = ServiceClient(target)
    try:
        info = _info(client, timeout_s, "cannot read the deployment fingerprint")
        if info.ready is False:
            raise CaptureError(f"{target} is not ready (warm-up not finished); capture after /readyz answers 200")
        outputs, seconds, walls = _probe_all(client, probe_set, info, timeout_s)
        repeat = _repeat_psnr(client, probe_set, outputs, timeout_s) if verify else None
        after = _info(client, timeout_s, "cannot re-read the fingerprint after the capture")
        if after.fingerprint_id != info.fingerprint_id:
            raise CaptureError(f"the deployment fingerprint changed during the capture ({info.fingerprint_id} -> "
                               f"{after.fingerprint_id}); nothing stored")
        cost = sum(seconds)
        try:
            path = BaselineStore(out).save(probe_set, info, outputs, target=target, cost_seconds=cost,
                                           max_request_seconds=max(walls))
        except OSError as e:
            raise CaptureError(f"cannot write the baseline under {out}: {e}") from None
        return CaptureResult(path, info.fingerprint_id, info.instance_id, len(outputs), cost, info.gpus, repeat)
    finally:
        client.close()
