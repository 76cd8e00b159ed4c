"""Prometheus and Alertmanager configs for a fleet: per-node agents, an HA pair of central evaluators, a gossip
cluster of Alertmanagers (``stepwatch fleet up``, fault_injection/fleet.py).

The wiring is the one fleets run:

- each node runs a Prometheus in **agent mode** (``--enable-feature=agent``: scrape and remote-write only, no
  local queries or rules) that scrapes that node's replicas and remote-writes to every central store, with a
  ``node`` external label;
- the **central store** is a Prometheus with the remote-write receiver, run twice with distinct external labels
  (``evaluator: a|b``): both hold every sample and both evaluate the same rules, so losing one loses neither
  data nor alerts.  Chosen over VictoriaMetrics because the rules, the triage queries and the drills already
  speak Prometheus' own API and PromQL (MetricsQL differs at the edges, e.g. ``rate`` extrapolation), and the
  same binary is already a dependency; VictoriaMetrics would be the choice past one node's memory
  (docs/fleet.md: "Scale on paper");
- both evaluators also scrape a **blackbox exporter** that asks the users' endpoint, through the load
  balancer, as a client would (``probe_success``, StepwatchEndpointDown): every other series comes from the
  replicas, which a hung balancer does not touch;
- both evaluators send to both **Alertmanagers**, which gossip (``--cluster.*``) and so notify once: the
  ``evaluator`` label is dropped from alerts before they are sent, so the two evaluators' copies of one alert
  are the same alert.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stepwatch.alerts.rulegen import dump, header
from stepwatch.alerts.stack import _target, alertmanager_binary, debian_or_upstream, rule_file
from stepwatch.thresholds import PROFILES, Thresholds, agent_job, load, probe_job

EVALUATOR_LABEL = "evaluator"
NODE_LABEL = "node"
POD_LABEL = "pod"


def _profile(th: Thresholds | None, profile: str) -> Any:
    th = th or load()
    if profile not in PROFILES:
        raise ValueError(f"profile {profile!r}: choose one of {', '.join(PROFILES)}")
    return th.profiles[profile]


def _static(job: str, urls: Sequence[str], pods: dict[str, str]) -> dict[str, Any]:
    """One job's static targets; a URL in ``pods`` carries a ``pod`` label (the replica it belongs to)."""
    targets = [_target(u, job) for u in urls]
    groups = [{"targets": [hostport], **({"labels": {POD_LABEL: pods[u]}} if u in pods else {})}
              for u, (_, hostport, _) in zip(urls, targets, strict=True)]
    return {"job_name": job, "metrics_path": targets[0][2] or "/metrics", "static_configs": groups}


def agent_config(node: str, jobs: Mapping[str, Sequence[str]], remote_write: Sequence[str], profile: str = "drill",
                 thresholds: Thresholds | None = None, pods: dict[str, str] | None = None) -> str:
    """A node's agent: scrape ``jobs`` ({job: [metrics URLs]}) and remote-write every sample to each central
    store (``http://host:port``; the receiver's path is added).  ``pods`` ({metrics URL: replica}) labels each
    replica's targets with its ``pod``, as Kubernetes service discovery does: on one loopback host the instance's
    host part names no replica, and "is anything else of this pod still up?" needs one."""
    p = _profile(thresholds, profile)
    doc: dict[str, Any] = {
        "global": {"scrape_interval": p.scrape_interval, "scrape_timeout": p.scrape_interval,
                   "external_labels": {NODE_LABEL: node}},
        "scrape_configs": [_static(job, urls, pods or {}) for job, urls in jobs.items() if urls],
        # A short send deadline: samples reach the evaluators within a scrape or two (the default batches for
        # up to 5 s), and a central store that is down is retried from the agent's WAL when it returns.
        "remote_write": [{"url": f"{u.rstrip('/')}/api/v1/write",
                          "queue_config": {"batch_send_deadline": "1s", "min_backoff": "100ms", "max_backoff": "5s"}}
                         for u in remote_write],
    }
    return header(f"Prometheus agent of fleet node {node} ({profile} profile)",
                  ["Agent mode: scrapes and remote-writes only; queries and rules run on the central evaluators."]) \
        + dump(doc)


