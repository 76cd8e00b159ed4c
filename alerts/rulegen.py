"""Prometheus recording and alerting rules, built from the thresholds source.

Recording rules follow ``level:metric:operations``: the level lists the labels the
output keeps besides ``job`` (always kept: it names the deployment), the metric is the
catalog name (``_total`` dropped after rate()), the operations say what was done.
Ratios are sums over sums, never averages of ratios.  Every rate window of every
profile is recorded in both rule files, so dashboards and triage use one set of names.

Alerting rules read the recorded series of their profile's rate window; baselines come
from the ``stepwatch_baseline_*`` gauges (never ``offset``).  Alerts on events (OOMs,
serving compiles, NaN images, hook errors, probe failures) count them over the alert's
window and also catch a counter that is *born* at 1 (a new label set, e.g. the first OOM
of a shape), which ``increase()`` alone misses.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from stepwatch.alerts import gotemplate
from stepwatch.alerts.thresholds import PROFILES, AlertSpec, Thresholds, ThresholdsError, parse_duration
from stepwatch.catalog import MEMORY_RATIO_BUCKETS

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


def num(x: float) -> str:
    """A threshold as PromQL/prose text: 1.2, 0.3, 0, 1e+15."""
    return format(float(x), ".12g")


def windows(th: Thresholds) -> list[str]:
    """Every profile's rate window, shortest first."""
    return sorted({p.rate_window for p in th.profiles.values()}, key=parse_duration)


@dataclass(frozen=True)
class Recording:
    record: str
    expr: str
    meaning: str  # one line for people: what the number is


def _sum_over_sum(by: str, num_sel: str, den_sel: str, w: str, zero_fill: bool = False) -> str:
    top = f"sum by ({by}) (rate({num_sel}[{w}]))"
    bottom = f"sum by ({by}) (rate({den_sel}[{w}]))"
    if zero_fill:  # a ratio with no numerator series yet is 0, not "no data"
        top = f"(\n    {top}\n  or\n    {bottom} * 0\n  )"
    return f"  {top}\n/\n  {bottom}"


