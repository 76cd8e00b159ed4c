"""The deployment fingerprint: what must match for images to be comparable with a baseline.

Same deployment + same seed -> same image; across deployments (compile, parallel
degree, library versions, dtype, device) it is not guaranteed.  The lossy knobs
under test (cache, threshold, VAE tiling) are deliberately left out: they are
what the quality probe measures.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def fingerprint(*, model_id: str, weights_digest: str, dtype: str, compile_mode: str, ranks: int,
                device_type: str) -> dict[str, Any]:
    # Here: the HTTP process imports this module (for fingerprint_id) and must not load torch.
    import diffusers
    import torch
    import transformers

    return {
        "model_id": model_id,
        "weights_sha256": weights_digest,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "dtype": dtype,
        "compile": compile_mode,
        "parallel_degree": ranks,
        "device_type": device_type,
    }


def fingerprint_id(fp: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
