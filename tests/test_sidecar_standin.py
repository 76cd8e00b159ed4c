"""Checks of the stand-in itself (tests/fakes.py): it must behave like the documented API."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image

from tests.fakes import StandIn


def test_standin_is_deterministic_and_perturbs_on_request() -> None:
    import httpx

    s = StandIn()
    url = s.start()
    try:
        body = {"prompt": "a fox", "n": 1, "size": "64x32", "response_format": "b64_json", "seed": 3, "steps": 8}
        a = httpx.post(f"{url}/v1/images/generations", json=body).json()
        b = httpx.post(f"{url}/v1/images/generations", json=body).json()
        assert a["data"] == b["data"]
        img = np.asarray(Image.open(io.BytesIO(base64.b64decode(a["data"][0]["b64_json"]))))
        assert img.shape == (32, 64, 3)
        assert a["stepwatch"]["fingerprint_id"] == s.fingerprint_id
        s.sigma = 10
        c = httpx.post(f"{url}/v1/images/generations", json=body).json()
        assert c["data"] != a["data"]
        bad = httpx.post(f"{url}/v1/images/generations", json={**body, "size": "65x32"})
        assert bad.status_code == 400 and "error" in bad.json()
        info = httpx.get(f"{url}/v1/stepwatch/info").json()
        assert set(info) >= {"instance_id", "fingerprint", "fingerprint_id", "knobs", "ready", "pools"}
    finally:
        s.stop()
