"""Write the Grafana dashboards (dashboards/*.json) from code, or check they are current.

Built with grafana-foundation-sdk (``dashboards/board.py``); the boards themselves live in
their own modules (``dashboards/overview.py``).  Every threshold line, band and runbook link
comes from stepwatch/thresholds.yaml (``stepwatch.thresholds.load()``), every alert's "open
this panel first" title is a panel here, and every query passes the lint in
``stepwatch.dashboards.lint``.  Output is deterministic (fixed uids and ids, sorted keys, no
timestamps), so CI can run ``stepwatch dashboards generate --check``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from stepwatch.dashboards.lint import lint
from stepwatch.dashboards.overview import OVERVIEW_UID, overview
from stepwatch.thresholds import Thresholds, load

__all__ = ["BOARDS", "OVERVIEW_FILE", "OVERVIEW_UID", "dashboards", "lint_problems", "render", "stale", "write"]

OVERVIEW_FILE = "stepwatch-overview.json"
# File name -> the function that builds that dashboard from the thresholds.
BOARDS: dict[str, Callable[[Thresholds], dict[str, Any]]] = {OVERVIEW_FILE: overview}


def dashboards(th: Thresholds | None = None) -> dict[str, dict[str, Any]]:
    """File name -> dashboard JSON object."""
    th = th or load()
    return {name: build(th) for name, build in BOARDS.items()}


def render(th: Thresholds | None = None) -> dict[str, str]:
    """File name -> the exact text written (sorted keys, 2-space indent, trailing newline)."""
    return {name: json.dumps(d, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
            for name, d in dashboards(th).items()}


def lint_problems(texts: Mapping[str, str], th: Thresholds) -> list[str]:
    """Every lint problem of the rendered dashboards, as Grafana would read them back."""
    return [f"{name}: {p}" for name, text in texts.items() for p in lint(json.loads(text), th)]


def _differs(path: Path, text: str) -> str | None:
    """Why the file at ``path`` is not ``text`` ('missing', 'differs from the generator'), or None."""
    if not path.is_file():
        return "missing"
    return None if path.read_text() == text else "differs from the generator"


def stale(texts: Mapping[str, str], out_dir: Path) -> list[str]:
    """``path: why`` for every file under ``out_dir`` that is not what the generator writes."""
    return [f"{out_dir / name}: {why}" for name, text in sorted(texts.items())
            if (why := _differs(out_dir / name, text)) is not None]


def write(texts: Mapping[str, str], out_dir: Path) -> list[Path]:
    """Write the files that differ (only those, so an unchanged file keeps its time); the paths written."""
    written = []
    for name, text in sorted(texts.items()):
        path = out_dir / name
        if _differs(path, text) is None:
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
