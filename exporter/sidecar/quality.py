"""PSNR and SSIM of 8-bit images and video-shaped probes against their baseline.

Lossy optimizations have no perplexity: quality is measured by comparing a
fixed prompt x seed set with stored baseline outputs.  Videos are judged by
their worst frame, since one bad frame is what a viewer sees.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

MAX_8BIT = 255.0
# (value of the `stat` label, q): the label is not `quantile`, which Prometheus reserves for summaries.
QUANTILES: tuple[tuple[str, float], ...] = (("p50", 0.5), ("p10", 0.1), ("min", 0.0))


class ShapeMismatch(ValueError):
    """The probe output and the baseline have different shapes (a different probe, not a quality loss)."""


def _as_image(a: NDArray[np.generic], what: str) -> NDArray[np.float64]:
    if a.ndim == 2:
        a = a[:, :, None]
    if a.ndim != 3:
        raise ShapeMismatch(f"{what}: expected HxW or HxWxC, got shape {a.shape}")
    return a.astype(np.float64)


def _pair(a: NDArray[np.generic], b: NDArray[np.generic]) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    x, y = _as_image(np.asarray(a), "image"), _as_image(np.asarray(b), "baseline")
    if x.shape != y.shape:
        raise ShapeMismatch(f"image shape {x.shape} differs from baseline shape {y.shape}")
    return x, y


def psnr(image: NDArray[np.generic], baseline: NDArray[np.generic]) -> float:
    """PSNR in dB for 8-bit images; ``inf`` when identical."""
    x, y = _pair(image, baseline)
    mse = float(np.mean((x - y) ** 2))
    if mse == 0.0:
        return math.inf
    return 10.0 * math.log10(MAX_8BIT * MAX_8BIT / mse)


def ssim(image: NDArray[np.generic], baseline: NDArray[np.generic]) -> float:
    """SSIM (scikit-image, per channel, 8-bit data range); 1.0 when identical."""
    from skimage.metrics import structural_similarity  # lazy: scikit-image is slow to import and optional

    x, y = _pair(image, baseline)
    h, w, _ = x.shape
    side = min(h, w)
    if side < 3:
        raise ShapeMismatch(f"image {h}x{w} is too small for SSIM (needs at least 3x3)")
    win = min(7, side if side % 2 else side - 1)
    return float(structural_similarity(x, y, data_range=MAX_8BIT, channel_axis=2, win_size=win))


@dataclass(frozen=True)
class Score:
    """Quality of one probe: for a video, the worst frame's PSNR and SSIM, where they are, and every frame's."""

    psnr: float
    ssim: float
    frames: int = 1
    worst_psnr_frame: int | None = None
    worst_ssim_frame: int | None = None
    frame_psnr: tuple[float, ...] = ()  # a video's per-frame scores (empty for an image)
    frame_ssim: tuple[float, ...] = ()


def score(image: NDArray[np.generic], baseline: NDArray[np.generic]) -> Score:
    """One image (HxW[xC]) against its baseline."""
    return Score(psnr(image, baseline), ssim(image, baseline))


def score_frames(frames: Sequence[NDArray[np.generic]] | NDArray[np.generic],
                 baseline: Sequence[NDArray[np.generic]] | NDArray[np.generic]) -> Score:
    """A video (F frames) against its baseline, frame by frame; reports the worst frame."""
    if len(frames) != len(baseline):
        raise ShapeMismatch(f"{len(frames)} frames differ from the baseline's {len(baseline)}")
    if len(frames) == 0:
        raise ShapeMismatch("no frames")
    ps = [psnr(f, b) for f, b in zip(frames, baseline, strict=True)]
    ss = [ssim(f, b) for f, b in zip(frames, baseline, strict=True)]
    wp, ws = int(np.argmin(ps)), int(np.argmin(ss))
    return Score(ps[wp], ss[ws], len(ps), wp, ws, tuple(ps), tuple(ss))


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile as a value that occurred (lower interpolation): safe with ``inf`` PSNRs."""
    if not values:
        raise ValueError("no values")
    s = sorted(values)
    return s[math.floor(q * (len(s) - 1))]


def summarize(values: Sequence[float]) -> dict[str, float]:
    """{p50, p10, min} over a probe set (the values of the `stat` label the alert and dashboards read)."""
    return {name: quantile(values, q) for name, q in QUANTILES}