def recording_rules(th: Thresholds) -> list[Recording]:
    """Recording rules shared by both profiles (one set per rate window, then the gauge-based ones)."""
    out: list[Recording] = []
    step, sum_, cnt = ("stepwatch_pipeline_step_duration_seconds", "stepwatch_pipeline_step_duration_seconds_sum",
                       "stepwatch_pipeline_step_duration_seconds_count")
    hits, dec = 'stepwatch_cache_decisions_total{decision="hit"}', "stepwatch_cache_decisions_total"
    peak = "max by (job, instance) (stepwatch_device_peak_flops_per_second > 0)"
    for w in windows(th):
        for level, by in (("instance_shape", "job, instance, shape"), ("shape", "job, shape")):
            where = "per instance and shape" if level == "instance_shape" else "per shape over all instances"
            out.append(Recording(
                f"{level}:{step}:mean_rate{w}", _sum_over_sum(by, sum_, cnt, w),
                f"mean seconds per denoising step over {w}, {where} (sum of step time / number of steps)"))
            out.append(Recording(
                f"{level}:stepwatch_cache_decisions:hit_ratio_rate{w}", _sum_over_sum(by, hits, dec, w, True),
                f"cross-step cache hits / all cache decisions over {w}, {where} (0 when the cache never hit)"))
        out.append(Recording(
            f"instance_shape:stepwatch_ledger_flops:mfu_rate{w}",
            f"  sum by (job, instance, shape) (rate(stepwatch_ledger_flops_total[{w}]))\n"
            f"/\n  sum by (job, instance, shape) (rate({sum_}[{w}]))\n"
            f"/ on (job, instance) group_left\n  {peak}",
            f"model FLOPs utilization over {w} per instance and shape: ledger FLOPs / denoising seconds / "
            "the device's dense peak FLOP/s (absent when the peak is unknown)"))
        out.append(Recording(
            f"shape:stepwatch_ledger_flops:mfu_rate{w}",
            f"  sum by (job, shape) (rate(stepwatch_ledger_flops_total[{w}]))\n"
            f"/\n  sum by (job, shape) (\n      rate({sum_}[{w}])\n    * on (job, instance) group_left\n"
            f"      {peak}\n  )",
            f"fleet MFU over {w} per shape: all ledger FLOPs / all (denoising seconds x device peak)"))
        busy = (f"sum by (job, instance, rank) (rate(stepwatch_rank_busy_seconds_total[{w}]))\n"
                f"  /\n  sum by (job, instance, rank) (rate(stepwatch_rank_steps_total[{w}]))")
        out.append(Recording(
            f"instance_rank:stepwatch_rank_busy_seconds:mean_rate{w}", f"  {busy}",
            f"each sequence-parallel rank's mean busy seconds per step over {w} (step time minus collective "
            "waits; the straggler works longest)"))
        out.append(Recording(
            f"instance_rank:stepwatch_rank_busy_seconds:ratio_to_fastest_rate{w}",
            f"  (\n    {busy.replace(chr(10), chr(10) + '  ')}\n  )\n/ on (job, instance) group_left\n"
            f"  min by (job, instance) (\n    {busy.replace(chr(10), chr(10) + '  ')}\n  )",
            f"each rank's busy seconds per step / the fastest rank's, over {w}; 1 = the fastest"))
        out.append(Recording(
            f"pool:stepwatch_service_requests:error_ratio_rate{w}",
            _sum_over_sum("job, pool", 'stepwatch_service_requests_total{code=~"5.."}',
                          "stepwatch_service_requests_total", w, True),
            f"generation requests answered 5xx / all requests over {w}, per pool (0 when none failed)"))
    wait, slo = "stepwatch_queue_estimated_wait_seconds", "stepwatch_queue_slo_seconds"
    rank = "stepwatch_rank_step_duration_seconds"
    out += [
        Recording(f"instance_pool:{wait}:slo_ratio",
                  f"  {wait}\n/ on (job, instance, pool)\n  ({slo} > 0)",
                  "estimated queue wait / the pool's latency SLO, per instance and pool (0.5 = half the SLO)"),
        Recording(f"pool:{wait}:max", f"max by (job, pool) ({wait})",
                  "worst estimated queue wait of a pool over its instances, in seconds"),
        Recording(f"instance_rank:{rank}:ratio_to_fastest",
                  f"  max by (job, instance, rank) ({rank})\n/ on (job, instance) group_left\n"
                  f"  min by (job, instance) ({rank} > 0)",
                  "each rank's mean step time (last request) / the fastest rank's; 1 = the fastest"),
        Recording(f"instance:{rank}:skew_ratio",
                  f"  (max by (job, instance) ({rank}) - min by (job, instance) ({rank}))\n/\n"
                  f"  min by (job, instance) ({rank} > 0)",
                  "(slowest - fastest) / fastest rank step time of the last request, per instance"),
    ]
    return out


def recorded_names(th: Thresholds) -> set[str]:
    return {r.record for r in recording_rules(th)}


# ----- alert expressions ----------------------------------------------------------------------

def _events(selector: str, window: str, threshold: float) -> str:
    """Counter increased in the window, or a new label set appeared (born at >= 1) in it.

    The second arm needs the job to have been scraped one window ago, so a restarted
    Prometheus (no history) does not mistake every old counter for a new one.
    """
    t = num(threshold)
    return (f"  increase({selector}[{window}]) > {t}\n"
            f"or\n"
            f"  (\n"
            f"      ({selector} > {t} unless {selector} offset {window})\n"
            f"    and on (job)\n"
            f"      count by (job) (up offset {window})\n"
            f"  )")


def _need_window(spec: AlertSpec, profile: str) -> str:
    if profile not in spec.window:
        raise ThresholdsError(f"alerts.{spec.key}.window: missing (this alert counts events over a window)")
    return spec.window[profile]


