"""Scale on paper, from measurements: what one pod costs the monitoring, and what 10 to 10,000 pods would.

Measured on the running practice fleet (``stepwatch bench fleet --scale``): the series each pod (service +
sidecar) puts on the central store, the samples per second the central evaluators ingest, the bytes per sample
the agents send over remote write, and the central evaluator's resident memory per head series (its memory with
the fleet's series minus its memory before any agent wrote).  A production pod is larger than a practice one
(more shapes on its allowlist, 8 ranks, 8 GPUs), so its series come from the exposition benchmark
(bench/exposition.py) at the pod's shapes, ranks and GPUs; the per-series and per-sample costs are the
measured ones.  The table extrapolates linearly: that is the assumption to check when a real fleet grows.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from stepwatch import httpclient
from stepwatch.fault_injection import queries
from stepwatch.promapi import Prometheus

PODS = (10, 100, 1_000, 10_000)
PRODUCTION_SCRAPE_S = 15.0
# One evaluator's memory budget before the central store must be sharded (hashmod over agents' remote writes,
# or VictoriaMetrics' cluster): a 64 GiB node with half kept for queries and compaction.
EVALUATOR_BUDGET_BYTES = 32 * 2**30


def read_metrics(url: str) -> dict[str, float]:
    """Every sample of a ``/metrics`` page summed by name (labels dropped)."""
    with httpclient.client(timeout=10) as c:
        text = c.get(url + "/metrics").text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def pod_series(central: str) -> dict[str, float]:
    """Series per pod on the central store: each replica's service series plus its sidecar's, averaged."""
    rows = Prometheus(central).query(queries.series_per_target())
    by_job: dict[str, list[float]] = {}
    for s in rows:
        by_job.setdefault(s.labels.get("job", ""), []).append(s.value)
    service = sum(by_job.get("stepwatch-service", [0])) / max(1, len(by_job.get("stepwatch-service", [])))
    sidecar = sum(by_job.get("stepwatch-sidecar", [0])) / max(1, len(by_job.get("stepwatch-sidecar", [])))
    return {"service": service, "sidecar": sidecar, "pod": service + sidecar}


def top_families(central: str, instance: str, n: int = 5) -> list[tuple[str, int]]:
    """The metric families with the most series on one service instance (what recording rules should cut)."""
    rows = Prometheus(central).query(queries.series_per_family())
    counts = Counter({s.labels.get("__name__", ""): int(s.value) for s in rows if s.labels.get("instance") == instance})
    return counts.most_common(n)


def ingestion(central: str, agents: list[str], window_s: float = 30.0) -> dict[str, float]:
    """Samples/s into the central store, wire bytes per sample out of the agents, over ``window_s``."""
    c0, a0 = read_metrics(central), [read_metrics(a) for a in agents]
    time.sleep(window_s)
    c1, a1 = read_metrics(central), [read_metrics(a) for a in agents]
    appended = c1["prometheus_tsdb_head_samples_appended_total"] - c0["prometheus_tsdb_head_samples_appended_total"]
    sent = sum(b.get("prometheus_remote_storage_samples_total", 0) - a.get("prometheus_remote_storage_samples_total", 0)
               for a, b in zip(a0, a1, strict=True))
    wire = sum(b.get("prometheus_remote_storage_bytes_total", 0) - a.get("prometheus_remote_storage_bytes_total", 0)
               for a, b in zip(a0, a1, strict=True))
    return {"samples_per_s": appended / window_s, "head_series": c1["prometheus_tsdb_head_series"],
            "rss_bytes": c1["process_resident_memory_bytes"], "wire_bytes_per_sample": wire / sent if sent else 0.0}


def scale_rows(series_per_pod: float, bytes_per_series: float, wire_bytes_per_sample: float,
               scrape_s: float = PRODUCTION_SCRAPE_S) -> list[dict[str, Any]]:
    """Series, samples/s, evaluator memory and remote-write bandwidth at each fleet size, and what to do there."""
    rows = []
    for pods in PODS:
        series = pods * series_per_pod
        memory = series * bytes_per_series
        rows.append({"pods": pods, "series": round(series), "samples_per_s": round(series / scrape_s),
                     "evaluator_memory_gib": round(memory / 2**30, 2),
                     "remote_write_mbit_s": round(series / scrape_s * wire_bytes_per_sample * 8 / 1e6, 2),
                     "advice": _advice(memory)})
    return rows


def _advice(memory: float) -> str:
    if memory < EVALUATOR_BUDGET_BYTES / 8:
        return "one evaluator pair"
    if memory < EVALUATOR_BUDGET_BYTES:
        return "one evaluator pair; recording rules per pool, raw per-shape buckets kept short"
    shards = int(memory // EVALUATOR_BUDGET_BYTES) + 1
    return f"shard: {shards} evaluator pairs by hashmod of instance (or VictoriaMetrics cluster)"


def measure_scale(central: str, agents: list[str], rss_empty: float, instance: str,
                  production: dict[str, float]) -> dict[str, Any]:
    """Everything the scale table is built from, and the table for the practice pod and a production one."""
    per_pod = pod_series(central)
    ing = ingestion(central, agents)
    bytes_per_series = max(0.0, ing["rss_bytes"] - rss_empty) / ing["head_series"]
    return {"series_per_pod": per_pod, **ing, "rss_empty_bytes": rss_empty,
            "bytes_per_head_series": round(bytes_per_series),
            "top_families": top_families(central, instance),
            "practice": scale_rows(per_pod["pod"], bytes_per_series, ing["wire_bytes_per_sample"]),
            "production_pod": production,
            "production": scale_rows(production["pod"], bytes_per_series, ing["wire_bytes_per_sample"])}
