"""Record a window of a live Prometheus as a replayable triage scenario.

A scenario is a directory::

    <name>/samples.om.gz   raw samples (OpenMetrics text with timestamps, gzipped) of every stepwatch
                           series, every recording rule, ALERTS, ALERTS_FOR_STATE and up in the window
    <name>/scenario.yaml   expected cause, evaluation time, the firing alerts at that time as
                           Alertmanager's webhook sends them, and how it was recorded

``stepwatch triage eval`` backfills the samples into a fresh TSDB with
``promtool tsdb create-blocks-from openmetrics``, starts a real Prometheus on
it and runs the engine at the evaluation time (``triage/replay.py``).

Export goes through the HTTP API only: one instant query with a range selector
(``name[Ns]`` at the window's end) per metric name returns its raw samples.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from stepwatch.alerts import promql, rulegen
from stepwatch.promapi import Prometheus
from stepwatch.runbooks.parse import load_all
from stepwatch.thresholds import PROFILES, parse_duration
from stepwatch.thresholds import load as load_thresholds
from stepwatch.triage.engine import _selector, firing_at  # _selector: the label escaping the engine's queries use

SAMPLES_FILE = "samples.om.gz"
SCENARIO_FILE = "scenario.yaml"
# What a triage replay needs: the exporter's, service's and sidecar's series, the recording
# rules (level:metric:operations), the alert state series and target health; and any other
# name a runbook check or a rule reads (names_to_export).
NAME_RE = re.compile(r"stepwatch_.+|[a-z_]+:.+|ALERTS|ALERTS_FOR_STATE|up")
NAME_MATCH = '{__name__=~"' + NAME_RE.pattern + '"}'


def _api(url: str, path: str, params: Mapping[str, Any], timeout: float = 60.0) -> Any:
    """``data`` of one Prometheus API call (errors and odd answers are PromError, as everywhere)."""
    with Prometheus(url, timeout=timeout) as prom:
        return prom._api(path, dict(params))


def _value(v: str) -> str:
    x = float(v)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(x) if x != int(x) or abs(x) >= 1e15 else str(int(x))


def _ts(t: float | str) -> str:
    return f"{float(t):.3f}".rstrip("0").rstrip(".")


def read_by_triage() -> set[str]:
    """Series names the runbook checks and the rules (recording and alerting, both profiles) read."""
    th = load_thresholds()
    used: set[str] = set()
    for profile in PROFILES:
        for g in rulegen.rule_groups(th, profile):
            for r in g["rules"]:
                used |= promql.metric_names(r["expr"])
        for rb in load_all().values():
            for c in rb.checks:
                used |= promql.metric_names(c.render({}, th, profile))
    return used


def names_to_export(prometheus_url: str, start: float, end: float, all_buckets: bool = False) -> list[str]:
    """Every stepwatch, recorded and alert-state name in the window.

    Histogram buckets are most of the bytes (30 per label set), so only the buckets
    that a runbook check or a rule reads are kept unless ``all_buckets``; every
    ``_sum`` and ``_count`` is kept.
    """
    used = read_by_triage()
    window = {"start": f"{start:.3f}", "end": f"{end:.3f}"}
    names = set(_api(prometheus_url, "label/__name__/values", {"match[]": NAME_MATCH, **window}))
    # What the checks read from other exporters (the fleet's haproxy_server_status: node-silent.md), where present.
    others = sorted(n for n in used if not NAME_RE.fullmatch(n))
    if others:
        match = '{__name__=~"' + "|".join(re.escape(n) for n in others) + '"}'
        names |= set(_api(prometheus_url, "label/__name__/values", {"match[]": match, **window}))
    if all_buckets:
        return sorted(names)
    return sorted(n for n in names if not n.endswith("_bucket") or n in used)


def export_openmetrics(prometheus_url: str, start: float, end: float, names: Iterable[str] | None = None,
                       ) -> tuple[str, dict[str, int]]:
    """OpenMetrics text of the raw samples in (start, end]; counts of names, series and samples."""
    if names is None:
        names = names_to_export(prometheus_url, start, end)
    seconds = max(1, math.ceil(end - start))
    lines: list[str] = []
    n_series = n_samples = 0
    for name in sorted(set(names)):
        data = _api(prometheus_url, "query", {"query": f"{name}[{seconds}s]", "time": f"{end:.3f}"})
        if data.get("resultType") != "matrix":
            continue
        for series in sorted(data["result"], key=lambda r: sorted(r["metric"].items())):
            labels = {k: v for k, v in series["metric"].items() if k != "__name__"}
            sel = name + (_selector(labels) if labels else "")
            values = series.get("values") or []
            n_series += 1
            n_samples += len(values)
            lines.extend(f"{sel} {_value(v)} {_ts(t)}" for t, v in values)
    lines.append("# EOF")
    return "\n".join(lines) + "\n", {"names": len(set(names)), "series": n_series, "samples": n_samples}


def _alerts_at(prometheus_url: str, at: float) -> list[dict[str, Any]]:
    with Prometheus(prometheus_url) as prom:
        alerts = firing_at(prom, None) if abs(time.time() - at) < 15 else firing_at(prom, at)
    return [a.to_webhook() for a in alerts]


def record_scenario(prometheus_url: str, start: float, end: float, out_dir: str | Path,
                    meta: Mapping[str, Any]) -> Path:
    """Write ``out_dir`` (a scenario directory) from Prometheus' samples in (start, end]; returns it.

    ``meta`` goes into scenario.yaml: ``expected_cause`` (None for a control),
    ``description``, ``recorded`` (how), optionally ``expected_alert`` (the alert
    whose incident is scored), ``scrape_interval_s`` (the replay's lookback is
    three of them; default: the drill profile's), ``evaluated_at`` (default:
    ``detected_at`` when given, else ``end``) and ``alerts`` (webhook-format alert
    dicts; default: what fired at the evaluation time, read back from Prometheus;
    a list of alert names is kept as ``expected_alerts``).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta)
    at = float(meta.get("evaluated_at") or meta.get("detected_at") or end)
    given = meta.pop("alerts", None)
    if given and all(isinstance(a, str) for a in given):
        meta.setdefault("expected_alerts", list(given))
        given = None
    alerts = list(given) if given is not None else _alerts_at(prometheus_url, at)
    meta.setdefault("scrape_interval_s", _drill_scrape_s())
    text, counts = export_openmetrics(prometheus_url, start, end)
    with gzip.open(out / SAMPLES_FILE, "wt", compresslevel=9) as f:
        f.write(text)
    data: dict[str, Any] = {
        "name": out.name,
        "expected_cause": meta.get("expected_cause"),
        "description": meta.get("description", ""),
        "evaluated_at": round(at, 3),
        "evaluated_at_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at)),
        "window": {"start": round(start, 3), "end": round(end, 3)},
        "recorded": meta.get("recorded", ""),
        **{k: v for k, v in meta.items() if k not in {"expected_cause", "description", "evaluated_at", "recorded",
                                                       "name"}},
        "samples": {**counts, "bytes_gz": (out / SAMPLES_FILE).stat().st_size},
        "alerts": alerts,
    }
    (out / SCENARIO_FILE).write_text(yaml.safe_dump(json.loads(json.dumps(data)), sort_keys=False, width=110))
    return out


