"""Prometheus recording and alerting rules, built from the thresholds source and the alert definitions.

Recording rules follow ``level:metric:operations``: the level lists the labels the
output keeps besides ``job`` (always kept: it names the deployment), the metric is the
catalog name (``_total`` dropped after rate()), the operations say what was done.
Ratios are sums over sums, never averages of ratios.  Every rate window of every
profile is recorded in both rule files, so dashboards and triage use one set of names.

Alerting rules come from the AlertDefs (alerts/defs/), one per alert, with the numbers
and text of stepwatch/thresholds.yaml.  They read the recorded series of their profile's
rate window; baselines come from the ``stepwatch_baseline_*`` gauges (never ``offset``).
Every query is built from the words of ``stepwatch.alerts.promql``.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

import yaml

from stepwatch.alerts import defs, gotemplate
from stepwatch.alerts.promql import (
    cache_hit_ratio,
    device_peak_flops,
    fill,
    mean_step_time,
    num,
    over_positive,
    ratio_of_rates,
    ratio_to_fastest,
    sel,
    sum_rate,
    text_values,
)
from stepwatch.thresholds import (
    PROFILES,
    AlertSpec,
    Thresholds,
    ThresholdsError,
    capacity_headroom,
    parse_duration,
)

__all__ = ["ALERTING_GROUP", "GENERATED_BY", "RECORDING_GROUP", "SEVERITY_MEANING", "Recording", "alert_annotations",
           "alert_labels", "alert_window", "alerting_rule", "dump", "fill", "header", "num", "prometheus_rule",
           "recorded_names", "recording_rules", "rule_groups", "rules_file", "text_values", "tidy", "windows"]

GENERATED_BY = "stepwatch rules generate"
RECORDING_GROUP = "stepwatch.recording"
ALERTING_GROUP = "stepwatch.alerts"

SEVERITY_MEANING = {
    "critical": "pages on-call now: users get errors or bad images now, or we are blind",
    "warning": "a ticket for business hours: performance, cost or capacity drift",
    "info": "context for triage; never notifies anyone on its own",
}


def tidy(expr: str) -> str:
    """Drop the indentation of the first line from every line (the builders indent operands)."""
    lines = expr.splitlines()
    k = len(lines[0]) - len(lines[0].lstrip(" "))
    return "\n".join(line[min(k, len(line) - len(line.lstrip(" "))):] for line in lines)


def windows(th: Thresholds) -> list[str]:
    """Every profile's rate window, shortest first."""
    return sorted({p.rate_window for p in th.profiles.values()}, key=parse_duration)


@dataclass(frozen=True)
class Recording:
    record: str
    expr: str
    meaning: str  # one line for people: what the number is


# ----- recording rules ------------------------------------------------------------------------

STEP, LEDGER = "stepwatch_pipeline_step_duration_seconds", "stepwatch_ledger_flops_total"
PEAK = device_peak_flops()
WAIT, SLO = "stepwatch_queue_estimated_wait_seconds", "stepwatch_queue_slo_seconds"
RANK_STEP = "stepwatch_rank_step_duration_seconds"


def _step_and_cache(w: str) -> list[Recording]:
    """Mean step time and cache hit ratio per instance and shape, and per shape over the fleet."""
    out = []
    for level, by in (("instance_shape", "job, instance, shape"), ("shape", "job, shape")):
        where = "per instance and shape" if level == "instance_shape" else "per shape over all instances"
        out.append(Recording(
            f"{level}:{STEP}:mean_rate{w}", mean_step_time(w, by),
            f"mean seconds per denoising step over {w}, {where} (sum of step time / number of steps)"))
        out.append(Recording(
            f"{level}:stepwatch_cache_decisions:hit_ratio_rate{w}", cache_hit_ratio(w, by),
            f"cross-step cache hits / all cache decisions over {w}, {where} (0 when the cache never hit)"))
    return out


