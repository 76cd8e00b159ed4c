"""Quality of a rendered set against its fixed-seed baseline, and the intervals the evaluation reports.

Each item is scored against the baseline item of the same prompt and seed: PSNR and SSIM (a video by its worst
frame, what a viewer sees), and LPIPS where its package and weights are on this machine.  Over the set the
report gives p50 and p10 (lower interpolation: a value that occurred) and a 95% percentile-bootstrap interval
of the p10, since the working point is decided on it: with 20 items the p10 is the second worst, and its
interval says how much one more bad item would move it.  Identical items score PSNR ``inf`` (JSON: "inf").
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from stepwatch.bench.paired import BOOTSTRAP_RESAMPLES
from stepwatch.exporter.sidecar.quality import quantile, score, score_frames

P10 = 0.1


@dataclass(frozen=True)
class ItemScore:
    psnr: float
    ssim: float
    worst_frame: int | None = None  # a video's frame with the lowest PSNR


def score_item(output: NDArray[np.uint8], baseline: NDArray[np.uint8]) -> ItemScore:
    """One item against its baseline: an image as a whole, a video frame by frame (its worst frame)."""
    if output.ndim == 4:
        s = score_frames(list(output), list(baseline))
        return ItemScore(s.psnr, s.ssim, s.worst_psnr_frame)
    s = score(output, baseline)
    return ItemScore(s.psnr, s.ssim)


def quantile_interval(values: Sequence[float], q: float, seed: int = 0,
                      resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the q-quantile of ``values`` (resampling items)."""
    rng = random.Random(seed)
    vals = list(values)
    stats = sorted(quantile(rng.choices(vals, k=len(vals)), q) for _ in range(resamples))
    return stats[int(resamples * 0.025)], stats[int(resamples * 0.975) - 1]


def summarize(scores: Sequence[ItemScore]) -> dict[str, Any]:
    """p50 and p10 of PSNR and SSIM over the set, each p10 with its interval; a video's worst frame."""
    out: dict[str, Any] = {"n": len(scores)}
    for metric in ("psnr", "ssim"):
        vals = [getattr(s, metric) for s in scores]
        lo, hi = quantile_interval(vals, P10)
        out[metric] = {"p50": quantile(vals, 0.5), "p10": quantile(vals, P10), "p10_interval": [lo, hi]}
    frames = [s for s in scores if s.worst_frame is not None]
    if frames:
        worst = min(frames, key=lambda s: s.psnr)
        out["worst_frame"] = {"item": scores.index(worst), "frame": worst.worst_frame, "psnr": worst.psnr}
    return out


def lpips_availability() -> str | None:
    """None when LPIPS can be measured here; else why not (its weights are never downloaded from here)."""
    import importlib.util

    if importlib.util.find_spec("lpips") is None:
        return "not measured: the lpips package is not installed (pip install lpips, with its AlexNet weights)"
    from pathlib import Path

    import torch

    hub = Path(torch.hub.get_dir()) / "checkpoints"
    if not any(hub.glob("alexnet-*.pth")):
        return f"not measured: AlexNet's weights are not in torch's hub cache ({hub.name}); none are downloaded"
    return None


def lpips_scores(outputs: Sequence[NDArray[np.uint8]], baselines: Sequence[NDArray[np.uint8]]) -> list[float]:
    """LPIPS (AlexNet) of each item against its baseline, a video by its worst frame; needs lpips_availability()."""
    import lpips
    import torch

    net = lpips.LPIPS(net="alex", verbose=False)

    def tensor(a: NDArray[np.uint8]) -> Any:
        frames = a if a.ndim == 4 else a[None]
        return torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 127.5 - 1.0

    with torch.no_grad():
        return [float(net(tensor(o), tensor(b)).max()) for o, b in zip(outputs, baselines, strict=True)]


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float as a string ("inf"), which strict JSON readers (jq) accept."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