def _drill_scrape_s() -> float:
    return parse_duration(load_thresholds().profiles["drill"].scrape_interval)


def load_scenario(path: str | Path) -> dict[str, Any]:
    """scenario.yaml of a scenario directory, with ``dir`` added."""
    p = Path(path)
    data = yaml.safe_load((p / SCENARIO_FILE).read_text())
    data["dir"] = str(p)
    return dict(data)


def compact_scenario(path: str | Path, keep_s: float | None = None, all_buckets: bool = False) -> dict[str, int]:
    """Shrink a recorded scenario in place: drop buckets triage does not read, keep ``keep_s`` before evaluation.

    For recordings made with ``all_buckets`` or a longer window; returns the new counts.
    """
    p = Path(path)
    sc = yaml.safe_load((p / SCENARIO_FILE).read_text())
    start = float(sc["evaluated_at"]) - keep_s if keep_s is not None else float(sc["window"]["start"])
    used = read_by_triage()
    kept: list[str] = []
    series: set[str] = set()
    with gzip.open(p / SAMPLES_FILE, "rt") as f:
        for line in f:
            if line.startswith("#"):
                continue
            sel, _, rest = line.rstrip("\n").rpartition(" ")
            name = sel.split("{", 1)[0].split(" ", 1)[0]
            if float(rest) <= start or (name.endswith("_bucket") and name not in used and not all_buckets):
                continue
            kept.append(line.rstrip("\n"))
            series.add(sel.rsplit(" ", 1)[0])
    with gzip.open(p / SAMPLES_FILE, "wt", compresslevel=9) as f:
        f.write("\n".join([*kept, "# EOF"]) + "\n")
    sc["window"]["start"] = round(max(start, float(sc["window"]["start"])), 3)
    sc["samples"] = {"names": len({s.split("{", 1)[0] for s in series}), "series": len(series),
                     "samples": len(kept), "bytes_gz": (p / SAMPLES_FILE).stat().st_size}
    (p / SCENARIO_FILE).write_text(yaml.safe_dump(sc, sort_keys=False, width=110))
    return dict(sc["samples"])
