"""Fakes and stand-ins the tests share (a non-test module: nothing here is collected).

* ``StandIn``: a stand-in for the practice service's HTTP API, for the sidecar's tests.  It implements the
  documented shape of ``POST /v1/images/generations`` and ``GET /v1/stepwatch/info`` with deterministic PNGs
  per (prompt, seed, size, steps), plus switches that perturb images, change the fingerprint, slow or break
  the answers.  The real service's end-to-end tests replace it.  Its own checks are in
  test_sidecar_standin.py.
* ``FakeNvml``: an NVML provider answering from a table (the one hardware fake allowed: no GPU here).
* ``Recorder``: an in-process HTTP endpoint that keeps what is POSTed to it (a --forward target), for
  ``stepwatch.httpclient.use_transport``; every other URL goes to the network as usual.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import numpy as np
from PIL import Image
from prometheus_client import CollectorRegistry

from stepwatch.exporter.sidecar.nvml import NvmlCollector


def image_for(prompt: str, seed: int, width: int, height: int, steps: int, frame: int = 0) -> np.ndarray:
    """A smooth deterministic RGB image (what a deterministic service returns for a seed)."""
    key = hashlib.sha256(f"{prompt}|{seed}|{width}x{height}|{steps}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    coarse = rng.uniform(0, 255, size=(8, 8, 3))
    ys = np.linspace(0, 7, height)
    xs = np.linspace(0, 7, width)
    yi, xi = np.clip(ys.astype(int), 0, 6), np.clip(xs.astype(int), 0, 6)
    fy, fx = (ys - yi)[:, None, None], (xs - xi)[None, :, None]
    c = coarse
    img = ((1 - fy) * (1 - fx) * c[yi][:, xi] + (1 - fy) * fx * c[yi][:, xi + 1]
           + fy * (1 - fx) * c[yi + 1][:, xi] + fy * fx * c[yi + 1][:, xi + 1])
    img = img + 6.0 * frame
    return np.clip(img, 0, 255).astype(np.uint8)


def perturb(img: np.ndarray, sigma: float, seed: int) -> np.ndarray:
    noise = np.random.default_rng(seed + 1_000_003).normal(0, sigma, size=img.shape)
    return np.clip(img.astype(np.float64) + noise, 0, 255).astype(np.uint8)


def png(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class StandIn:
    """Switches: ``sigma`` (noise on perturbed probes), ``perturb_seeds`` / ``perturb_prompts`` /
    ``perturb_instances`` (None = all),
    ``perturb_frames``, ``fingerprint``, ``delay_s``, ``fail_code``, ``garbage``, ``die_after`` (answer that
    many more generations, then drop the connection and stop, like a killed process), ``instances`` (answers
    rotate over them), ``response_fingerprints`` (instance -> fingerprint_id in answers), ``ready``."""

    fingerprint: dict[str, Any] = field(default_factory=lambda: {
        "model": "standin-flux-tiny", "torch": "2.13.0", "diffusers": "0.42.1", "transformers": "4.57",
        "dtype": "float32", "compile": "off", "ranks": 1, "device": "cpu"})
    instances: tuple[str, ...] = ("standin-0",)
    seconds_per_image: float = 0.01
    sigma: float = 0.0
    perturb_seeds: set[int] | None = None
    perturb_prompts: set[str] | None = None
    perturb_instances: set[str] | None = None
    perturb_frames: set[int] | None = None
    delay_s: float = 0.0
    fail_code: int | None = None
    garbage: bool = False
    die_after: int | None = None
    ready: bool = True
    response_fingerprints: dict[str, str] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._server: ThreadingHTTPServer | None = None
        self._n = 0
        self._lock = threading.Lock()
        self.videos: dict[str, tuple[dict[str, Any], bytes]] = {}  # job id -> (job, MP4)

    @property
    def fingerprint_id(self) -> str:
        canon = json.dumps(self.fingerprint, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    def info(self) -> dict[str, Any]:
        return {"instance_id": self.instances[0], "fingerprint": self.fingerprint,
                "fingerprint_id": self.fingerprint_id, "knobs": {"cache": "none"}, "ready": self.ready,
                "pools": {"default": {}}}

    def generate(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if not isinstance(body.get("prompt"), str):
            return 400, {"error": {"message": "prompt is required", "type": "invalid_request_error", "code": 400}}
        try:
            w, h = (int(x) for x in str(body.get("size", "256x256")).split("x"))
        except ValueError:
            return 400, {"error": {"message": "size must be WxH", "type": "invalid_request_error", "code": 400}}
        if w % 16 or h % 16:
            return 400, {"error": {"message": "size must be multiples of 16", "type": "invalid_request_error",
                                   "code": 400}}
        with self._lock:
            inst = self.instances[self._n % len(self.instances)]
            self._n += 1
            self.requests.append(body)
        seed, steps = int(body.get("seed", 0)), int(body.get("steps", 8))
        frames = int(body.get("frames", 1) or 1)
        hit = ((self.perturb_seeds is None or seed in self.perturb_seeds)
               and (self.perturb_prompts is None or body["prompt"] in self.perturb_prompts)
               and (self.perturb_instances is None or inst in self.perturb_instances))
        data = []
        for f in range(frames):
            img = image_for(body["prompt"], seed, w, h, steps, f)
            if self.sigma > 0 and hit and (self.perturb_frames is None or f in self.perturb_frames):
                img = perturb(img, self.sigma, seed * 1000 + f)
            data.append({"b64_json": "not base64!" if self.garbage else base64.b64encode(png(img)).decode()})
        shape = f"{w}x{h}" + (f"x{frames}" if frames > 1 else "") + f"_{steps}s"
        return 200, {"created": int(time.time()), "data": data, "stepwatch": {
            "shape": shape, "pool": "default", "queue_seconds": 0.0, "seconds": self.seconds_per_image,
            "stages": {}, "steps": steps, "cache": {"kind": "none", "hits": 0, "misses": steps},
            "instance_id": inst, "fingerprint_id": self.response_fingerprints.get(inst, self.fingerprint_id)}}

    def create_video(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """``POST /v1/videos``: the job is done at once (its frames as ``generate`` makes them, as an MP4)."""
        from stepwatch.service.video import encode_mp4

        status, answer = self.generate(body)
        if status != 200:
            return status, answer
        frames = np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))).convert("RGB"))
                           for d in answer["data"]])
        jid = f"video_{len(self.videos):04d}"
        job = {"id": jid, "object": "video", "status": "completed", "progress": 100, "step": body.get("steps", 8),
               "steps": body.get("steps", 8), "error": None, "stepwatch": answer["stepwatch"]}
        self.videos[jid] = (job, encode_mp4(frames, 16))
        return 202, {**job, "status": "queued", "progress": 0, "step": 0}

    # --- server ----------------------------------------------------------------------------

    def answer_post(self, path: str, raw: bytes) -> tuple[int, dict[str, Any]] | None:
        """The answer to a POST; None: drop the connection (``die_after`` ran out)."""
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return 400, {"error": {"message": "bad JSON", "type": "invalid_request_error", "code": 400}}
        if path not in ("/v1/images/generations", "/v1/videos"):
            return 404, {"error": {"message": "not found", "type": "not_found", "code": 404}}
        if self.die_after is not None:
            if self.die_after <= 0:
                threading.Thread(target=self.stop).start()
                return None
            self.die_after -= 1
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail_code:
            return self.fail_code, {"error": {"message": "injected", "type": "server_error", "code": self.fail_code}}
        return self.create_video(body) if path == "/v1/videos" else self.generate(body)

    def answer_get(self, path: str) -> tuple[int, Any]:
        if path == "/v1/stepwatch/info":
            return 200, self.info()
        parts = path.strip("/").split("/")
        if parts[:2] == ["v1", "videos"] and len(parts) >= 3 and parts[2] in self.videos:
            job, mp4 = self.videos[parts[2]]
            return (200, mp4) if parts[3:] == ["content"] else (200, job)
        if path in ("/healthz", "/readyz"):
            return 200 if self.ready or path == "/healthz" else 503, {}
        return 404, {"error": {"message": "not found", "type": "not_found", "code": 404}}

    def start(self) -> str:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, obj: Any) -> None:
                binary = isinstance(obj, bytes)
                raw = obj if binary else json.dumps(obj).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "video/mp4" if binary else "application/json")
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_GET(self) -> None:
                self._send(*standin.answer_get(self.path))

            def do_POST(self) -> None:
                answer = standin.answer_post(self.path, self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                if answer is None:
                    self.close_connection = True
                else:
                    self._send(*answer)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self.url

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


# --- NVML ------------------------------------------------------------------------------------

GIB = 1024**3


class FakeNvmlError(Exception):
    pass


class FakeNvml:
    """A provider that answers from a table, and fails where told to (per GPU, per field, init, count)."""

    def __init__(self, gpus: list[dict[str, Any]], *, init_error: Exception | None = None,
                 count_error: Exception | None = None, failing: set[tuple[int, str]] | None = None,
                 failing_gpus: set[int] | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.count_error = count_error
        self.failing = failing or set()
        self.failing_gpus = failing_gpus or set()
        self.inits = 0
        self.shutdowns = 0

    def init(self) -> None:
        self.inits += 1
        if self.init_error is not None:
            raise self.init_error

    def shutdown(self) -> None:
        self.shutdowns += 1

    def device_count(self) -> int:
        if self.count_error is not None:
            raise self.count_error
        return len(self.gpus)

    def _get(self, i: int, name: str) -> Any:
        if i in self.failing_gpus or (i, name) in self.failing:
            raise FakeNvmlError(f"GPU {i} {name}: GPU is lost")
        return self.gpus[i][name]

    def memory(self, i: int) -> tuple[int, int]:
        return self._get(i, "memory")

    def utilization_percent(self, i: int) -> float:
        return self._get(i, "utilization")

    def sm_clock_mhz(self, i: int) -> float:
        return self._get(i, "sm_clock")

    def temperature_celsius(self, i: int) -> float:
        return self._get(i, "temperature")

    def power_milliwatts(self, i: int) -> float:
        return self._get(i, "power")

    def throttle_reasons(self, i: int) -> int:
        return self._get(i, "throttle")

    def xid_errors(self, i: int) -> int | None:
        return self._get(i, "xid")


def gpu(**kw: Any) -> dict[str, Any]:
    d = {"memory": (30 * GIB, 80 * GIB), "utilization": 87, "sm_clock": 1980, "temperature": 71,
         "power": 312_500, "throttle": 0, "xid": 0}
    d.update(kw)
    return d


def collector(registry: CollectorRegistry, fake: FakeNvml, **kw: Any) -> NvmlCollector:
    c = NvmlCollector(fake, **kw)
    registry.register(c)
    return c


# --- HTTP ------------------------------------------------------------------------------------


class Recorder(httpx.BaseTransport):
    """Keeps the JSON bodies POSTed to ``url`` (answered 204) without a socket; other requests go out.

    Install it with ``httpclient.use_transport(recorder)`` while the client under test is made.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._target = httpx.URL(url)
        self.bodies: list[Any] = []
        self._network = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if (request.url.host, request.url.path) == (self._target.host, self._target.path):
            self.bodies.append(json.loads(request.read()))
            return httpx.Response(204)
        return self._network.handle_request(request)

    def close(self) -> None:
        self._network.close()
