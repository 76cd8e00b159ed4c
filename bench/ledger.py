"""``stepwatch bench ledger``: is the FLOPs ledger right on every diffusers family, with CFG on and off?

For each family of ``bench/ledger_families.py`` (its real pipeline around a tiny transformer, built offline)
and CFG off then on, one instrumented call, checked three ways against what really ran:

- ``label_ok``: the shape label is the request's size and steps, ``_cfg`` exactly when CFG is on;
- ``cfg_branches_ok``: the report's branches are 2 with CFG, 1 without;
- ``steps_ok``: the report timed as many steps as the call asked for;
- ``ratio``: the ledger's FLOPs per step (what ``stepwatch_ledger_step_flops`` publishes) over torch's
  ``FlopCounterMode`` around every transformer call of the request, divided by its steps.  The counter is
  independent of the ledger: it counts the matmuls, convolutions and attention of the call as dispatched.
- ``naive_ratio``, the baseline: the textbook ``2 * P * N`` (every parameter, the request's size over 8x VAE
  and 2x2 patches, x2 with CFG) over the same count; what a dashboard gets without the ledger.

Bar: every ``*_ok`` true and every ratio within [0.9, 1.1] (exit 1 otherwise).  ``--real`` adds the ledger of
the published configs on the meta device at a representative shape, beside the seeds' figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

RATIO_BOUNDS = (0.9, 1.1)
STEPS = 2


def _counter() -> Any:
    """FlopCounterMode, taught the CPU's fused attention (torch counts its CUDA kernels, not this one)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    def cpu_sdpa(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
        return int(sdpa_flop_count(query_shape, key_shape, value_shape))

    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa}
    return FlopCounterMode(display=False, custom_mapping=mapping)


@contextmanager
def counted_calls(transformer: Any) -> Iterator[list[int]]:
    """Every forward of ``transformer`` in the block runs under a fresh FlopCounterMode; yields their counts."""
    counts: list[int] = []
    forward = transformer.forward

    def counting(*args: Any, **kwargs: Any) -> Any:
        with _counter() as fc:
            out = forward(*args, **kwargs)
        counts.append(int(fc.get_total_flops()))
        return out

    transformer.forward = counting
    try:
        yield counts
    finally:
        del transformer.forward


def expected_label(size: tuple[int, int, int | None], cfg: bool) -> str:
    h, w, frames = size
    return f"{h}x{w}{f'x{frames}' if frames else ''}_{STEPS}s{'_cfg' if cfg else ''}"


def check_family(fam: Any, pipe: Any, cfg: bool) -> dict[str, Any]:
    """One instrumented call of ``pipe`` with CFG on or off, against FlopCounterMode."""
    import torch
    from prometheus_client import CollectorRegistry

    from stepwatch.exporter import instrument, uninstrument

    h, w, frames = fam.size
    kwargs: dict[str, Any] = {"height": h, "width": w, "num_inference_steps": STEPS, "output_type": "latent",
                              "generator": torch.Generator().manual_seed(0), **fam.call(cfg)}
    if frames:
        kwargs["num_frames"] = frames
    inst = instrument(pipe, registry=CollectorRegistry())
    try:
        with counted_calls(pipe.transformer) as counts, torch.no_grad():
            pipe(**kwargs)
        report = inst.last_report
    finally:
        uninstrument(pipe)
    assert report is not None
    counted = sum(counts) / STEPS
    ledger_flops = report.step_flops or 0.0
    naive = naive_flops(pipe.transformer, fam.size, cfg)
    return {"name": fam.name, "pipeline": fam.pipeline, "cfg": cfg, "cfg_kind": fam.cfg_kind,
            "label": report.shape_label, "label_ok": report.shape_label == expected_label(fam.size, cfg),
            "cfg_branches": report.cfg_branches, "cfg_branches_ok": report.cfg_branches == (2 if cfg else 1),
            "steps_ok": len(report.step_seconds) == STEPS, "calls": len(counts),
            "ledger_flops": ledger_flops, "counted_flops": counted,
            "ratio": round(ledger_flops / counted, 4) if counted else None,
            "naive_ratio": round(naive / counted, 4) if counted else None}


def naive_flops(transformer: Any, size: tuple[int, int, int | None], cfg: bool) -> float:
    """The textbook estimate: 2 x every parameter x the request's tokens at 8x VAE, 2x2 patches, 4x frames."""
    h, w, frames = size
    tokens = (h // 16) * (w // 16) * (((frames - 1) // 4 + 1) if frames else 1)
    params = sum(p.numel() for p in transformer.parameters())
    return 2.0 * params * tokens * (2 if cfg else 1)


def passes(row: dict[str, Any]) -> bool:
    lo, hi = RATIO_BOUNDS
    ratio = row["ratio"]
    return bool(row["label_ok"] and row["cfg_branches_ok"] and row["steps_ok"] and ratio is not None
                and lo <= ratio <= hi)


def run_families(names: list[str] | None = None,
                 progress: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    from stepwatch.bench.ledger_families import FAMILIES

    rows = []
    for fam in FAMILIES:
        if names and fam.name not in names:
            continue
        pipe = fam.build()
        for cfg in (False, True):
            row = check_family(fam, pipe, cfg)
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", action="append", metavar="NAME",
                   help="only this family (repeatable; default: all eight)")
    p.add_argument("--real", action="store_true",
                   help="also the ledger of the published configs on the meta device, beside the seeds' figures")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the results")


def _row(r: dict[str, Any]) -> None:
    oks = "".join("y" if r[k] else "N" for k in ("label_ok", "cfg_branches_ok", "steps_ok"))
    print(f"{r['name']:<14}{'on' if r['cfg'] else 'off':<5}{r['label']:<18}{r['cfg_branches']:>3}  {oks:<5}"
          f"{r['ledger_flops']:>13.4g}{r['counted_flops']:>13.4g}{r['ratio'] or 0:>8.3f}{r['naive_ratio'] or 0:>8.2f}"
          f"  {'ok' if passes(r) else 'FAIL'}", flush=True)


def run(args: argparse.Namespace) -> int:
    from stepwatch.bench.ledger_families import FAMILIES

    known = {f.name for f in FAMILIES}
    unknown = sorted(set(args.family or []) - known)
    if unknown:
        print(f"bench ledger: unknown family {', '.join(unknown)}; choose from {', '.join(sorted(known))}",
              file=sys.stderr)
        return 2
    started = time.monotonic()
    print(f"{'family':<14}{'cfg':<5}{'label':<18}{'br':>3}  {'lbs':<5}{'ledger':>13}{'counted':>13}{'ratio':>8}"
          f"{'naive':>8}")
    rows = run_families(args.family, progress=_row)
    out: dict[str, Any] = {"families": rows}
    if args.real:
        from stepwatch.bench.ledger_real import real_configs, show

        out["real"] = real_configs()
        show(out["real"])
    ok = all(passes(r) for r in rows)
    lo, hi = RATIO_BOUNDS
    print(f"{len(rows)} checks in {time.monotonic() - started:.0f} s; bar: every label, branch count and step "
          f"count right, every ratio in [{lo}, {hi}] -> {'PASS' if ok else 'FAIL'}", file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    return 0 if ok else 1