def _mfu(w: str) -> list[Recording]:
    """MFU from the FLOPs ledger: per instance against its device peak, and over the fleet."""
    fleet_seconds = (f"sum by (job, shape) (\n      rate({STEP}_sum[{w}])\n    * on (job, instance) group_left\n"
                     f"      {PEAK}\n  )")
    return [
        Recording(f"instance_shape:stepwatch_ledger_flops:mfu_rate{w}",
                  ratio_of_rates(LEDGER, f"{STEP}_sum", w, "job, instance, shape")
                  + f"\n/ on (job, instance) group_left\n  {PEAK}",
                  f"model FLOPs utilization over {w} per instance and shape: ledger FLOPs / denoising seconds / "
                  "the device's dense peak FLOP/s (absent when the peak is unknown)"),
        Recording(f"shape:stepwatch_ledger_flops:mfu_rate{w}",
                  f"  {sum_rate(LEDGER, w, 'job, shape')}\n/\n  {fleet_seconds}",
                  f"fleet MFU over {w} per shape: all ledger FLOPs / all (denoising seconds x device peak)"),
    ]


def _ranks_and_errors(w: str) -> list[Recording]:
    """Per-rank busy time per step (and against the fastest rank), and the 5xx ratio per pool."""
    busy = ratio_of_rates("stepwatch_rank_busy_seconds_total", "stepwatch_rank_steps_total", w,
                          "job, instance, rank")
    requests = "stepwatch_service_requests_total"
    return [
        Recording(f"instance_rank:stepwatch_rank_busy_seconds:mean_rate{w}", busy,
                  f"each sequence-parallel rank's mean busy seconds per step over {w} (release to arrival at each "
                  "collective, plus waits for a CPU; the straggler's is longest)"),
        Recording(f"instance_rank:stepwatch_rank_busy_seconds:ratio_to_fastest_rate{w}",
                  ratio_to_fastest(busy),
                  f"each rank's busy seconds per step / the fastest rank's, over {w}; 1 = the fastest"),
        Recording(f"pool:stepwatch_service_requests:error_ratio_rate{w}",
                  ratio_of_rates(sel(requests, 'code=~"5.."'), requests, w, "job, pool", zero_fill=True),
                  f"generation requests answered 5xx / all requests over {w}, per pool (0 when none failed)"),
    ]


def _fleet(w: str, headroom: float | None, complete: float) -> list[Recording]:
    """Each instance against the fleet (the median instance per shape), and the pool's capacity: the seeds' formula,
    instances needed = QPS x worker seconds per request x headroom (none without ``alerts.pool_capacity``).

    Only instances whose data are complete over the window count (``diagnosis.complete_ratio`` of the scrapes
    the best-covered instance of the job has): a node agent paused for a minute leaves its instances a mean over
    the few samples around the gap, which named a healthy replica slow."""
    samples = f"instance:stepwatch_up_samples:ratio_to_most_rate{w}"
    mean = f"(instance_shape:{STEP}:mean_rate{w} and on (job, instance) {samples} >= {num(complete)})"
    median = f"shape:{STEP}:median_instance_rate{w}"
    out = [
        Recording(samples, f"  count_over_time(up[{w}])\n/ on (job) group_left\n"
                           f"  max by (job) (count_over_time(up[{w}]))",
                  f"each target's scrapes over {w} / the most any target of its job has (1: complete; a gap, "
                  "a paused node agent, reads less)"),
        Recording(median, f"quantile by (job, shape) (0.5, {mean})",
                  f"the median instance's mean seconds per step over {w}, per shape (the fleet's typical instance)"),
        Recording(f"shape:{STEP}:instances_rate{w}", f"count by (job, shape) ({mean})",
                  f"instances that ran steps of the shape over {w} (a median of fewer than three names no outlier)"),
        Recording(f"instance_shape:{STEP}:ratio_to_fleet_median_rate{w}",
                  f"  {mean}\n/ on (job, shape) group_left\n  {median}",
                  f"each instance's mean step time / the median instance's, per shape over {w}; 1 = typical"),
    ]
    if headroom is None:
        return out
    work = f"pool:stepwatch_service_work_seconds:mean_rate{w}"
    worked = (f"  {sum_rate('stepwatch_service_request_duration_seconds_sum', w, 'job, pool')}\n"
              f"- {sum_rate('stepwatch_queue_wait_seconds_sum', w, 'job, pool')}")
    arrivals = (f"{sum_rate('stepwatch_service_requests_total', w, 'job, pool')}\n"
                f"    + on (job, pool) sum by (job, pool) (deriv(stepwatch_queue_depth[{w}]))")
    return [
        *out,
        Recording(work, over_positive(f"(\n{worked}\n)", sum_rate("stepwatch_queue_wait_seconds_count", w,
                                                                      "job, pool"), "job, pool"),
                  f"worker seconds per request of a pool over {w}: request time minus queue wait, per request a "
                  "worker took (what one request costs an instance)"),
        Recording(f"job:stepwatch_service_instances:needed_rate{w}",
                  f"{num(headroom)} * sum by (job) (\n    (\n    {arrivals}\n    )\n  * on (job, pool)\n    {work}\n)",
                  f"instances the pool needs over {w}: (requests answered + queue growth) per second x worker "
                  f"seconds per request x {num(headroom)} (the seeds' capacity formula)"),
    ]


