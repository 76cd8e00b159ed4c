"""Capture the quality baseline: run the probe set once and store its images.

The images are stored with the service's deployment fingerprint (from
``GET /v1/stepwatch/info``) and sha256 checksums; the sidecar compares later
probes with them.  Rerun after every deployment change (image, libraries,
compile, parallel degree), since outputs are only reproducible within one.
A failed capture leaves the previous baseline untouched.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("stepwatch.sidecar.capture")

DEFAULT_OUT = "baselines"
DEFAULT_TIMEOUT_S = 120.0
# A repeated probe must reproduce the capture; anything below this means the service is not deterministic.
DETERMINISM_MIN_DB = 60.0


class CaptureError(RuntimeError):
    """The capture could not be completed; nothing was written."""


@dataclass
class CaptureResult:
    path: Path
    fingerprint_id: str
    instance_id: str
    probes: int
    cost_seconds: float
    gpus: int
    repeat_psnr_db: float | None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="service base URL, e.g. http://127.0.0.1:8000 (or `target` in --config)")
    p.add_argument("--out", default=None, help=f"baseline root folder (default: the config's baseline_dir, "
                                              f"else ./{DEFAULT_OUT})")
    p.add_argument("--probe-set", default=None, help="probe set YAML (default: the config's, else the built-in "
                                                     "20 probes at 256x256 x 8 steps)")
    p.add_argument("--config", default=None, help="the sidecar's YAML config, for its target, probe set and "
                                                  "baseline_dir")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per request (default %(default)s)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the repeat of the first probe that checks the service is deterministic")


def capture_baseline(target: str, probe_set: Any, out: str | Path, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                     verify: bool = True, transport: Any = None) -> CaptureResult:
    """Run ``probe_set`` against ``target`` and store it under ``out``; raises ``CaptureError``."""
    from stepwatch.exporter.sidecar.baseline import BaselineStore
    from stepwatch.exporter.sidecar.client import ProbeError, ServiceClient
    from stepwatch.exporter.sidecar.quality import psnr

    client = ServiceClient(target, transport=transport)
    try:
        try:
            info = client.info(min(timeout_s, 10.0))
        except ProbeError as e:
            raise CaptureError(f"cannot read the deployment fingerprint: {e}") from None
        if info.ready is False:
            raise CaptureError(f"{target} is not ready (warm-up not finished); capture after /readyz answers 200")
        outputs: dict[str, Any] = {}
        seconds: list[float] = []
        walls: list[float] = []
        for item in probe_set.items:
            try:
                gen = client.generate(item, timeout_s)
            except ProbeError as e:
                raise CaptureError(f"probe {item.id}: {e}") from None
            if gen.fingerprint_id is not None and gen.fingerprint_id != info.fingerprint_id:
                raise CaptureError(f"probe {item.id} was answered by fingerprint {gen.fingerprint_id}, not "
                                   f"{info.fingerprint_id}: the deployment changed or a balancer mixes deployments")
            outputs[item.id] = gen.frames
            seconds.append(gen.service_seconds if gen.service_seconds is not None else gen.wall_seconds)
            walls.append(gen.wall_seconds)
        repeat = None
        if verify:
            first = probe_set.items[0]
            try:
                again = client.generate(first, timeout_s)
            except ProbeError as e:
                raise CaptureError(f"repeat of probe {first.id}: {e}") from None
            repeat = min(psnr(a, b) for a, b in zip(again.frames, outputs[first.id], strict=False))
            if repeat < DETERMINISM_MIN_DB:
                raise CaptureError(f"the same probe twice gives PSNR {repeat:.1f} dB (< {DETERMINISM_MIN_DB:g}): the "
                                   "service is not deterministic for a seed, so probes would read noise as quality "
                                   "loss; nothing stored")
        try:
            after = client.info(min(timeout_s, 10.0))
        except ProbeError as e:
            raise CaptureError(f"cannot re-read the fingerprint after the capture: {e}") from None
        if after.fingerprint_id != info.fingerprint_id:
            raise CaptureError(f"the deployment fingerprint changed during the capture ({info.fingerprint_id} -> "
                               f"{after.fingerprint_id}); nothing stored")
        cost = sum(seconds)
        store = BaselineStore(out)
        try:
            path = store.save(probe_set, info, outputs, target=target, cost_seconds=cost,
                              max_request_seconds=max(walls))
        except OSError as e:
            raise CaptureError(f"cannot write the baseline under {out}: {e}") from None
        return CaptureResult(path, info.fingerprint_id, info.instance_id, len(outputs), cost, info.gpus, repeat)
    finally:
        client.close()


def run(args: argparse.Namespace) -> int:
    from stepwatch.alerts.thresholds import ThresholdsError, load
    from stepwatch.exporter.sidecar.config import (
        ConfigError,
        SidecarConfig,
        check_target,
        load_config,
        load_probe_set,
    )

    try:
        cfg = load_config(args.config) if args.config else SidecarConfig()
        target = check_target(args.target or cfg.target or "", "--target")
        probe_set = load_probe_set(args.probe_set) if args.probe_set else cfg.probe_set
        out = Path(args.out) if args.out else (cfg.baseline_dir if args.config else Path(DEFAULT_OUT))
        ratio = load(cfg.thresholds).quality.probe_budget_ratio
    except (ConfigError, ThresholdsError) as e:
        print(f"stepwatch baseline capture: {e}", file=sys.stderr)
        return 2
    from stepwatch.exporter.sidecar.main import quiet_http_logs

    quiet_http_logs()
    print(f"capturing {len(probe_set.items)} probes of {probe_set.name!r} from {target} ...", file=sys.stderr)
    try:
        res = capture_baseline(target, probe_set, out, timeout_s=args.timeout, verify=not args.no_verify)
    except CaptureError as e:
        print(f"stepwatch baseline capture: {e}", file=sys.stderr)
        return 1
    gpu_s = res.cost_seconds * res.gpus
    interval = res.cost_seconds / ratio
    print(f"stored {res.probes} probes for fingerprint {res.fingerprint_id} (instance {res.instance_id}) in {res.path}")
    if res.repeat_psnr_db is not None:
        print(f"repeat of the first probe: PSNR {res.repeat_psnr_db:.1f} dB (deterministic)")
    print(f"probe set costs {gpu_s:.1f} GPU-s; at {ratio * 100:g}% budget the cadence is every {interval:.0f} s")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    parser = argparse.ArgumentParser(prog="stepwatch baseline capture", description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