def central_config(evaluator: str, alertmanagers: Sequence[str], profile: str = "drill",
                   rule_files: Sequence[str | Path] | None = None, thresholds: Thresholds | None = None,
                   agents: dict[str, str] | None = None, blackbox: tuple[str, Sequence[str]] | None = None) -> str:
    """A central evaluator: receives remote writes, evaluates the rules, alerts every Alertmanager with its
    ``evaluator`` label dropped (both evaluators' copies of an alert are one alert to the cluster).  It scrapes
    two things itself: each node's agent (``agents``: {node: http://host:port}), whose ``up`` is the only series
    that turns 0 when a whole node goes (StepwatchNodeSilent), and the blackbox exporter (``blackbox``: its URL
    and the endpoint URLs it probes); everything else arrives by remote write."""
    th = thresholds or load()
    p = _profile(th, profile)
    ams = []
    for url in alertmanagers:
        scheme, hostport, _ = _target(url, "alertmanager")
        ams.append({"scheme": scheme, "static_configs": [{"targets": [hostport]}]})
    doc: dict[str, Any] = {
        "global": {"evaluation_interval": p.evaluation_interval, "external_labels": {EVALUATOR_LABEL: evaluator}},
        "rule_files": [str(f) for f in (rule_files if rule_files is not None else [rule_file(profile)])],
        "scrape_configs": [{"job_name": agent_job(th), "scrape_interval": p.scrape_interval,
                            "scrape_timeout": p.scrape_interval,
                            "static_configs": [{"targets": [_target(u, "agent")[1]], "labels": {NODE_LABEL: node}}
                                               for node, u in sorted((agents or {}).items())]}] if agents else [],
        "alerting": {"alert_relabel_configs": [{"action": "labeldrop", "regex": EVALUATOR_LABEL}],
                     "alertmanagers": ams},
    }
    if blackbox is not None:
        doc["scrape_configs"].append(blackbox_scrape(probe_job(th), blackbox[0], blackbox[1], p.scrape_interval))
    return header(f"Central evaluator {evaluator} of the fleet ({profile} profile)",
                  ["Receives the agents' remote writes (--web.enable-remote-write-receiver); evaluates the rules.",
                   "Its twin holds the same samples and rules under another evaluator label."]) + dump(doc)


BLACKBOX_MODULE = "http_2xx"


def blackbox_scrape(job: str, exporter: str, endpoints: Sequence[str], interval: str) -> dict[str, Any]:
    """The blackbox exporter's documented scrape: each endpoint URL becomes the probe's ``target`` parameter and
    the series' ``instance``; the scrape itself goes to the exporter.  Its timeout is the interval: the exporter
    gives the probe that much less half a second, so a hung endpoint fails the probe, not the scrape."""
    return {"job_name": job, "metrics_path": "/probe", "params": {"module": [BLACKBOX_MODULE]},
            "scrape_interval": interval, "scrape_timeout": interval,
            "static_configs": [{"targets": list(endpoints)}],
            "relabel_configs": [{"source_labels": ["__address__"], "target_label": "__param_target"},
                                {"source_labels": ["__param_target"], "target_label": "instance"},
                                {"target_label": "__address__", "replacement": _target(exporter, "blackbox")[1]}]}


def blackbox_config() -> str:
    """One module: GET the URL, any 2xx within the scrape's timeout is success (the users' endpoint answers)."""
    doc = {"modules": {BLACKBOX_MODULE: {"prober": "http", "http": {"method": "GET",
                                                                    "preferred_ip_protocol": "ip4"}}}}
    return header("Blackbox exporter of the fleet: the users' endpoint, probed through the balancer",
                  ["The central evaluators scrape /probe?module=http_2xx&target=<endpoint>."]) + dump(doc)


def blackbox_binary() -> str:
    """``prometheus-blackbox-exporter`` (Debian) or ``blackbox_exporter`` (upstream)."""
    return debian_or_upstream("prometheus-blackbox-exporter", "blackbox_exporter")


def blackbox_argv(config: str | Path, listen: str, binary: str | None = None) -> list[str]:
    return [binary or blackbox_binary(), f"--config.file={config}", f"--web.listen-address={listen}",
            "--log.level=warn"]


def agent_argv(config: str | Path, data_dir: str | Path, listen: str, binary: str = "prometheus") -> list[str]:
    return [binary, "--enable-feature=agent", f"--config.file={config}", f"--storage.agent.path={data_dir}",
            f"--web.listen-address={listen}", "--web.enable-lifecycle", "--log.level=warn"]


def central_argv(config: str | Path, data_dir: str | Path, listen: str, binary: str = "prometheus") -> list[str]:
    return [binary, f"--config.file={config}", f"--storage.tsdb.path={data_dir}", f"--web.listen-address={listen}",
            "--web.enable-remote-write-receiver", "--web.enable-lifecycle", "--storage.tsdb.retention.time=1d",
            "--log.level=warn"]


def alertmanager_cluster_argv(config: str | Path, data_dir: str | Path, listen: str, cluster_listen: str,
                              peers: Sequence[str], binary: str | None = None, profile: str = "drill",
                              thresholds: Thresholds | None = None) -> list[str]:
    """A clustered Alertmanager: gossip on ``cluster_listen`` (loopback), joined to ``peers``.  Settle and
    gossip intervals are short so a two-member loopback cluster forms within seconds; the peer timeout is the
    profile's (shorter than its group interval: stepwatch/thresholds.py _check_notification_timing)."""
    timing = _profile(thresholds, profile)
    return [binary or alertmanager_binary(), f"--config.file={config}", f"--storage.path={data_dir}",
            f"--web.listen-address={listen}", f"--cluster.listen-address={cluster_listen}",
            f"--cluster.advertise-address={cluster_listen}", *[f"--cluster.peer={peer}" for peer in peers],
            "--cluster.gossip-interval=200ms", "--cluster.pushpull-interval=5s", "--cluster.settle-timeout=5s",
            f"--cluster.peer-timeout={timing.peer_timeout}", "--log.level=warn"]
