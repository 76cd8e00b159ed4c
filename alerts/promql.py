"""stepwatch's PromQL vocabulary, and reading series names back out of an expression.

Every query stepwatch writes (recording and alerting rules, dashboard panels, the board's
alert summaries, the drills' checks) is built from the words below, so one idea (the mean
step time, a zero-filled ratio, "events including counters born at 1") has one spelling.
A window is a Prometheus duration (``1m``) or a Grafana variable (``$__rate_interval``);
``by`` is a label list (``"job, shape"``), or ``""`` for one total.

The second half reads series names out of an expression (no full parser: enough to check
names against the catalog).  Syntax errors are promtool's job (``promtool check rules``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from stepwatch.catalog import FOREIGN_SERIES, METRICS, PROMETHEUS_SERIES

if TYPE_CHECKING:
    from stepwatch.thresholds import AlertSpec, Thresholds

STEP_TIME = "stepwatch_pipeline_step_duration_seconds"
CACHE_DECISIONS = "stepwatch_cache_decisions_total"


def num(x: float) -> str:
    """A number as PromQL / prose text: 1.2, 0.3, 0, 1e+15 (never 1.2000000000000002)."""
    return format(float(x), ".12g")


def pct(x: float) -> str:
    """A ratio as a percentage for titles: 0.9 -> 90%."""
    return num(round(x * 100, 6)) + "%"


def sel(metric: str, *matchers: str) -> str:
    """``metric{m1, m2}``, or the bare name without matchers."""
    return f"{metric}{{{', '.join(matchers)}}}" if matchers else metric


def _sum(by: str, inner: str) -> str:
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def sum_rate(selector: str, window: str, by: str = "") -> str:
    """Per-second rate of a counter, summed over ``by``."""
    return _sum(by, f"rate({selector}[{window}])")


def sum_increase(selector: str, window: str, by: str = "") -> str:
    """Increase of a counter over the window, summed over ``by``."""
    return _sum(by, f"increase({selector}[{window}])")


def ratio_of_rates(num_sel: str, den_sel: str, window: str, by: str = "", *, zero_fill: bool = False) -> str:
    """sum(rate(num)) / sum(rate(den)) per ``by``: a mean over the window, never an average of ratios.

    ``zero_fill``: a ratio whose numerator has no series yet (no hit, no 5xx so far) reads 0,
    not "no data", as long as the denominator exists.
    """
    top, bottom = sum_rate(num_sel, window, by), sum_rate(den_sel, window, by)
    if zero_fill:
        top = f"(\n    {top}\n  or\n    {bottom} * 0\n  )"
    return f"  {top}\n/\n  {bottom}"


def mean_step_time(window: str, by: str = "", *matchers: str) -> str:
    """Mean seconds per denoising step: step time summed / steps counted."""
    return ratio_of_rates(sel(f"{STEP_TIME}_sum", *matchers), sel(f"{STEP_TIME}_count", *matchers), window, by)


def cache_hit_ratio(window: str, by: str = "", *matchers: str) -> str:
    """Cross-step cache hits / all cache decisions, 0 when the cache never hit."""
    return ratio_of_rates(sel(CACHE_DECISIONS, *matchers, 'decision="hit"'), sel(CACHE_DECISIONS, *matchers),
                          window, by, zero_fill=True)


def events(selector: str, window: str, threshold: float = 0.0, by: str | None = None) -> str:
    """The counter increased in the window, or a new label set appeared (born at >= 1) in it.

    Counters like ``stepwatch_oom_total{shape,stage}`` are born at 1 on their first event,
    which ``increase()`` alone never shows.  The second arm needs the job to have been
    scraped one window ago, so a restarted Prometheus (no history) does not mistake every
    old counter for a new one, and the label set to have had no sample in the whole window
    before that (not only at its end), so a counter that was missing from a few scrapes (a
    frozen worker's metrics, back after SIGCONT) is not taken for a new one.  With ``by``,
    both arms are summed to those labels (panels); without, each series stands alone (alerts
    keep every label for routing and triage).
    """
    t = num(threshold)
    before = f"last_over_time({selector}[{window}] offset {window})"
    if by is None:
        grew = f"increase({selector}[{window}]) > {t}"
        born = f"({selector} > {t} unless {before})"
    else:
        grew = f"{sum_increase(selector, window, by)} > {t}"
        born = _sum(by, f"{selector} unless {before}")
    return (f"  {grew}\n"
            f"or\n"
            f"  (\n"
            f"      {born}\n"
            f"    and on (job)\n"
            f"      count by (job) (up offset {window})\n"
            f"  )")


def quantile(q: float, bucket_sel: str, window: str, by: str = "") -> str:
    """The q-quantile of a histogram over the window, per ``by`` (``le`` is added)."""
    return f"histogram_quantile({num(q)}, sum by ({by + ', ' if by else ''}le) (rate({bucket_sel}[{window}])))"


def above_bucket(histogram: str, le: str, window: str, by: str, *matchers: str) -> str:
    """Observations above bucket bound ``le`` in the window: count - bucket{le}."""
    count = sum_increase(sel(f"{histogram}_count", *matchers), window, by)
    below = sum_increase(sel(f"{histogram}_bucket", *matchers, f'le="{le}"'), window, by)
    return f"  {count}\n-\n  {below}"


def agg(op: str, selector: str, by: str = "") -> str:
    """An instant aggregation (``min``, ``max``, ``sum``, ...) of a selector, per ``by``: a gauge's one number."""
    return f"{op} by ({by}) ({selector})" if by else f"{op}({selector})"


# ----- alert text: the placeholders of summaries and descriptions -----------------------------

def text_values(th: Thresholds, spec: AlertSpec, profile: str) -> dict[str, str]:
    """Values of the ${...} placeholders in an alert's summary and description."""
    from stepwatch.thresholds import capacity_headroom  # thresholds imports this module

    return {
        "threshold": num(spec.threshold),
        "threshold_pct": num(round(spec.threshold * 100, 6)),
        "upper": num(round(1 + spec.threshold, 9)),
        "lower": num(round(1 - spec.threshold, 9)),
        "for": spec.for_[profile],
        "window": spec.window.get(profile, th.profiles[profile].rate_window),
        # the capacity formula's factor (alerts.pool_capacity.headroom); only that alert's text uses it
        "headroom": num(capacity_headroom(spec)),
    }


def fill(text: str, values: Mapping[str, str]) -> str:
    for k, v in values.items():
        text = text.replace("${" + k + "}", v)
    return text


def summary(th: Thresholds, spec: AlertSpec, profile: str = "production") -> str:
    """The alert's summary as the rules and the board both show it."""
    return fill(spec.summary, text_values(th, spec, profile))


# ----- reading names back ---------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_OFFSET = re.compile(r"\boffset\s+-?[0-9a-z]+")
_NUMBER = re.compile(r"(?<![A-Za-z_:0-9])(?:0x[0-9a-fA-F]+|[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
KEYWORDS = {"and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left", "group_right", "offset",
            "inf", "nan", "Inf", "NaN", "atan2"}


def metric_names(expr: str) -> set[str]:
    """Series names an expression selects (``foo{...}``, ``foo[5m]``, bare ``foo``)."""
    text = _STRING.sub('""', expr)
    text = _BRACES.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _OFFSET.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        word = m.group(0)
        rest = text[m.end():].lstrip()
        if word in KEYWORDS or rest.startswith("("):
            continue
        names.add(word)
    return names


_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^{}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")


def selector_labels(expr: str) -> dict[str, set[str]]:
    """{series name: label names its matchers use} for every ``name{...}`` selector."""
    out: dict[str, set[str]] = {}
    for m in _SELECTOR.finditer(_STRING.sub(lambda s: s.group(0).replace("{", "(").replace("}", ")"), expr)):
        out.setdefault(m.group(1), set()).update(_MATCHER.findall(_STRING.sub('""', m.group(2))))
    return out


def known_labels(name: str) -> set[str] | None:
    """Label names a series can carry (None: any, e.g. an info metric's free labels)."""
    base = {"job", "instance"}
    if name in PROMETHEUS_SERIES:
        extra = PROMETHEUS_SERIES[name]
        return None if extra is None else base | extra
    if name in FOREIGN_SERIES:
        return base | FOREIGN_SERIES[name]
    if ":" in name:  # a recording rule: level:metric:operations, job always kept
        return {"job", *name.split(":", 1)[0].split("_")}
    for m in METRICS:
        if name in m.series_names():
            if m.kind == "info":
                return None
            return base | set(m.labels) | ({"le"} if name.endswith("_bucket") else set())
    return set()


# ----- more words (appended; the ones above keep their exact output) --------------------------

DEVICE_PEAK_FLOPS = "stepwatch_device_peak_flops_per_second"


def device_peak_flops(*matchers: str) -> str:
    """The device's dense peak FLOP/s per instance; absent where it is unknown (0 on a CPU), never 0."""
    return f"max by (job, instance) ({sel(DEVICE_PEAK_FLOPS, *matchers)} > 0)"


def ratio_to_fastest(per_member: str, group: str = "job, instance") -> str:
    """Each member's value (a rank's busy seconds per step) / the smallest positive one of its group.

    1 is the fastest; every step waits for the slowest, so the largest ratio is the skew.  A zero
    (a rank with no step yet) is left out of the minimum rather than making every ratio +Inf.
    """
    return (f"(\n{per_member}\n)\n/ on ({group}) group_left\n"
            f"  min by ({group}) (\n(\n{per_member}\n) > 0\n)")


def firing(alertname_regex: str = "") -> str:
    """The firing alerts (``ALERTS``), those whose name matches the regex when one is given."""
    return sel("ALERTS", 'alertstate="firing"', *([f'alertname=~"{alertname_regex}"'] if alertname_regex else []))


def over_positive(numerator: str, divisor: str, on: str) -> str:
    """``numerator / on (on) (divisor > 0)``: a share of a reference (baseline, SLO) that is set.

    A reference of 0 means "not known yet", so it drops the series instead of dividing by zero.
    The numerator is written as given (wrap a binary expression in parentheses).
    """
    return f"{numerator}\n/ on ({on})\n  ({divisor} > 0)"


def latest(selector: str, window: str) -> str:
    """Each series' last sample within ``window`` (a gauge, a counter or a recording rule alike)."""
    return f"last_over_time({selector}[{window}])"


def since(timestamp_sel: str) -> str:
    """Seconds since a unix-timestamp gauge; absent while the gauge is 0 (it never happened)."""
    return f"time() - ({timestamp_sel} > 0)"


def floored_multiple(expected_sel: str, factor: float, floor: float) -> str:
    """``factor`` x ``expected``, never below ``floor``: a limit from a prediction too small to trust alone."""
    return f"clamp_min({expected_sel} * {num(factor)}, {num(floor)})"


def past_limit(value_sel: str, expected_sel: str, factor: float, floor: float) -> str:
    """``value`` where it passed ``floored_multiple`` of ``expected`` (same label sets): a duration against
    its prediction."""
    return f"{value_sel} > {floored_multiple(expected_sel, factor, floor)}"


def stage_share(window: str, stages: str, by: str = "", *matchers: str) -> str:
    """Seconds in the stages matching the regex ``stages`` / request seconds, over the window, per ``by``.

    The text encoder and the VAE run once per request whatever the steps, so their share is what a
    few-step model changes most (seeds: 2.6% of a 28-step FLUX.1-dev request, 15.6% of a 4-step one)."""
    stage = sum_rate(sel("stepwatch_pipeline_stage_duration_seconds_sum", *matchers, f'stage=~"{stages}"'), window, by)
    request = sum_rate(sel("stepwatch_pipeline_request_duration_seconds_sum", *matchers), window, by)
    return f"  {stage}\n/\n  {request}"
