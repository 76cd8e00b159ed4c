"""The practice service's HTTP API as the prober and the capture command use it.

Every failure becomes a ``ProbeError`` with a reason from a bounded vocabulary
(the ``reason`` label of ``stepwatch_quality_probe_failures_total``).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from numpy.typing import NDArray

from stepwatch import httpclient
from stepwatch.exporter.sidecar.config import ProbeItem
from stepwatch.sse import parse_sse  # the same reader as the drills'

# http_<code> for the codes the service documents (and proxies commonly add); anything else is http_other.
HTTP_CODES = (400, 401, 403, 404, 408, 413, 422, 429, 500, 502, 503, 504, 507)
REASONS: tuple[str, ...] = ("connect", "timeout", "bad_response", "baseline", "not_ready",
                            *(f"http_{c}" for c in HTTP_CODES), "http_other")


class ProbeError(Exception):
    """A failed request: ``reason`` is a bounded label value, ``detail`` is for the log."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def http_reason(code: int) -> str:
    return f"http_{code}" if code in HTTP_CODES else "http_other"


def fingerprint_id_of(fingerprint: dict[str, Any]) -> str:
    """The contract's id: first 16 hex of sha256 over canonical JSON (used only when the service omits it)."""
    canon = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ServiceInfo:
    """``GET /v1/stepwatch/info``, the parts the sidecar needs."""

    instance_id: str
    fingerprint: dict[str, Any]
    fingerprint_id: str
    knobs: dict[str, Any] = field(default_factory=dict)
    ready: bool | None = None

    @property
    def gpus(self) -> int:
        """GPUs one request occupies (the parallel degree); 1 when the fingerprint does not say."""
        for k in ("ranks", "parallel_degree", "world_size"):
            v = self.fingerprint.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        return 1


@dataclass
class Generated:
    """One probe's output: frames as HxWx3 uint8 arrays, and what the service said about it."""

    frames: list[NDArray[np.uint8]]
    instance_id: str | None
    fingerprint_id: str | None
    service_seconds: float | None
    wall_seconds: float
    png: list[bytes]


def decode_png(data: bytes) -> list[NDArray[np.uint8]]:
    """PNG (or any multi-frame image PIL reads) -> RGB frames."""
    from PIL import Image, ImageSequence  # lazy: Pillow is the sidecar extra's; the base install imports this

    with Image.open(io.BytesIO(data)) as im:
        return [np.asarray(f.convert("RGB"), dtype=np.uint8).copy() for f in ImageSequence.Iterator(im)]


def decode_mp4(data: bytes) -> list[NDArray[np.uint8]]:
    """An MP4 (a video job's content) -> its RGB frames, in order."""
    import av  # lazy: PyAV is the sidecar extra's; the base install imports this module

    with av.open(io.BytesIO(data), mode="r") as container:
        return [np.asarray(f.to_ndarray(format="rgb24"), dtype=np.uint8) for f in container.decode(video=0)]


# A failed video job's error code -> the failure reason it counts as (the HTTP code an image request would get).
JOB_REASONS = {"out_of_memory": "http_507", "worker_died": "http_503", "shutting_down": "http_503",
               "timeout": "timeout"}
VIDEO_POLL_S = 0.2


def encode_png(frame: NDArray[np.uint8]) -> bytes:
    from PIL import Image  # lazy: Pillow is the sidecar extra's; the base install imports this

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frame)).save(buf, format="PNG")
    return buf.getvalue()