def _gauge_recordings() -> list[Recording]:
    """Ratios of gauges (no window): queue wait against the SLO, rank step time against the fastest."""
    return [
        Recording(f"instance_pool:{WAIT}:slo_ratio", over_positive(f"  {WAIT}", SLO, "job, instance, pool"),
                  "estimated queue wait / the pool's latency SLO, per instance and pool (0.5 = half the SLO)"),
        Recording(f"pool:{WAIT}:max", f"max by (job, pool) ({WAIT})",
                  "worst estimated queue wait of a pool over its instances, in seconds"),
        Recording(f"instance_rank:{RANK_STEP}:ratio_to_fastest",
                  f"  max by (job, instance, rank) ({RANK_STEP})\n/ on (job, instance) group_left\n"
                  f"  min by (job, instance) ({RANK_STEP} > 0)",
                  "each rank's mean step time (last request) / the fastest rank's; 1 = the fastest"),
        Recording(f"instance:{RANK_STEP}:skew_ratio",
                  f"  (max by (job, instance) ({RANK_STEP}) - min by (job, instance) ({RANK_STEP}))\n/\n"
                  f"  min by (job, instance) ({RANK_STEP} > 0)",
                  "(slowest - fastest) / fastest rank step time of the last request, per instance"),
        Recording("job:stepwatch_service_instances:ready", "sum by (job) (stepwatch_service_ready)",
                  "instances of a pool (job) that finished warm-up and serve"),
    ]


def recording_rules(th: Thresholds) -> list[Recording]:
    """Recording rules shared by both profiles (one set per rate window, then the gauge-based ones)."""
    out: list[Recording] = []
    capacity = th.alerts.get("pool_capacity")
    headroom = capacity_headroom(capacity) if capacity is not None else None
    complete = float(th.diagnosis["complete_ratio"])  # a missing key fails here, at generation
    for w in windows(th):
        out += _step_and_cache(w) + _mfu(w) + _ranks_and_errors(w) + _fleet(w, headroom, complete)
    return out + _gauge_recordings()


def recorded_names(th: Thresholds) -> set[str]:
    return {r.record for r in recording_rules(th)}


# ----- alerting rules -------------------------------------------------------------------------

def alert_window(th: Thresholds, spec: AlertSpec, profile: str) -> str | None:
    """The window an alert looks back over in a profile, or None for gauge alerts."""
    if profile in spec.window:
        return spec.window[profile]
    d = defs.ALERTS.get(spec.key)
    return th.profiles[profile].rate_window if d is not None and d.rate_based else None


def alert_labels(spec: AlertSpec, profile: str) -> dict[str, str]:
    """Static labels of the alert (series labels come on top)."""
    return {"severity": spec.severity, **spec.labels, "profile": profile}


def alert_annotations(th: Thresholds, spec: AlertSpec, profile: str) -> dict[str, str]:
    values = text_values(th, spec, profile)
    return {
        "summary": fill(spec.summary, values),
        "description": fill(spec.description, values),
        "runbook_url": th.runbook_url(spec.key),
        "panel": spec.panel,
    }


def alerting_rule(th: Thresholds, spec: AlertSpec, profile: str) -> dict[str, Any]:
    """One alert's rule; its description may use only the labels its AlertDef says its series carry."""
    d = defs.alert_def(spec)
    ann = alert_annotations(th, spec, profile)
    try:
        gotemplate.render(ann["description"])
    except gotemplate.TemplateError as e:
        raise ThresholdsError(f"alerts.{spec.key}.description: {e}") from None
    missing = gotemplate.labels_used(ann["description"]) - {"job", *d.labels}
    if missing:
        raise ThresholdsError(f"alerts.{spec.key}.description: the alert has no label(s) {', '.join(sorted(missing))}")
    rule: dict[str, Any] = {"alert": spec.name, "expr": tidy(d.expr(th, spec, profile))}
    if parse_duration(spec.for_[profile]) > 0:
        rule["for"] = spec.for_[profile]
    rule["labels"] = alert_labels(spec, profile)
    rule["annotations"] = ann
    return rule


