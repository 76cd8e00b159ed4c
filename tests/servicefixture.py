"""Start the real practice service (`stepwatch serve`) as a subprocess for tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from stepwatch import httpclient
from stepwatch.procs import free_port

ADMIN_TOKEN = "test-admin-token"

# Fast to warm (aot_eager compiles in about a second), small shapes, a real memory budget.
TEST_CONFIG: dict[str, Any] = {
    "compile": {"enabled": True, "backend": "aot_eager", "mode": "regional"},
    "warmup": ["256x256"],
    "default_size": "256x256",
    "default_steps": 4,
    "cache": {"kind": "first_block_cache", "threshold": 0.5},
    "vae_tiling": True,
    "memory_budget_mb": 700,
    # 288x288: only test_service_http's unwarmed-shape test requests it (its first serving compile).
    "pools": {"small": {"sizes": ["256x256", "288x288", "320x320"], "slo_seconds": 10},
              "large": {"sizes": ["1024x1024", "2048x2048"], "slo_seconds": 60}},
    "other_pool": {"slo_seconds": 30},
    "admin_token": ADMIN_TOKEN,
}


def _headers(h: httpx.Headers) -> dict[str, str]:
    """Response headers by their canonical names (Retry-After, Content-Type), as the tests look them up."""
    return {"-".join(w.capitalize() for w in k.split("-")): v for k, v in h.items()}


class ServiceProc:
    def __init__(self, tmp: Path, overrides: dict[str, Any] | None = None, extra_args: list[str] | None = None,
                 ready_timeout: float = 240.0) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        cfg = {**TEST_CONFIG, **(overrides or {})}
        self.config_path = tmp / "service.yaml"
        self.config_path.write_text(yaml.safe_dump(cfg))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "service.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stepwatch.cli", "serve", "--config", str(self.config_path),
             "--port", str(self.port), *(extra_args or [])],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"service exited with {self.proc.returncode}:\n{self.log()}")
            if httpclient.ok(self.url + "/readyz"):
                return
            time.sleep(0.3)
        raise TimeoutError(f"service not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-5000:]

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                raw: bytes | None = None, timeout: float = 300) -> tuple[int, Any, dict[str, str]]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        r = httpclient.request(method, self.url + path, content=data, headers=headers or {}, timeout=timeout)
        hdrs = _headers(r.headers)
        ctype = hdrs.get("Content-Type", "")
        return r.status_code, (r.json() if "json" in ctype else r.text), hdrs

    def request_raw(self, path: str, timeout: float = 60) -> bytes:
        """The bytes of a GET (a video's MP4), raising on an error status."""
        r = httpclient.request("GET", self.url + path, timeout=timeout)
        r.raise_for_status()
        return bytes(r.content)

    def get(self, path: str) -> tuple[int, Any, dict[str, str]]:
        return self.request("GET", path, timeout=30)

    def generate(self, **body: Any) -> tuple[int, Any, dict[str, str]]:
        body.setdefault("prompt", "a lighthouse at dusk")
        return self.request("POST", "/v1/images/generations", body)

    def knobs(self, **knobs: Any) -> tuple[int, Any, dict[str, str]]:
        return self.request("POST", "/admin/knobs", knobs, {"Authorization": f"Bearer {ADMIN_TOKEN}"})

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        from tests.promtext import samples

        return samples(self.get("/metrics")[1])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
