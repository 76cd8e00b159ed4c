"""The practice fleet: its configs pass the tools' own checks, and a load test through haproxy at 3 replicas is
answered, spread evenly, and counted on both central evaluators as the clients saw it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from stepwatch.alerts import fleet as fcfg
from stepwatch.alerts.stack import SERVICE_JOB
from stepwatch.service.balancer import haproxy_binary, haproxy_config


def test_agent_and_central_configs_pass_promtool(tmp_path: Path) -> None:
    agent = tmp_path / "agent.yml"
    agent.write_text(fcfg.agent_config("node-0", {SERVICE_JOB: ["http://127.0.0.1:8000/metrics"]},
                                       ["http://127.0.0.1:9101", "http://127.0.0.1:9102"]))
    doc = yaml.safe_load(agent.read_text())
    assert doc["global"]["external_labels"] == {"node": "node-0"}
    assert [w["url"] for w in doc["remote_write"]] == ["http://127.0.0.1:9101/api/v1/write",
                                                      "http://127.0.0.1:9102/api/v1/write"]
    assert "rule_files" not in doc and "alerting" not in doc  # an agent only scrapes and forwards
    r = subprocess.run(["promtool", "check", "config", "--agent", str(agent)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr

    central = tmp_path / "central.yml"
    central.write_text(fcfg.central_config("a", ["http://127.0.0.1:9201", "http://127.0.0.1:9202"]))
    doc = yaml.safe_load(central.read_text())
    assert doc["global"]["external_labels"] == {"evaluator": "a"}
    assert doc["alerting"]["alert_relabel_configs"] == [{"action": "labeldrop", "regex": "evaluator"}]
    assert len(doc["alerting"]["alertmanagers"]) == 2 and "scrape_configs" not in doc
    r = subprocess.run(["promtool", "check", "config", str(central)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr

    argv = fcfg.alertmanager_cluster_argv("am.yml", "data", "127.0.0.1:1", "127.0.0.1:2", ["127.0.0.1:3"])
    assert "--cluster.listen-address=127.0.0.1:2" in argv and "--cluster.peer=127.0.0.1:3" in argv


def test_haproxy_config_passes_haproxy_check(tmp_path: Path) -> None:
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(haproxy_config("127.0.0.1:18000", "127.0.0.1:18001",
                                  [("replica-0", "127.0.0.1:18002"), ("replica-1", "127.0.0.1:18003")]))
    text = cfg.read_text()
    assert "balance leastconn" in text and "option httpchk GET /readyz" in text
    assert "server replica-1 127.0.0.1:18003 check" in text
    r = subprocess.run([haproxy_binary(), "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.heavy
def test_load_through_the_balancer_at_three_replicas(tmp_path: Path) -> None:
    from stepwatch.fault_injection.bench_fleet import measure
    from stepwatch.fault_injection.fleet import FleetStack
    from stepwatch.promapi import Prometheus

    with FleetStack(tmp_path / "fleet", replicas=3) as fleet:
        for url in fleet.evaluators:  # every target reached both evaluators through the node agents
            up = Prometheus(url).query("up")
            assert len(up) == 7 and all(s.value == 1 for s in up), up
            assert {s.labels["node"] for s in up} == {"node-0", "node-1"}
        for url in fleet.alertmanagers:  # the two Alertmanagers gossip as one cluster
            status = httpx.get(url + "/api/v2/status", timeout=5).json()
            assert status["cluster"]["status"] == "ready" and len(status["cluster"]["peers"]) == 2, status
        r = measure(fleet, requests=30, concurrency=3)
    assert r["answered"] == r["sent"] == 60, r["codes"]
    assert r["spread"] <= 0.2, r["balancer_per_replica"]  # within 20% of even
    lb, direct = r["balancer_per_replica"], 10  # direct requests go round robin: 10 per replica
    for rep in fleet.members:
        port = rep.service_url.rsplit(":", 1)[1]
        assert r["central_counted"][f"127.0.0.1:{port}"] == lb[f"{rep.name}:{port}"] + direct, r
    assert r["balancer_p50_ms"] > 0 and r["direct_p50_ms"] > 0
