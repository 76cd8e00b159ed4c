"""The drift probe: one fixed streaming session against its baseline session, scored chunk by chunk.

An autoregressive video model feeds each chunk on its own past chunks, so an error made late is carried into
every later chunk: the picture drifts from what the same session (prompt, seed, deployment fingerprint)
looked like when the baseline was captured, and an early-chunk check cannot see it.  This prober runs the
stream probe set (``config.default_stream_probe_set``: a session of 8 chunks at 64x64) through the public
session API as a viewer would, keeps each chunk's last frame, and exports the worst PSNR and SSIM per range
of chunk index (the exporter's bounded ranges: a chunk index never becomes a label value) and the slope of
PSNR over chunk index.  Everything else (cadence, baseline store and fingerprint, failures, the probe-failing
series) is the image prober's.  It does not export the set's PSNR quantiles: the quality alerts judge image
and video sets, the drift alert judges this one by chunk range.
"""

from __future__ import annotations

import math
from typing import Any

from stepwatch.exporter.chunks import INDEX_RANGES, index_range
from stepwatch.exporter.sidecar.prober import ImageOutcome, Prober, ProbeResult

SLOPE_CAP_DB = 60.0  # identical chunks (+Inf dB) count as this in the slope: the capture's determinism floor


def worst_by_range(values: list[float]) -> dict[str, float]:
    """The lowest value of each chunk-index range that has chunks ({range label: value})."""
    out: dict[str, float] = {}
    for i, v in enumerate(values):
        r = index_range(i)
        out[r] = min(out.get(r, math.inf), v)
    return out


def slope(values: list[float], cap: float = SLOPE_CAP_DB) -> float:
    """Least-squares slope of ``values`` (capped at ``cap``) over their index; 0 for fewer than two."""
    ys = [min(v, cap) for v in values]
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sum((x - mx) ** 2 for x in range(n))


def chunk_scores(outcomes: list[ImageOutcome]) -> tuple[list[float], list[float]]:
    """Per chunk index, the worst PSNR and SSIM over the set's sessions (each frame is one chunk's last)."""
    psnr: list[float] = []
    ssim: list[float] = []
    for o in outcomes:
        for i, (p, s) in enumerate(zip(o.frame_psnr, o.frame_ssim, strict=False)):
            if i < len(psnr):
                psnr[i], ssim[i] = min(psnr[i], p), min(ssim[i], s)
            else:
                psnr.append(p)
                ssim.append(s)
    return psnr, ssim


class StreamProber(Prober):
    """A ``Prober`` for a stream probe set: exports chunk-range PSNR/SSIM and the PSNR slope instead of the
    set's quantiles (``stepwatch_quality_stream_*``)."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        # The SSIM alert judges sets by their worst-frame quantile, which a stream set does not export: no SSIM
        # gate for it (0), so the video-quality panels and that alert leave it to the drift alert.
        self.ssim_gate_alerted = 0.0
        self.metrics.quality_ssim_gate_ratio.labels(self.probe_set.name).set(0.0)

    def _export_scores(self, res: ProbeResult) -> None:
        m, name = self.metrics, self.probe_set.name
        psnr, ssim = chunk_scores(res.scored)
        if not psnr:
            return
        worst_psnr, worst_ssim = worst_by_range(psnr), worst_by_range(ssim)
        for label, value in worst_psnr.items():
            m.quality_stream_chunk_psnr_decibels.labels(name, label).set(value)
            m.quality_stream_chunk_ssim_ratio.labels(name, label).set(worst_ssim[label])
        m.quality_stream_psnr_slope_decibels.labels(name).set(slope(psnr))
        self._clear_ranges(set(worst_psnr))

    def _clear_quality(self, keep: set[str] | None = None) -> None:
        self._clear_ranges(set())

    def _clear_ranges(self, keep: set[str]) -> None:
        """Drop the ranges not measured now (a shorter probe session, a stale baseline)."""
        m, name = self.metrics, self.probe_set.name
        for _, _, label in INDEX_RANGES:
            if label in keep:
                continue
            for g in (m.quality_stream_chunk_psnr_decibels, m.quality_stream_chunk_ssim_ratio):
                try:
                    g.remove(name, label)
                except KeyError:
                    pass
        if not keep:
            try:
                m.quality_stream_psnr_slope_decibels.remove(name)
            except KeyError:
                pass
