"""Determinism of the baseline: the same set twice in one deployment, and once more after a restart.

The seeds: the same seed gives the same image within a deployment; across deployments it is not promised,
so a baseline is stored with its deployment and rebuilt after every change.  This check runs the configured
set twice in one process (bit-exact expected: the pipelines are the same objects) and once in a fresh process
built from the same config (a restart: same weights from the same seed or directory, same settings), and
reports every item whose bytes differ, with its PSNR.  It also reads the settings known to break determinism
in each process and names those that are on or that differ between the two: that is where to look.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from stepwatch.bench.eval_runner import Runner, Shape, configured, parse_shape
from stepwatch.exporter.sidecar.quality import psnr
from stepwatch.service.config import ServiceConfig, load

RESTART_TIMEOUT_S = 1800.0


def settings() -> dict[str, Any]:
    """This process's settings that decide whether a seed reproduces its image bit for bit."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark) if cuda else None,
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32) if cuda else None,
    }


def suspects(cfg: ServiceConfig, here: dict[str, Any], there: dict[str, Any]) -> list[str]:
    """What can make the same seed give another image, as it applies to this deployment."""
    out = [f"{k} differs between the deployments ({here[k]} vs {there.get(k)})"
           for k in here if here[k] != there.get(k)]
    if cfg.compile.enabled and cfg.compile.mode == "full":
        out.append("compile mode full: an autotuned kernel choice may differ per process")
    if here.get("cudnn_benchmark"):
        out.append("cudnn.benchmark is on: convolution algorithms are chosen per process by timing")
    if here.get("deterministic_algorithms") is False and here.get("cudnn_benchmark") is not None:
        out.append("deterministic algorithms are off: atomics-based GPU kernels reduce in any order")
    if cfg.ranks > 1:
        out.append("ranks > 1: the reduction order depends on the parallel degree")
    return out


def digests(outputs: list[np.ndarray]) -> list[str]:
    return [hashlib.sha256(o.tobytes()).hexdigest()[:16] for o in outputs]


def compare(a: list[np.ndarray], b: list[np.ndarray]) -> list[dict[str, Any]]:
    """Every item whose bytes differ between two runs, with its PSNR (a video's worst frame)."""
    out = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x.shape != y.shape or not np.array_equal(x, y):
            frames = zip(x, y, strict=True) if x.ndim == 4 else [(x, y)]
            worst = min(psnr(f, g) for f, g in frames) if x.shape == y.shape else float("nan")
            out.append({"item": i, "psnr": worst})
    return out


def render_set(runner: Runner, shape: Shape, images: int) -> list[np.ndarray]:
    setting = configured(runner.cfg, shape)
    runner.warm(shape, [setting])
    return [runner.render(shape, setting, i).output for i in range(images)]


def _restart(cfg: ServiceConfig, shapes: list[Shape], images: int, threads: int,
             ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The set rendered by a fresh process (a restart of the deployment); its settings and outputs."""
    with tempfile.TemporaryDirectory(prefix="stepwatch-determinism-") as d:
        tmp = Path(d)
        (tmp / "config.yaml").write_text(yaml.safe_dump(cfg.to_raw()))
        cmd = [sys.executable, "-m", "stepwatch.bench.determinism", "--config", str(tmp / "config.yaml"),
               "--images", str(images), "--threads", str(threads), "--out", str(tmp / "out.npz"),
               *[s.label for s in shapes]]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=RESTART_TIMEOUT_S)
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"the restarted process failed (exit {done.returncode}): {tail[0]}")
        with np.load(tmp / "out.npz") as npz:
            outputs = {k: npz[k] for k in npz.files}
    return json.loads(done.stdout.strip().splitlines()[-1]), outputs


def determinism(cfg: ServiceConfig, shapes: list[Shape], images: int,
                progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Within one deployment and across a restart: the items that differ per shape, and what to suspect."""
    import torch

    runner = Runner(cfg, progress)
    first = {s.label: render_set(runner, s, images) for s in shapes}
    again = {s.label: render_set(runner, s, images) for s in shapes}
    if progress:
        progress("  the same set in a fresh process (a restart)")
    there, restarted = _restart(cfg, shapes, images, torch.get_num_threads())
    here = settings()
    rows = []
    for s in shapes:
        other = [restarted[f"{s.label}/{i}"] for i in range(images)]
        rows.append({"shape": s.label, "items": images, "digests": digests(first[s.label]),
                     "within_deployment": compare(first[s.label], again[s.label]),
                     "across_restart": compare(first[s.label], other)})
    bit_exact = all(not r["within_deployment"] and not r["across_restart"] for r in rows)
    return {"bit_exact": bit_exact, "shapes": rows, "settings": {"first": here, "restart": there},
            "suspects": [] if bit_exact else suspects(cfg, here, there)}


def to_markdown(rep: dict[str, Any]) -> str:
    lines = ["# Determinism", "", "bit-exact: " + ("yes" if rep["bit_exact"] else "NO"), ""]
    for r in rep["shapes"]:
        for where in ("within_deployment", "across_restart"):
            diff = r[where]
            text = "all identical" if not diff else ", ".join(f"item {d['item']} ({d['psnr']:.1f} dB)" for d in diff)
            lines.append(f"- {r['shape']}, {where.replace('_', ' ')}: {r['items']} items, {text}")
    lines += [f"- suspect: {s}" for s in rep["suspects"]]
    return "\n".join(lines) + "\n"


def _child(argv: list[str]) -> int:
    """The restarted process: render the set, write the outputs, print this process's settings."""
    import torch

    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--images", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("shapes", nargs="+")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = load(a.config)
    runner = Runner(cfg)
    arrays = {}
    for text in a.shapes:
        shape = parse_shape(text.rsplit("_cfg", 1)[0], cfg)
        for i, o in enumerate(render_set(runner, shape, a.images)):
            arrays[f"{shape.label}/{i}"] = o
    np.savez(a.out, **arrays)  # type: ignore[arg-type]
    print(json.dumps(settings()))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
