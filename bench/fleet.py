"""``stepwatch bench fleet``: a load test through the load balancer, side by side with direct requests.

Brings the practice fleet up (fault_injection/fleet.py), then sends the same image requests in alternating
batches through haproxy and straight to the replicas (round robin), ``--concurrency`` at a time.  Reports:
every request answered (status codes), how the balancer spread its requests over the replicas (each replica's
share against an even one: ``spread`` is the largest deviation from even, relative), the balancer's added latency
(median and p95 through it minus direct, in the same run), and the requests the central store counted per
replica (remote-written by the agents) against what the clients saw.  Two cores serve three replicas here, so
the fleet's throughput cannot triple: the figures say what it does.  A generation's time wanders by more than
the balancer costs, so haproxy's own cost is also measured on health checks (no generation), one by one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from stepwatch import httpclient
from stepwatch.fault_injection import queries
from stepwatch.fault_injection.fleet import FleetStack
from stepwatch.promapi import Prometheus

BODY = {"prompt": "a lighthouse at dusk", "size": "256x256", "steps": 4, "response_format": "b64_json"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=60, help="requests each way (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=3, help="requests in flight (default %(default)s)")
    p.add_argument("--replicas", type=int, default=3, help="practice replicas (default %(default)s)")
    p.add_argument("--workdir", help="the fleet's configs and logs (default: a temporary folder)")
    p.add_argument("--scale", action="store_true",
                   help="also measure what a pod costs the central store and print the 10..10,000-pod table")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the results")


def _one(client: httpx.Client, url: str) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    try:
        r = client.post(url + "/v1/images/generations", json=BODY, timeout=120)
    except httpx.HTTPError as e:
        return 0, time.perf_counter() - t0, type(e).__name__
    seconds = time.perf_counter() - t0
    sw = r.json().get("stepwatch", {}) if r.status_code == 200 else {}
    return r.status_code, seconds, str(sw.get("instance_id", ""))


def _batches(fleet: FleetStack, n: int, concurrency: int) -> dict[str, list[tuple[int, float, str]]]:
    """``n`` requests each way in alternating batches of ``concurrency`` (so the host's load hits both alike)."""
    out: dict[str, list[tuple[int, float, str]]] = {"balancer": [], "direct": []}
    direct = [r.service_url for r in fleet.members]
    lock = threading.Lock()
    with httpclient.client(timeout=120) as client, ThreadPoolExecutor(concurrency) as pool:
        sent = 0
        while sent < n:
            k = min(concurrency, n - sent)
            for way in ("balancer", "direct") if (sent // concurrency) % 2 == 0 else ("direct", "balancer"):
                urls = [fleet.balancer_url] * k if way == "balancer" else \
                    [direct[(sent + i) % len(direct)] for i in range(k)]
                for res in pool.map(lambda u: _one(client, u), urls):
                    with lock:
                        out[way].append(res)
            sent += k
    return out


def proxy_overhead_ms(fleet: FleetStack, n: int = 200) -> dict[str, float]:
    """haproxy's own cost: ``GET /healthz`` (no generation, so no worker noise) through it and direct, alternating
    one by one on kept-alive connections; medians in ms and their difference."""
    times: dict[str, list[float]] = {"balancer": [], "direct": []}
    with httpclient.client(timeout=10) as client:
        for i in range(2 * n):
            way = "balancer" if i % 2 == 0 else "direct"
            url = fleet.balancer_url if way == "balancer" else fleet.members[(i // 2) % len(fleet.members)].service_url
            t0 = time.perf_counter()
            client.get(url + "/healthz")
            times[way].append(time.perf_counter() - t0)
    lb, direct = statistics.median(times["balancer"]) * 1e3, statistics.median(times["direct"]) * 1e3
    return {"healthz_balancer_ms": round(lb, 3), "healthz_direct_ms": round(direct, 3),
            "proxy_added_ms": round(lb - direct, 3)}


def _p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _counted(fleet: FleetStack) -> dict[str, float]:
    """Requests answered 200 per replica as the central store has them (both evaluators must agree)."""
    per = [{s.labels.get("instance", ""): s.value for s in Prometheus(u).query(queries.requests_ok_by_instance())}
           for u in fleet.evaluators]
    return per[0] if all(p == per[0] for p in per) else {"disagree": -1.0, **per[0]}


def measure(fleet: FleetStack, requests: int, concurrency: int) -> dict[str, Any]:
    _batches(fleet, len(fleet.members), len(fleet.members))  # connections and first requests, untimed
    time.sleep(12)
    before = _counted(fleet)
    runs = _batches(fleet, requests, concurrency)
    time.sleep(12)  # two scrapes and a remote-write flush
    after = _counted(fleet)
    overhead = proxy_overhead_ms(fleet)
    lb, direct = runs["balancer"], runs["direct"]
    by_instance = Counter(inst for code, _, inst in lb if code == 200)
    even = len(lb) / len(fleet.members)
    lb_s, direct_s = [s for c, s, _ in lb if c == 200], [s for c, s, _ in direct if c == 200]
    return {
        "replicas": len(fleet.members), "requests_each_way": requests, "concurrency": concurrency,
        "codes": dict(Counter(str(c) for c, _, _ in lb + direct)),
        "answered": sum(1 for c, _, _ in lb + direct if c == 200), "sent": len(lb) + len(direct),
        "balancer_per_replica": dict(sorted(by_instance.items())),
        "spread": round(max(abs(by_instance.get(f"{r.name}:{r.service_url.rsplit(':', 1)[1]}", 0) - even)
                            for r in fleet.members) / even, 3),
        "central_counted": {k: after.get(k, 0) - before.get(k, 0) for k in sorted(after)},
        "balancer_p50_ms": round(statistics.median(lb_s) * 1e3, 1) if lb_s else None,
        "direct_p50_ms": round(statistics.median(direct_s) * 1e3, 1) if direct_s else None,
        "balancer_p95_ms": round(_p(lb_s, 0.95) * 1e3, 1) if lb_s else None,
        "direct_p95_ms": round(_p(direct_s, 0.95) * 1e3, 1) if direct_s else None,
        "added_p50_ms": round((statistics.median(lb_s) - statistics.median(direct_s)) * 1e3, 1)
        if lb_s and direct_s else None,
        **overhead,
    }


def scale(fleet: FleetStack) -> dict[str, Any]:
    """The scale table's inputs on this fleet, and a production pod's series (50 shapes, 8 ranks, 8 GPUs) from
    the exposition benchmark."""
    from stepwatch.bench.exposition import service_case, sidecar_case
    from stepwatch.fault_injection.fleet_scale import measure_scale

    svc, sc = service_case(50, 8, renders=1)["series"], sidecar_case(8, renders=1)["series"]
    first = fleet.members[0].service_url.removeprefix("http://")
    return measure_scale(fleet.evaluators[0], fleet.agents, fleet.evaluator_rss_empty, first,
                         {"service": svc, "sidecar": sc, "pod": svc + sc})


def _print_scale(s: dict[str, Any]) -> None:
    pod = s["series_per_pod"]
    print(f"per practice pod on the central store: {pod['service']:.0f} service + {pod['sidecar']:.0f} sidecar "
          f"series; ingest {s['samples_per_s']:.0f} samples/s for {s['head_series']:.0f} head series; "
          f"{s['bytes_per_head_series']} bytes of evaluator memory per series; "
          f"{s['wire_bytes_per_sample']:.2f} remote-write bytes per sample")
    for name in ("practice", "production"):
        print(f"{name} pods ({s['series_per_pod']['pod'] if name == 'practice' else s['production_pod']['pod']:.0f} "
              "series each, 15 s scrape):")
        for row in s[name]:
            print(f"  {row['pods']:>6} pods: {row['series']:>11,} series, {row['samples_per_s']:>9,} samples/s, "
                  f"{row['evaluator_memory_gib']:>8} GiB per evaluator, {row['remote_write_mbit_s']:>8} Mbit/s; "
                  f"{row['advice']}")


def run(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.concurrency < 1:
        print("bench fleet: --requests and --concurrency must be at least 1", file=sys.stderr)
        return 2
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="stepwatch-fleet-"))
    with FleetStack(workdir, replicas=args.replicas, progress=lambda m: print(m, file=sys.stderr, flush=True)) as f:
        r = measure(f, args.requests, args.concurrency)
        if args.scale:
            r["scale"] = scale(f)
            _print_scale(r["scale"])
    print(f"{r['answered']}/{r['sent']} answered 200; balancer spread over replicas {r['balancer_per_replica']} "
          f"(largest deviation from even {r['spread']:.0%})")
    print(f"latency p50 through the balancer {r['balancer_p50_ms']} ms, direct {r['direct_p50_ms']} ms (added "
          f"{r['added_p50_ms']} ms); p95 {r['balancer_p95_ms']} vs {r['direct_p95_ms']} ms")
    print(f"haproxy's own cost (GET /healthz, {r['healthz_balancer_ms']} ms through it, {r['healthz_direct_ms']} ms "
          f"direct): {r['proxy_added_ms']} ms per request")
    print(f"requests counted on the central store per replica: {r['central_counted']}")
    if args.json:
        print(json.dumps(r))
    return 0
