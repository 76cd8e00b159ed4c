"""The deploy manifests: the image they name is the one `./dev image` builds, the built-in kinds pass the
Kubernetes API schemas (strict: an unknown field fails), and the PodMonitor scrapes ports the pod has."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = [*sorted((ROOT / "deploy" / "k8s").glob("*.yaml")), ROOT / "alerts" / "k8s" / "prometheusrule.yaml"]
CRDS = {"PodMonitor", "PrometheusRule"}  # the Prometheus Operator's: no schema of theirs ships offline


def documents() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]


def built_image() -> str:
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    script = (ROOT / "deploy" / "image" / "build.sh").read_text()
    assert version and "IMAGE=localhost/stepwatch:$VERSION" in script
    return f"localhost/stepwatch:{version.group(1)}"


def test_every_container_runs_the_image_the_build_tags() -> None:
    images = [c["image"] for _, d in documents() if d["kind"] == "Pod" for c in d["spec"]["containers"]]
    assert images and set(images) == {built_image()}, images


@pytest.mark.parametrize(("name", "doc"), [(n, d) for n, d in documents() if d["kind"] not in CRDS],
                         ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_built_in_kinds_pass_the_kubernetes_schemas(name: str, doc: dict[str, Any]) -> None:
    import kubernetes_validate
    from kubernetes_validate import utils

    kubernetes_validate.validate(doc, utils.latest_version(), strict=True)


def test_the_schema_check_can_fail() -> None:
    import kubernetes_validate
    from kubernetes_validate import utils

    pod = next(d for _, d in documents() if d["kind"] == "Pod")
    bad = yaml.safe_load(yaml.safe_dump(pod))
    bad["spec"]["containers"][0]["imagePullPolicyy"] = "Always"  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, utils.latest_version(), strict=True)


def test_the_pod_monitor_selects_the_pod_and_scrapes_its_named_ports() -> None:
    docs = dict((d["kind"], d) for _, d in documents() if d["kind"] in ("Pod", "PodMonitor"))
    pod, monitor = docs["Pod"], docs["PodMonitor"]
    labels = pod["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    scraped = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert scraped == ports == {"http", "sidecar-metrics"}
    jobs = {r["replacement"] for e in monitor["spec"]["podMetricsEndpoints"] for r in e["relabelings"]}
    assert jobs == {"stepwatch-service", "stepwatch-sidecar"}  # the jobs the rules and dashboards select


def test_the_image_build_script_parses_and_builds_on_the_base_it_makes() -> None:
    import subprocess

    script = ROOT / "deploy" / "image" / "build.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    base = re.search(r"^BASE=(\S+)", script.read_text(), re.M)
    containerfile = (ROOT / "deploy" / "image" / "Containerfile").read_text()
    assert base and f"FROM {base.group(1)}" in containerfile
    assert "image)" in (ROOT / "dev").read_text() and "deploy/image/build.sh" in (ROOT / "dev").read_text()


def _crd_errors(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import json
    import subprocess

    from tests.conftest import need_tool

    node = need_tool("node")
    prefix = ROOT / "build" / "npm"
    if not (prefix / "node_modules" / "@kubernetes-models" / "prometheus-operator").is_dir():
        pytest.skip("the Prometheus Operator's CRD schemas are not installed (./dev setup installs them)")
    p = subprocess.run([node, str(ROOT / "tests" / "crd_validate.mjs"), str(prefix)], input=json.dumps(docs),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    out: list[dict[str, Any]] = json.loads(p.stdout)
    return out


def test_the_operator_objects_pass_the_operators_crd_schemas() -> None:
    crds = [d for _, d in documents() if d["kind"] in CRDS]
    assert {d["kind"] for d in crds} == CRDS
    results = _crd_errors(crds)
    assert [r["errors"] for r in results] == [[], []], results
    bad = yaml.safe_load(yaml.safe_dump(next(d for d in crds if d["kind"] == "PodMonitor")))
    bad["spec"]["podMetricsEndpoints"][0]["interval"] = 15  # a number where the CRD says a duration string
    assert "interval must be string" in _crd_errors([bad])[0]["errors"][0]
