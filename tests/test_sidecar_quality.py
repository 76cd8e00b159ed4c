"""PSNR / SSIM on known inputs, video worst frame, and the set quantiles."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stepwatch.exporter.sidecar.quality import (
    ShapeMismatch,
    psnr,
    quantile,
    score,
    score_frames,
    ssim,
    summarize,
)


def img(seed: int = 0, h: int = 64, w: int = 48) -> np.ndarray:
    return np.random.default_rng(seed).integers(20, 200, size=(h, w, 3), dtype=np.uint8)


def test_identical_is_inf_and_one() -> None:
    a = img()
    assert psnr(a, a.copy()) == math.inf
    assert ssim(a, a.copy()) == pytest.approx(1.0, abs=1e-12)
    s = score(a, a)
    assert (s.psnr, s.frames, s.worst_psnr_frame) == (math.inf, 1, None)


def test_known_perturbation_gives_the_computed_psnr() -> None:
    a = img()
    b = a + np.uint8(8)  # every pixel off by 8: MSE = 64
    assert psnr(b, a) == pytest.approx(20 * math.log10(255 / 8), abs=1e-9)  # 30.07 dB
    c = a.copy()
    c[0, 0, 0] += 51  # one pixel off by 51 in 64*48*3 values
    assert psnr(c, a) == pytest.approx(10 * math.log10(255**2 / (51**2 / (64 * 48 * 3))), abs=1e-9)


def test_ssim_drops_with_noise_and_handles_grey_and_small_images() -> None:
    a = img(1)
    rng = np.random.default_rng(5)
    light = np.clip(a + rng.normal(0, 3, a.shape), 0, 255).astype(np.uint8)
    heavy = np.clip(a + rng.normal(0, 40, a.shape), 0, 255).astype(np.uint8)
    assert 1.0 > ssim(light, a) > ssim(heavy, a) > 0
    g = a[:, :, 0]
    assert ssim(g, g) == pytest.approx(1.0) and psnr(g, g) == math.inf
    tiny = img(2, 4, 5)  # smaller than the default 7x7 window
    assert ssim(tiny, tiny) == pytest.approx(1.0)


def test_shape_mismatch_is_an_error_not_a_score() -> None:
    with pytest.raises(ShapeMismatch, match="differs"):
        psnr(img(h=64), img(h=32))
    with pytest.raises(ShapeMismatch, match="frames"):
        score_frames([img(), img()], [img()])


def test_video_reports_the_worst_frame() -> None:
    frames = [img(s) for s in range(5)]
    probe = [f.copy() for f in frames]
    probe[1] = probe[1] + np.uint8(2)
    probe[3] = probe[3] + np.uint8(16)
    s = score_frames(np.stack(probe), np.stack(frames))
    assert s.frames == 5
    assert s.worst_psnr_frame == 3 and s.worst_ssim_frame == 3
    assert s.psnr == pytest.approx(20 * math.log10(255 / 16))


def test_quantiles_are_values_that_occurred_and_survive_inf() -> None:
    vals = [math.inf] * 17 + [25.0, 31.0, 40.0]
    q = summarize(vals)
    assert q == {"p50": math.inf, "p10": 31.0, "min": 25.0}  # sorted index floor(0.1 * 19) = 1
    assert quantile([33.0], 0.1) == 33.0
    with pytest.raises(ValueError):
        quantile([], 0.5)
