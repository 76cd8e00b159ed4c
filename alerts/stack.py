"""Prometheus and Alertmanager configs for the local stack (drills, demo, CI).

The drills start ``prometheus`` and ``prometheus-alertmanager`` as child processes on
loopback ports, each with its own data directory::

    from stepwatch.alerts import stack
    Path("prom.yml").write_text(stack.prometheus_config(profile="drill"))
    Path("am.yml").write_text(stack.alertmanager_config("http://127.0.0.1:9466/alerts", profile="drill"))
    subprocess.Popen(stack.prometheus_argv("prom.yml", "prom-data", "127.0.0.1:9090"))
    subprocess.Popen(stack.alertmanager_argv("am.yml", "am-data", "127.0.0.1:9093"))

Timings come from the profile in stepwatch/thresholds.yaml (scrape/evaluation intervals,
Alertmanager group_wait/group_interval/repeat_interval).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from stepwatch.alerts.rulegen import dump, header
from stepwatch.thresholds import PROFILES, Thresholds, load

SERVICE_JOB = "stepwatch-service"
SIDECAR_JOB = "stepwatch-sidecar"
DEFAULTS = {
    "service_url": "http://127.0.0.1:8000/metrics",
    "sidecar_url": "http://127.0.0.1:9465/metrics",
    "webhook_url": "http://127.0.0.1:9466/alerts",
    "alertmanager_url": "http://127.0.0.1:9093",
    "prometheus_listen": "127.0.0.1:9090",
    "alertmanager_listen": "127.0.0.1:9093",
}
# Drill: one notification per alert, so triage sees each fault on its own.  Production: one per
# alert and place, so a fleet-wide regression is one page, not one per instance.
GROUP_BY = {"drill": ["..."], "production": ["alertname", "job", "pool", "shape"]}


def rule_file(profile: str) -> Path:
    """The packaged, generated rule file of a profile."""
    if profile not in PROFILES:
        raise ValueError(f"profile {profile!r}: choose one of {', '.join(PROFILES)}")
    return Path(str(resources.files("stepwatch.alerts") / "rules" / f"stepwatch-{profile}.rules.yml"))


def _target(url: str, what: str) -> tuple[str, str, str]:
    """(scheme, host:port, path) of an http URL; a bare host:port means http and /metrics."""
    if "://" not in url:
        url = "http://" + url
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname or u.port is None:
        raise ValueError(f"{what}: {url!r} is not an http(s) URL with host and port")
    return u.scheme, u.netloc, u.path


def _scrape(job: str, urls: list[str], what: str) -> dict[str, Any]:
    """One job; several instances of it must share scheme and path."""
    parsed = [_target(u, what) for u in urls]
    if not parsed:
        raise ValueError(f"{what}: no URL")
    if len({(scheme, path) for scheme, _, path in parsed}) > 1:
        raise ValueError(f"{what}: instances of one job must share scheme and path: {urls}")
    scheme, _, path = parsed[0]
    return {"job_name": job, "scheme": scheme, "metrics_path": path or "/metrics",
            "static_configs": [{"targets": [hostport for _, hostport, _ in parsed]}]}


def prometheus_config(service_url: str | Sequence[str] = DEFAULTS["service_url"],
                      sidecar_url: str | Sequence[str] | None = DEFAULTS["sidecar_url"],
                      rule_files: Sequence[str | Path] | None = None,
                      alertmanager_url: str | None = DEFAULTS["alertmanager_url"],
                      profile: str = "drill", thresholds: Thresholds | None = None) -> str:
    """prometheus.yml scraping the service (and sidecar) and sending alerts to Alertmanager.

    ``rule_files`` default to the packaged rules of ``profile``; relative paths are
    resolved by Prometheus against the config file's directory.
    """
    th = thresholds or load()
    if profile not in PROFILES:
        raise ValueError(f"profile {profile!r}: choose one of {', '.join(PROFILES)}")
    p = th.profiles[profile]
    scrapes: list[dict[str, Any]] = []
    for job, urls, what in ((SERVICE_JOB, service_url, "service_url"), (SIDECAR_JOB, sidecar_url, "sidecar_url")):
        if urls is not None:
            scrapes.append(_scrape(job, [urls] if isinstance(urls, str) else list(urls), what))
    doc: dict[str, Any] = {
        "global": {"scrape_interval": p.scrape_interval, "evaluation_interval": p.evaluation_interval,
                   "scrape_timeout": p.scrape_interval},
        "rule_files": [str(f) for f in (rule_files if rule_files is not None else [rule_file(profile)])],
    }
    if alertmanager_url:
        scheme, hostport, path = _target(alertmanager_url, "alertmanager_url")
        am: dict[str, Any] = {"scheme": scheme, "static_configs": [{"targets": [hostport]}]}
        if path and path != "/":
            am["path_prefix"] = path
        doc["alerting"] = {"alertmanagers": [am]}
    doc["scrape_configs"] = scrapes
    return header(f"Prometheus config of the local stack ({profile} profile)",
                  [f"Rules: {', '.join(doc['rule_files'])}",
                   f"Jobs {SERVICE_JOB} and {SIDECAR_JOB} match job_regex {th.job_regex!r} (TargetDown)."]) \
        + dump(doc)


def alertmanager_config(webhook_url: str = DEFAULTS["webhook_url"], profile: str = "drill",
                        thresholds: Thresholds | None = None, send_resolved: bool = True) -> str:
    """alertmanager.yml: every alert to the triage webhook; TargetDown mutes what it blinds."""
    th = thresholds or load()
    if profile not in PROFILES:
        raise ValueError(f"profile {profile!r}: choose one of {', '.join(PROFILES)}")
    _target(webhook_url, "webhook_url")
    p = th.profiles[profile]
    down = th.alert("target_down").name
    doc = {
        "route": {
            "receiver": "triage",
            "group_by": GROUP_BY[profile],
            "group_wait": p.group_wait,
            "group_interval": p.group_interval,
            "repeat_interval": p.repeat_interval,
        },
        "receivers": [{"name": "triage", "webhook_configs": [{"url": webhook_url, "send_resolved": send_resolved}]}],
        # A target that cannot be scraped makes its other alerts meaningless; page on the cause only.
        "inhibit_rules": [{"source_matchers": [f'alertname="{down}"'],
                           "target_matchers": ['severity=~"warning|info"'],
                           "equal": ["job", "instance"]}],
    }
    return header(f"Alertmanager config of the local stack ({profile} profile)",
                  ["Every alert goes to the triage webhook (send_resolved). In production, add routes:",
                   "severity=critical to the pager, warning to the ticket queue, info nowhere but triage."]) \
        + dump(doc)


def debian_or_upstream(debian: str, upstream: str) -> str:
    """The binary by its Debian package's name or its upstream one, whichever is on PATH."""
    for name in (debian, upstream):
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError(f"neither {debian} nor {upstream} is on PATH (apt-get install -y {debian})")


def alertmanager_binary() -> str:
    """``prometheus-alertmanager`` (Debian) or ``alertmanager`` (upstream)."""
    return debian_or_upstream("prometheus-alertmanager", "alertmanager")


def prometheus_argv(config: str | Path, data_dir: str | Path, listen: str = DEFAULTS["prometheus_listen"],
                    binary: str = "prometheus") -> list[str]:
    """Command line of a child Prometheus with its own data dir; /-/reload enabled."""
    return [binary, f"--config.file={config}", f"--storage.tsdb.path={data_dir}", f"--web.listen-address={listen}",
            "--web.enable-lifecycle", "--storage.tsdb.retention.time=1d", "--log.level=warn"]


def alertmanager_argv(config: str | Path, data_dir: str | Path, listen: str = DEFAULTS["alertmanager_listen"],
                      binary: str | None = None) -> list[str]:
    """Command line of a child Alertmanager; clustering off (it would listen on all interfaces)."""
    return [binary or alertmanager_binary(), f"--config.file={config}", f"--storage.path={data_dir}",
            f"--web.listen-address={listen}", "--cluster.listen-address=", "--log.level=warn"]