class ServiceClient:
    """The service's API over ``stepwatch.httpclient`` (keep-alive; tests swap the transport with
    ``httpclient.use_transport``)."""

    def __init__(self, target: str, *, connect_timeout_s: float = 5.0) -> None:
        self.target = target.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self._http = httpclient.client(self.target)

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, timeout_s: float, body: Any = None, raw: bool = False) -> Any:
        timeout = httpx.Timeout(max(0.001, timeout_s), connect=min(max(0.001, timeout_s), self.connect_timeout_s))
        try:
            r = self._http.request(method, path, json=body, timeout=timeout)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise ProbeError("connect", f"{method} {self.target}{path}: {e or type(e).__name__}") from None
        except httpx.TimeoutException:
            raise ProbeError("timeout", f"{method} {self.target}{path}: no answer within {timeout_s:.1f} s") from None
        except httpx.TransportError as e:
            raise ProbeError("connect", f"{method} {self.target}{path}: {type(e).__name__}: {e}") from None
        except httpx.HTTPError as e:  # not a transport failure: a body that does not decode, too many redirects
            raise ProbeError("bad_response", f"{method} {self.target}{path}: {type(e).__name__}: {e}") from None
        if r.status_code not in (200, 202):
            msg = r.text[:300].replace("\n", " ")
            raise ProbeError(http_reason(r.status_code), f"{method} {path}: HTTP {r.status_code}: {msg}")
        if raw:
            return r.content
        try:
            return r.json()
        except ValueError:
            raise ProbeError("bad_response", f"{method} {path}: answer is not JSON") from None

    def info(self, timeout_s: float = 5.0) -> ServiceInfo:
        d = self._request("GET", "/v1/stepwatch/info", timeout_s)
        if not isinstance(d, dict):
            raise ProbeError("bad_response", "/v1/stepwatch/info: not a JSON object")
        fp = d.get("fingerprint")
        if not isinstance(fp, dict):
            raise ProbeError("bad_response", "/v1/stepwatch/info: no 'fingerprint' object")
        fid = d.get("fingerprint_id") or fingerprint_id_of(fp)
        knobs: dict[str, Any] = d["knobs"] if isinstance(d.get("knobs"), dict) else {}
        ready = d.get("ready")
        return ServiceInfo(str(d.get("instance_id") or "unknown"), fp, str(fid), knobs,
                           ready if isinstance(ready, bool) else None)

    def generate_video(self, item: ProbeItem, timeout_s: float) -> Generated:
        """A video probe as a client runs one: create the job, poll it, download its MP4, decode the frames.
        ``timeout_s`` covers the whole job; a job that fails counts by its error (out_of_memory: http_507)."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        job = self._request("POST", "/v1/videos", timeout_s, item.video_body())
        jid = job.get("id") if isinstance(job, dict) else None
        if not isinstance(jid, str):
            raise ProbeError("bad_response", f"probe {item.id}: the video job answer has no id")
        while job.get("status") in ("queued", "in_progress"):
            if time.monotonic() > deadline:
                self._cancel(jid)
                raise ProbeError("timeout", f"probe {item.id}: video job {jid} not done within {timeout_s:.1f} s")
            time.sleep(VIDEO_POLL_S)
            job = self._request("GET", f"/v1/videos/{jid}", deadline - time.monotonic())
        if job.get("status") != "completed":
            err = job.get("error") or {}
            code = err.get("code", "") if isinstance(err, dict) else ""
            raise ProbeError(JOB_REASONS.get(code, "http_500"),
                             f"probe {item.id}: video job {jid} {job.get('status')}: {err}")
        data = self._request("GET", f"/v1/videos/{jid}/content", max(1.0, deadline - time.monotonic()), raw=True)
        try:
            frames = decode_mp4(data)
        except Exception as e:  # PyAV raises several kinds on a bad file
            raise ProbeError("bad_response", f"probe {item.id}: the video is not an MP4 ({e})") from None
        sw = job.get("stepwatch") if isinstance(job.get("stepwatch"), dict) else {}
        return self._generated(item, frames, sw, time.monotonic() - t0, [data])

    def _cancel(self, jid: str) -> None:
        try:
            self._http.request("DELETE", f"/v1/videos/{jid}", timeout=5.0)
        except httpx.HTTPError:
            pass  # best effort: the job ages out on the service anyway

    def generate_stream(self, item: ProbeItem, timeout_s: float) -> Generated:
        """A stream probe as a viewer runs one: open the session, read its chunks as they stream, keep each
        chunk's last frame.  ``timeout_s`` covers the whole session; a session that fails counts by its reason."""
        t0 = time.monotonic()
        frames: list[NDArray[np.uint8]] = []
        pngs: list[bytes] = []
        end: dict[str, Any] = {}
        try:
            with self._http.stream("POST", "/v1/stream/sessions", json=item.session_body(),
                                   timeout=timeout_s) as r:
                if r.status_code != 200:
                    r.read()
                    raise ProbeError(http_reason(r.status_code), f"probe {item.id}: HTTP {r.status_code}: "
                                     f"{r.text[:200]}")
                for kind, data in parse_sse(r.iter_lines()):
                    if time.monotonic() - t0 > timeout_s:
                        raise ProbeError("timeout", f"probe {item.id}: session not done within {timeout_s:.1f} s")
                    if kind == "chunk":
                        raw = base64.b64decode(data["frames"][-1], validate=True)
                        frames += decode_png(raw)
                        pngs.append(raw)
                    elif kind == "end":
                        end = data
        except httpx.TimeoutException:
            raise ProbeError("timeout", f"probe {item.id}: session not done within {timeout_s:.1f} s") from None
        except httpx.HTTPError as e:
            raise ProbeError("connect", f"probe {item.id}: {type(e).__name__}: {e}") from None
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ProbeError("bad_response", f"probe {item.id}: a chunk event without frames ({e})") from None
        if end.get("outcome") != "done":
            reason = "http_507" if end.get("reason") == "oom" else "http_500"
            raise ProbeError(reason, f"probe {item.id}: session ended {end.get('outcome')!r} ({end.get('reason')}) "
                             f"after {len(frames)} chunks: {str(end.get('message', ''))[:200]}")
        return self._generated(item, frames, {}, time.monotonic() - t0, pngs)

    def generate(self, item: ProbeItem, timeout_s: float) -> Generated:
        if item.is_stream:
            return self.generate_stream(item, timeout_s)
        if item.is_video:
            return self.generate_video(item, timeout_s)
        t0 = time.monotonic()
        d = self._request("POST", "/v1/images/generations", timeout_s, item.request_body())
        wall = time.monotonic() - t0
        data = d.get("data") if isinstance(d, dict) else None
        if not isinstance(data, list) or not data:
            raise ProbeError("bad_response", f"probe {item.id}: no 'data' list in the answer")
        pngs: list[bytes] = []
        frames: list[NDArray[np.uint8]] = []
        for n, entry in enumerate(data):
            b64 = entry.get("b64_json") if isinstance(entry, dict) else None
            if not isinstance(b64, str):
                raise ProbeError("bad_response", f"probe {item.id}: data[{n}] has no b64_json")
            try:
                raw = base64.b64decode(b64, validate=True)
                frames += decode_png(raw)
            except Exception as e:  # binascii and PIL raise several kinds on bad input
                raise ProbeError("bad_response", f"probe {item.id}: data[{n}] is not an image ({e})") from None
            pngs.append(raw)
        sw = d.get("stepwatch") if isinstance(d.get("stepwatch"), dict) else {}
        return self._generated(item, frames[:1], sw, wall, pngs)

    def _generated(self, item: ProbeItem, frames: list[NDArray[np.uint8]], sw: dict[str, Any], wall: float,
                   raw: list[bytes]) -> Generated:
        """The probe's output checked against what was asked (frame count, size), with what the service said."""
        if (item.is_video or item.is_stream) and len(frames) != item.expected_frames:
            raise ProbeError("bad_response", f"probe {item.id}: {len(frames)} frames, expected {item.expected_frames}")
        w, h = item.width_height
        if frames[0].shape[:2] != (h, w):
            raise ProbeError("bad_response",
                             f"probe {item.id}: image is {frames[0].shape[1]}x{frames[0].shape[0]}, asked {item.size}")
        secs = sw.get("seconds")
        return Generated(
            frames=frames,
            instance_id=str(sw["instance_id"]) if sw.get("instance_id") else None,
            fingerprint_id=str(sw["fingerprint_id"]) if sw.get("fingerprint_id") else None,
            service_seconds=float(secs) if isinstance(secs, (int, float)) and not isinstance(secs, bool) else None,
            wall_seconds=wall,
            png=raw,
        )