def _rate_window(th: Thresholds, profile: str) -> str:
    return th.profiles[profile].rate_window


def _step_time(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    w = _rate_window(th, profile)
    return (f"  instance_shape:stepwatch_pipeline_step_duration_seconds:mean_rate{w}\n"
            f"/ on (job, instance, shape)\n"
            f"  (stepwatch_baseline_step_duration_seconds > 0)\n"
            f"> {num(spec.threshold)}")


def _hit_rate(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    w = _rate_window(th, profile)
    ratio = (f"(\n    instance_shape:stepwatch_cache_decisions:hit_ratio_rate{w}\n"
             f"  / on (job, instance, shape)\n    stepwatch_baseline_cache_hit_ratio\n)")
    return f"{ratio} > {num(1 + spec.threshold)}\nor\n{ratio} < {num(1 - spec.threshold)}"


def _queue(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return f"instance_pool:stepwatch_queue_estimated_wait_seconds:slo_ratio > {num(spec.threshold)}"


def _memory(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    if spec.threshold not in MEMORY_RATIO_BUCKETS:
        raise ThresholdsError(f"alerts.{spec.key}.threshold: {num(spec.threshold)} is not a bucket boundary of "
                              f"stepwatch_memory_peak_ratio ({', '.join(num(b) for b in MEMORY_RATIO_BUCKETS)}); "
                              "the alert counts requests above that bucket")
    from prometheus_client.utils import floatToGoString

    w, le = _need_window(spec, profile), floatToGoString(spec.threshold)
    return ("label_replace(\n"
            f"    sum by (job, instance, device) (increase(stepwatch_memory_peak_ratio_count[{w}]))\n"
            f"  - sum by (job, instance, device) (increase(stepwatch_memory_peak_ratio_bucket{{le=\"{le}\"}}[{w}])),\n"
            '  "gpu", "$1", "device", "cuda:([0-9]+)"\n'
            ") > 0")


def _quality(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return ('  stepwatch_quality_psnr_decibels{quantile="p10"}\n'
            "< on (job, instance, probe_set) group_left ()\n"
            f"  (stepwatch_quality_gate_decibels - {num(spec.threshold)})")


def _recompile(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return _events('stepwatch_compile_total{phase="serving"}', _need_window(spec, profile), spec.threshold)


def _rank(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    w = _rate_window(th, profile)
    return f"instance_rank:stepwatch_rank_busy_seconds:ratio_to_fastest_rate{w} > {num(1 + spec.threshold)}"


def _oom(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return _events("stepwatch_oom_total", _need_window(spec, profile), spec.threshold)


def _errors(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    w = _rate_window(th, profile)
    floor = spec.extra.get("min_requests", 0)
    ratio = f"pool:stepwatch_service_requests:error_ratio_rate{w} > {num(spec.threshold)}"
    if not floor:
        return ratio
    return (f"  {ratio}\nand on (job, pool)\n"
            f"  sum by (job, pool) (increase(stepwatch_service_requests_total[{w}])) >= {num(float(floor))}")


def _nonfinite(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return _events("stepwatch_service_images_nonfinite_total", _need_window(spec, profile), spec.threshold)


def _probe(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    missed = spec.extra.get("missed_probes")
    if isinstance(missed, bool) or not isinstance(missed, int) or missed < 1:
        raise ThresholdsError(f"alerts.{spec.key}.missed_probes: {missed!r} is not a whole number >= 1")
    return (_events("stepwatch_quality_probe_failures_total", _need_window(spec, profile), spec.threshold)
            + "\nor\n  (\n"
            "      time() - (stepwatch_quality_last_success_timestamp_seconds > 0)\n"
            "    > on (job, instance, probe_set)\n"
            f"      {missed} * stepwatch_quality_probe_interval_seconds\n  )")


def _stale(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return "stepwatch_quality_baseline_stale == 1"


def _down(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return f'up{{job=~"{th.job_regex}"}} == 0'


def _hook_errors(th: Thresholds, spec: AlertSpec, profile: str) -> str:
    return _events("stepwatch_exporter_errors_total", _need_window(spec, profile), spec.threshold)


Expr = Callable[[Thresholds, AlertSpec, str], str]
ALERT_EXPRS: dict[str, Expr] = {
    "step_time_regression": _step_time,
    "cache_hit_rate_shift": _hit_rate,
    "queue_wait": _queue,
    "memory_pressure": _memory,
    "quality_drop": _quality,
    "recompile": _recompile,
    "rank_skew": _rank,
    "oom": _oom,
    "error_ratio": _errors,
    "nonfinite_outputs": _nonfinite,
    "probe_failing": _probe,
    "baseline_stale": _stale,
    "target_down": _down,
    "exporter_errors": _hook_errors,
}

# Labels each alert's series carries (besides job and target labels), for the runbook checks'
# placeholders and the description templates.
ALERT_LABELS: dict[str, tuple[str, ...]] = {
    "step_time_regression": ("instance", "shape"),
    "cache_hit_rate_shift": ("instance", "shape"),
    "queue_wait": ("instance", "pool"),
    "memory_pressure": ("instance", "device", "gpu"),
    "quality_drop": ("instance", "probe_set", "instance_id", "quantile"),
    "recompile": ("instance", "shape", "phase"),
    "rank_skew": ("instance", "rank"),
    "oom": ("instance", "shape", "stage"),
    "error_ratio": ("pool",),
    "nonfinite_outputs": ("instance", "pool"),
    "probe_failing": ("instance", "probe_set", "reason"),
    "baseline_stale": ("instance", "probe_set"),
    "target_down": ("instance",),
    "exporter_errors": ("instance", "component"),
}


# Alerts that read the profile's rate window (the others read gauges, or count events over their own window).
RATE_ALERTS = ("step_time_regression", "cache_hit_rate_shift", "error_ratio", "rank_skew")


def alert_window(th: Thresholds, spec: AlertSpec, profile: str) -> str | None:
    """The window an alert looks back over in a profile, or None for gauge alerts."""
    if profile in spec.window:
        return spec.window[profile]
    return th.profiles[profile].rate_window if spec.key in RATE_ALERTS else None


def text_values(th: Thresholds, spec: AlertSpec, profile: str) -> dict[str, str]:
    """Values of the ${...} placeholders in summaries and descriptions."""
    return {
        "threshold": num(spec.threshold),
        "threshold_pct": num(round(spec.threshold * 100, 6)),
        "upper": num(round(1 + spec.threshold, 9)),
        "lower": num(round(1 - spec.threshold, 9)),
        "for": spec.for_[profile],
        "window": alert_window(th, spec, profile) or th.profiles[profile].rate_window,
    }


def fill(text: str, values: dict[str, str]) -> str:
    for k, v in values.items():
        text = text.replace("${" + k + "}", v)
    return text


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
    expr_fn = ALERT_EXPRS.get(spec.key)
    if expr_fn is None:
        raise ThresholdsError(f"alerts.{spec.key}: the generator has no rule expression for this alert "
                              f"(known: {', '.join(ALERT_EXPRS)})")
    ann = alert_annotations(th, spec, profile)
    try:
        gotemplate.render(ann["description"])
    except gotemplate.TemplateError as e:
        raise ThresholdsError(f"alerts.{spec.key}.description: {e}") from None
    missing = gotemplate.labels_used(ann["description"]) - {"job", *ALERT_LABELS[spec.key]}
    if missing:
        raise ThresholdsError(f"alerts.{spec.key}.description: the alert has no label(s) {', '.join(sorted(missing))}")
    rule: dict[str, Any] = {"alert": spec.name, "expr": tidy(expr_fn(th, spec, profile))}
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
         "rules": [alerting_rule(th, spec, profile) for spec in th.alerts.values()]},
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
    out = [f"# {title}", f"# GENERATED by `{GENERATED_BY}` from alerts/thresholds.yaml: do not edit by hand.",
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

