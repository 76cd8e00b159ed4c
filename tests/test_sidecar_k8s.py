"""The example pod and PodMonitor agree with the CLIs' defaults: ports, paths, flags, config."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from stepwatch.exporter.sidecar import cli_sidecar
from stepwatch.exporter.sidecar.config import parse_config
from stepwatch.service import cli_serve
from stepwatch.thresholds import load

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
# The service's documented CLI (docs/contracts.md): `stepwatch serve --host 127.0.0.1 --port 8000 --config FILE`,
# /metrics on the same port.  The tests check the real parser (stepwatch.service.cli_serve) against it.
SERVICE_DEFAULT_PORT = 8000


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def parser_of(add_arguments: Any) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


def service_parser() -> argparse.ArgumentParser:
    return parser_of(cli_serve.add_arguments)


def pod() -> dict[str, Any]:
    (p,) = [d for d in docs("inference-pod.yaml") if d["kind"] == "Pod"]
    return p


def container(name: str) -> dict[str, Any]:
    (c,) = [c for c in pod()["spec"]["containers"] if c["name"] == name]
    return c


def port_named(c: dict[str, Any], name: str) -> int:
    (p,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return int(p)


def test_inference_container_runs_the_service_on_its_default_port() -> None:
    c = container("inference")
    assert c["command"] == ["stepwatch", "serve"]
    sp = service_parser()
    args = sp.parse_args(c["args"])
    assert args.port == sp.get_default("port") == SERVICE_DEFAULT_PORT
    assert args.host == "0.0.0.0"  # in a pod the service binds every interface
    assert args.config
    assert port_named(c, "http") == args.port
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert "nvidia.com/gpu" in c["resources"]["limits"]


def test_sidecar_container_matches_the_cli_defaults() -> None:
    c = container("stepwatch-sidecar")
    assert c["command"] == ["stepwatch", "sidecar"]
    parser = parser_of(cli_sidecar.add_arguments)
    args = parser.parse_args(c["args"])
    assert args.port == parser.get_default("port") == cli_sidecar.DEFAULT_PORT == 9465
    assert args.host == "0.0.0.0"
    assert port_named(c, "sidecar-metrics") == args.port
    target = urlparse(args.target)
    assert target.hostname == "127.0.0.1" and target.port == port_named(container("inference"), "http")
    assert "nvidia.com/gpu" not in c.get("resources", {}).get("limits", {})  # NVML reads need no GPU request
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert args.config == mounts["sidecar-config"]


def test_sidecar_config_in_the_configmap_is_valid_and_consistent(tmp_path: Path) -> None:
    (cm,) = [d for d in docs("inference-pod.yaml") if d["kind"] == "ConfigMap" and d["metadata"]["name"]
             == "stepwatch-sidecar"]
    cfg = parse_config(yaml.safe_load(cm["data"]["sidecar.yaml"]), Path("/"))
    c = container("stepwatch-sidecar")
    args = parser_of(cli_sidecar.add_arguments).parse_args(c["args"])
    assert cfg.target == args.target
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert str(cfg.baseline_dir) == mounts["baselines"]
    q = load().quality
    assert cfg.probe_set.gate in q.gates_db
    assert len(cfg.probe_set.items) == 20 and cfg.probe_set.items[0].size == "256x256"
    volumes = {v["name"]: v for v in pod()["spec"]["volumes"]}
    assert volumes["sidecar-config"]["configMap"]["name"] == cm["metadata"]["name"]
    assert set(mounts) <= set(volumes)


def test_podmonitor_scrapes_both_containers() -> None:
    (pm,) = docs("podmonitor.yaml")
    assert pm["kind"] == "PodMonitor" and pm["apiVersion"] == "monitoring.coreos.com/v1"
    labels = pod()["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    named = {p["name"]: p["containerPort"] for c in pod()["spec"]["containers"] for p in c["ports"]}
    eps = pm["spec"]["podMetricsEndpoints"]
    assert {e["port"] for e in eps} == {"http", "sidecar-metrics"}
    assert named["http"] == SERVICE_DEFAULT_PORT and named["sidecar-metrics"] == cli_sidecar.DEFAULT_PORT
    production = load().profiles["production"].scrape_interval
    for e in eps:
        assert e["path"] == "/metrics"
        assert e["interval"] == production
        jobs = [r["replacement"] for r in e.get("relabelings", []) if r.get("targetLabel") == "job"]
        assert jobs and re.match(r"stepwatch.*", jobs[0])  # the TargetDown alert selects job=~"stepwatch.*"


@pytest.mark.parametrize("name", ["inference-pod.yaml", "podmonitor.yaml"])
def test_manifests_have_kind_and_name(name: str) -> None:
    for d in docs(name):
        assert d["apiVersion"] and d["kind"] and d["metadata"]["name"]
