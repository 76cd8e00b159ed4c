"""The worker's video side: the Wan VAE's frame-chunked decode, the MP4 encoder, a job's cancellation.

Only the worker process imports this module (it imports torch and PyAV).

**Decode.**  Wan's VAE is causal in time: each decoder call carries a cache of the frames before it, so a
clip can be decoded a few latent frames at a time with the same result (tested to float rounding).  The
knob ``video_decode_chunk_frames`` says how many latent frames one call takes: memory grows with it
(full-resolution feature maps of every frame in the call), and 0 decodes the whole clip in one call, which
for a long clip is the untiled video decode that does not fit (the seeds: 100+ GiB at 720p on a GPU; here
a 256x256 x 121-frame clip fails the worker's budget in seconds).  Above the VAE's tile size, VAE tiling
(``vae_tiling``) decodes spatial tiles instead, one frame at a time (diffusers' own tiled decode).

**Encoding.**  H.264 in MP4 through PyAV (FFmpeg's libraries, a PyPI wheel): yuv420p, one encoder thread
(x264 then writes the same bytes for the same frames, so a quality probe's baseline is reproducible).
"""

from __future__ import annotations

import io
import types
from typing import Any

import numpy as np
from numpy.typing import NDArray

CONTENT_TYPE = "video/mp4"
CRF = "18"  # visually lossless for H.264: the codec's own loss stays far below the video quality gate


class JobCancelled(Exception):
    """Raised from the step callback when the job's client cancelled it; the exporter counts it as cancelled."""

    stepwatch_outcome = "cancelled"


def _chunked_decode(self: Any, z: Any, return_dict: bool = True) -> Any:
    """AutoencoderKLWan._decode with ``self._stepwatch_chunk`` latent frames per decoder call (0: all)."""
    import torch
    from diffusers.models.autoencoders.vae import DecoderOutput

    _, _, frames, height, width = z.shape
    tile_h = self.tile_sample_min_height // self.spatial_compression_ratio
    tile_w = self.tile_sample_min_width // self.spatial_compression_ratio
    if self.use_tiling and (width > tile_w or height > tile_h):
        return self.tiled_decode(z, return_dict=return_dict)
    chunk = int(getattr(self, "_stepwatch_chunk", 1))
    self.clear_cache()
    x = self.post_quant_conv(z)
    outs = []
    i = 0
    while i < frames:  # the first latent frame alone (it decodes to one frame), then chunks
        j = 1 if i == 0 else (frames if chunk <= 0 else min(frames, i + chunk))
        self._conv_idx = [0]
        outs.append(self.decoder(x[:, :, i:j], feat_cache=self._feat_map, feat_idx=self._conv_idx,
                                 first_chunk=i == 0))
        i = j
    self.clear_cache()
    out = torch.cat(outs, 2)
    del outs
    if self.config.patch_size is not None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        out = unpatchify(out, patch_size=self.config.patch_size)
    out = torch.clamp(out, min=-1.0, max=1.0)
    return DecoderOutput(sample=out) if return_dict else (out,)


def set_decode_chunk(vae: Any, latent_frames: int) -> None:
    """Decode ``latent_frames`` latent frames per decoder call (0: the whole clip at once)."""
    if getattr(vae, "_stepwatch_chunked", False) is False:
        vae._decode = types.MethodType(_chunked_decode, vae)
        vae._stepwatch_chunked = True
    vae._stepwatch_chunk = int(latent_frames)


def to_uint8(frames: NDArray[Any]) -> tuple[NDArray[np.uint8], int]:
    """(F, H, W, 3) floats in [0, 1] -> uint8 frames, and how many were non-finite or all black."""
    bad = 0
    out = np.empty(frames.shape, dtype=np.uint8)
    for i, f in enumerate(frames):
        finite = bool(np.isfinite(f).all())
        u8 = (np.clip(np.nan_to_num(f, nan=0.0, posinf=1.0, neginf=0.0), 0.0, 1.0) * 255.0).round()
        out[i] = u8.astype(np.uint8)
        if not finite or int(out[i].max()) == 0:
            bad += 1
    return out, bad


def encode_mp4(frames: NDArray[np.uint8], fps: int) -> bytes:
    """H.264 in MP4 (yuv420p, one thread: the same frames give the same bytes)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"crf": CRF, "preset": "veryfast"})
        stream.height, stream.width = int(frames.shape[1]), int(frames.shape[2])
        stream.pix_fmt = "yuv420p"
        stream.codec_context.thread_count = 1
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()