def rule_groups(th: Thresholds, profile: str) -> list[dict[str, Any]]:
    if profile not in PROFILES:
        raise ValueError(f"profile {profile!r}: choose one of {', '.join(PROFILES)}")
    interval = th.profiles[profile].evaluation_interval
    return [
        {"name": RECORDING_GROUP, "interval": interval,
         "rules": [{"record": r.record, "expr": tidy(r.expr)} for r in recording_rules(th)]},
        {"name": ALERTING_GROUP, "interval": interval,
         "rules": [alerting_rule(th, spec, profile) for spec, _ in defs.defined(th)]},
    ]



# ----- YAML text ------------------------------------------------------------------------------

class _Dumper(yaml.SafeDumper):
    """Block scalars for multi-line strings; keys in the order given."""


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    if "\n" in data:
        return dumper.represent_scalar("tag:yaml.org,2002:str", data + "\n", style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", data)


_Dumper.add_representer(str, _str)


def dump(data: Any, indent: int = 0) -> str:
    text = yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100_000,
                     allow_unicode=True)
    if indent:
        text = "".join((" " * indent + line) if line.strip() else line for line in text.splitlines(True))
    return text


def header(title: str, lines: list[str] | None = None) -> str:
    out = [f"# {title}", f"# GENERATED by `{GENERATED_BY}` from stepwatch/thresholds.yaml: do not edit by hand.",
           f"# CI runs `{GENERATED_BY} --check` to prove this file is current."]
    out += [f"# {line}" if line else "#" for line in lines or []]
    return "\n".join(out) + "\n"


def rules_file(th: Thresholds, profile: str) -> str:
    """The rule file of one profile, with the reasoning behind each `for:` as comments."""
    p = th.profiles[profile]
    lines = [
        "",
        f"Profile {profile}: scrape every {p.scrape_interval}, evaluate every {p.evaluation_interval}; alerts read "
        f"the {p.rate_window} recordings.",
    ]
    if profile == "production":
        lines.append("`for:` is long enough not to page on one slow request, one probe or one lost scrape;")
        lines.append("the reason for each value is the comment above the alert.")
    else:
        lines.append("Every drill fault is detected within 60 s: rate windows of 1m, `for:` of at most 30 s.")
    lines += ["", "Severity:"] + [f"  {k:<9} {v}" for k, v in SEVERITY_MEANING.items()]
    lines += ["", "Recording rules are level:metric:operations; `job` is kept at every level."]
    parts = [header(f"stepwatch {profile} rules", lines), "groups:\n"]
    groups = rule_groups(th, profile)
    rec = {r.record: r for r in recording_rules(th)}
    for g in groups:
        parts.append(f"  - name: {g['name']}\n    interval: {g['interval']}\n    rules:\n")
        for rule in g["rules"]:
            if "record" in rule:
                comment = rec[rule["record"]].meaning
            else:
                spec = th.by_name(rule["alert"])
                comment = (f"{spec.severity}; for {spec.for_[profile]}"
                           + (f" (production: {spec.for_reason})" if profile == "production" else ""))
            parts += [f"      # {line}\n" for line in textwrap.wrap(comment, 100)]
            parts.append(dump([rule], indent=6))
    return "".join(parts)


def prometheus_rule(th: Thresholds, name: str = "stepwatch", namespace: str | None = None) -> str:
    """The production rules as a prometheus-operator PrometheusRule."""
    meta: dict[str, Any] = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    meta["labels"] = {"app.kubernetes.io/name": "stepwatch", "app.kubernetes.io/component": "alerting",
                      "role": "alert-rules"}
    doc = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": meta,
           "spec": {"groups": rule_groups(th, "production")}}
    return header("stepwatch PrometheusRule (production profile)",
                  ["", "kubectl apply -f alerts/k8s/prometheusrule.yaml; the Prometheus must select the label",
                   "role: alert-rules (or edit ruleSelector)."]) + dump(doc)

