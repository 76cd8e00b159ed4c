"""Dashboards as code: generated JSON is current, passes the lint, follows the thresholds source,
and (heavy) every panel query returns data from a real Prometheus scraping the practice service."""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from stepwatch.alerts import promql
from stepwatch.dashboards import cli_dashboards, cli_snapshot, generate, lint, model, snapshot
from stepwatch.thresholds import Thresholds, default_path, load, parse

DASHBOARDS = Path(generate.__file__).resolve().parent


@pytest.fixture(scope="module")
def th() -> Thresholds:
    return load()


@pytest.fixture(scope="module")
def overview(th: Thresholds) -> dict[str, Any]:
    return generate.dashboards(th)[generate.OVERVIEW_FILE]


def _args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"check": False, "out": None, "thresholds": None, **kw})


# ----- generation -------------------------------------------------------------------------------

def test_committed_json_is_what_the_generator_writes(th: Thresholds) -> None:
    texts = generate.render(th)
    assert set(texts) == {p.name for p in model.dashboard_files(DASHBOARDS)} == {"stepwatch-overview.json"}
    for name, text in texts.items():
        assert (DASHBOARDS / name).read_text() == text, f"{name} is stale: run `stepwatch dashboards generate`"
    assert cli_dashboards.run(_args(check=True)) == 0


def test_check_names_the_file_that_differs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_dashboards.run(_args(out=tmp_path)) == 0
    path = tmp_path / generate.OVERVIEW_FILE
    assert json.loads(path.read_text())["uid"] == generate.OVERVIEW_UID
    assert cli_dashboards.run(_args(out=tmp_path, check=True)) == 0
    path.write_text(path.read_text().replace("Queue depth", "Queue depht"))
    capsys.readouterr()
    assert cli_dashboards.run(_args(out=tmp_path, check=True)) == 1
    err = capsys.readouterr().err
    assert f"{path}: differs from the generator" in err
    path.unlink()
    assert cli_dashboards.run(_args(out=tmp_path, check=True)) == 1
    assert f"{path}: missing" in capsys.readouterr().err
    assert not path.exists(), "--check must not write"


def test_output_is_deterministic_with_stable_ids(th: Thresholds, overview: dict[str, Any]) -> None:
    assert generate.render(th) == generate.render(load())
    text = generate.render(th)[generate.OVERVIEW_FILE]
    assert json.dumps(json.loads(text), sort_keys=True, indent=2, ensure_ascii=False) + "\n" == text
    ids = [p["id"] for p in model.panels(overview, rows=True)]
    assert ids == list(range(1, len(ids) + 1)), "ids in layout order, 1..n"
    assert overview["uid"] == "stepwatch-overview" and "id" not in overview and "version" not in overview
    for key in ("created", "updated", "iteration"):
        assert key not in text


def test_cli_registration_and_light_import() -> None:
    from stepwatch import cli

    argv = ["dashboards", "generate", "--check"]
    args = cli.build_parser(argv).parse_args(argv)
    assert args.check and args._run is cli_dashboards.run
    argv = ["snapshot", "--panels", "OOMs by stage and shape", "Queue depth, by pool", "--from", "-10m", "--to", "now",
            "--prometheus", "http://x:9090", "--out", "o", "--var", "pool=small"]
    args = cli.build_parser(argv).parse_args(argv)
    assert args._run is cli_snapshot.run and args.panels == ["OOMs by stage and shape", "Queue depth, by pool"]
    assert args.start == "-10m" and args.var == ["pool=small"]
    code = ("import sys, stepwatch.dashboards.generate, stepwatch.dashboards.snapshot, stepwatch.dashboards.lint,"
            " stepwatch.dashboards.cli_dashboards, stepwatch.dashboards.cli_snapshot;"
            "heavy = [m for m in ('grafana_foundation_sdk', 'matplotlib', 'numpy') if m in sys.modules];"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ----- content ----------------------------------------------------------------------------------

# An alert whose panel sits with another subsystem's rows, and where (asserted exactly, so it stays true).
PANEL_ELSEWHERE = {"nonfinite_outputs": "quality",  # a service alert about the images: next to the PSNR panels
                   "stream_drift": "pipeline"}  # the streaming row holds the whole stream, its drift curve included


def test_rows_follow_the_subsystems_and_hold_their_alerts_panels(th: Thresholds, overview: dict[str, Any]) -> None:
    from stepwatch.dashboards.board import Board
    from stepwatch.dashboards.overview import ROWS
    from stepwatch.thresholds import SUBSYSTEMS

    assert tuple(ROWS) == SUBSYSTEMS == ("service", "pipeline", "quality", "monitoring")
    titles: dict[str, set[str]] = {}
    for subsystem, rows in ROWS.items():
        b = Board(th)
        for row in rows:
            row(b)
        titles[subsystem] = {item.build().title for kind, item in b.items if kind == "panel"}
    rows = [p["title"] for p in model.panels(overview, rows=True) if p["type"] == "row"]
    assert rows[0] == "Alerts" and len(rows) == 1 + sum(len(r) for r in ROWS.values())
    for key, spec in th.alerts.items():
        where = PANEL_ELSEWHERE.get(key, spec.labels["subsystem"])
        assert spec.panel in titles[where], f"{spec.name}: panel {spec.panel!r} is not in a {where} row"
    assert all(th.alert(k).labels["subsystem"] != where for k, where in PANEL_ELSEWHERE.items())


def test_generated_dashboard_passes_the_lint(th: Thresholds, overview: dict[str, Any]) -> None:
    assert lint.lint(overview, th) == []
    for path in model.dashboard_files(DASHBOARDS):
        assert lint.lint(model.load(path), th) == [], path


def test_every_alert_has_its_panel_with_a_runbook_link(th: Thresholds, overview: dict[str, Any]) -> None:
    for spec in th.alerts.values():
        matches = [p for p in model.panels(overview) if p["title"] == spec.panel]
        assert len(matches) == 1, spec.panel
        url = f"{th.runbook_base_url}/{spec.runbook_file}#{spec.runbook_anchor}"
        links = matches[0]["links"]
        assert url in [link["url"] for link in links]
        assert any(link["title"] == f"Runbook: {spec.name}" and link["targetBlank"] for link in links)
        assert spec.name in matches[0]["description"]
        assert model.linked_alerts(matches[0], th)[0] == spec.name
    # Companion panels link too, and no panel links a URL that is not a runbook of an alert.
    assert model.linked_alerts(model.panel(overview, "Per-step time / baseline, by shape"), th) == \
        ["StepwatchStepTimeRegression"]
    runbooks = {th.runbook_url(k) for k in th.alerts}
    for p in model.panels(overview):
        assert set(model.runbook_links(p)) <= runbooks, p["title"]


def test_variables_units_and_rate_interval(overview: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in model.variables(overview)}
    assert list(variables) == ["datasource", "instance", "pool", "shape"]
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("instance", "pool", "shape"):
        v = variables[name]
        assert v["multi"] and v["includeAll"] and v["allValue"] == ".*"
        assert v["datasource"]["uid"] == "${datasource}"
    assert variables["instance"]["query"] == 'label_values(up{job=~"stepwatch.*"}, instance)'
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in model.panels(overview)}
    assert units["Per-step time vs baseline, by shape"] == "s"
    assert units["Peak memory by stage"] == "bytes"
    assert units["Probe PSNR p10 vs gate, by probe set"] == "dB"
    assert units["Cache hit rate vs baseline, by shape"] == "percentunit"
    assert units["Requests by pool and code"] == "reqps"
    exprs = [q.expr for p in model.panels(overview) for q in model.queries(p)]
    rated = [e for e in exprs if "rate(" in e or "increase(" in e]
    assert len(rated) > 20
    assert all("[$__rate_interval]" in e for e in rated)
    assert not any(w in e for e in exprs for w in ("[1m]", "[5m]", "[30s]"))


def _steps(p: dict[str, Any]) -> list[float]:
    return [s["value"] for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"] if s["value"] is not None]


def test_thresholds_follow_the_source_not_literals(th: Thresholds, overview: dict[str, Any]) -> None:
    def find(d: dict[str, Any], title: str) -> dict[str, Any]:
        return model.panel(d, title)

    # The current values land where they should.
    assert _steps(find(overview, th.alert("error_ratio").panel)) == [th.alert("error_ratio").threshold]
    assert _steps(find(overview, th.alert("queue_wait").panel)) == [th.alert("queue_wait").threshold]
    assert _steps(find(overview, th.alert("memory_pressure").panel)) == [th.alert("memory_pressure").threshold]
    assert _steps(find(overview, th.alert("rank_skew").panel)) == [pytest.approx(1 + th.alert("rank_skew").threshold)]
    step = find(overview, th.alert("step_time_regression").panel)
    assert step["targets"][1]["expr"].endswith(f"* {th.alert('step_time_regression').threshold:g}")
    band = [t["expr"] for t in find(overview, th.alert("cache_hit_rate_shift").panel)["targets"][1:]]
    assert band[0].endswith("* 0.7") and band[1].endswith("* 1.3")
    psnr = find(overview, th.alert("quality_drop").panel)["targets"]
    assert psnr[3]["expr"].endswith(f"- {th.alert('quality_drop').threshold:g}")

    # Change the source: every number moves with it, titles included.
    raw = yaml.safe_load(default_path().read_text())
    a = raw["alerts"]
    a["step_time_regression"]["threshold"] = 1.35
    a["cache_hit_rate_shift"]["threshold"] = 0.25
    a["queue_wait"]["threshold"] = 0.6
    a["memory_pressure"]["threshold"] = 0.85
    a["rank_skew"]["threshold"] = 0.15
    a["error_ratio"]["threshold"] = 0.07
    a["quality_drop"]["threshold"] = raw["quality"]["alert_margin_db"] = 4.0
    a["oom"]["panel"] = "Out-of-memory failures"
    changed = generate.dashboards(parse(raw, "changed"))[generate.OVERVIEW_FILE]
    assert lint.lint(changed, parse(raw, "changed")) == []
    assert _steps(find(changed, a["error_ratio"]["panel"])) == [0.07]
    assert _steps(find(changed, a["queue_wait"]["panel"])) == [0.6]
    assert _steps(find(changed, a["memory_pressure"]["panel"])) == [0.85]
    assert _steps(find(changed, a["rank_skew"]["panel"])) == [pytest.approx(1.15)]
    assert find(changed, a["step_time_regression"]["panel"])["targets"][1]["expr"].endswith("* 1.35")
    band = [t["expr"] for t in find(changed, a["cache_hit_rate_shift"]["panel"])["targets"][1:]]
    assert band[0].endswith("* 0.75") and band[1].endswith("* 1.25")
    assert find(changed, a["quality_drop"]["panel"])["targets"][3]["expr"].endswith("- 4")
    assert 'le="0.85"' in find(changed, "Requests above 85% of memory")["targets"][0]["expr"]
    assert find(changed, "Estimated queue wait vs SLO x 0.6, by pool")
    assert find(changed, "Out-of-memory failures")["links"][0]["url"].endswith("out-of-memory.md#stepwatchoutofmemory")
    with pytest.raises(KeyError):
        find(changed, "OOMs by stage and shape")


# ----- the lint rules fire ------------------------------------------------------------------------

def _mutated(overview: dict[str, Any], which: str, **changes: Any) -> dict[str, Any]:
    d = copy.deepcopy(overview)
    p = model.panel(d, which)
    for k, v in changes.items():
        if k == "expr":
            p["targets"][0]["expr"] = v
        elif k == "unit":
            p["fieldConfig"]["defaults"].pop("unit")
        else:
            p[k] = v
    return d


@pytest.mark.parametrize(("change", "rule"), [
    ({"description": ""}, "[panel-description]"),
    ({"title": ""}, "[panel-title]"),
    ({"unit": None}, "[panel-units]"),
    ({"datasource": {"type": "prometheus", "uid": "prom-1"}}, "[panel-datasource]"),
    ({"targets": []}, "[panel-targets]"),
    ({"expr": 'sum(rate(stepwatch_oom_total{instance=~"$instance"}[5m]))'}, "[target-rate-interval]"),
    ({"expr": "sum by (shape) (stepwatch_oom_total)"}, "[target-counter-agg]"),
    ({"expr": "stepwatch_pipeline_step_duration_seconds_count"}, "[target-counter-agg]"),
    ({"expr": "max_over_time(stepwatch_compile_total[$__rate_interval])"}, "[target-counter-agg]"),
    ({"expr": "rate(stepwatch_queue_depth[$__rate_interval])"}, "[target-counter-agg]"),
    ({"expr": "stepwatch_queue_depht"}, "[target-metric-known]"),
    ({"expr": 'stepwatch_queue_depth{pool=~"$poool"}'}, "[target-variables]"),
    ({"expr": "stepwatch_oom_total unless stepwatch_compile_total offset $__rate_interval"}, "[target-counter-agg]"),
])
def test_each_lint_rule_fires(th: Thresholds, overview: dict[str, Any], change: dict[str, Any], rule: str) -> None:
    problems = lint.lint(_mutated(overview, "Queue depth, by pool", **change), th)
    assert any(rule in p for p in problems), problems


def test_lint_alert_panel_and_duplicate_titles(th: Thresholds, overview: dict[str, Any]) -> None:
    d = _mutated(overview, th.alert("oom").panel, title="OOMs")
    assert any("[alert-panel] alert StepwatchOutOfMemory" in p for p in lint.lint(d, th))
    d = _mutated(overview, th.alert("oom").panel, links=[])
    assert any("does not link StepwatchOutOfMemory's runbook" in p for p in lint.lint(d, th))
    d = _mutated(overview, "Queue depth, by pool", title="Worker restarts")
    assert any("used by 2 panels" in p for p in lint.lint(d, th))
    d = copy.deepcopy(overview)
    d["templating"]["list"] = [v for v in d["templating"]["list"] if v["name"] != "datasource"]
    assert any("[template-datasource]" in p for p in lint.lint(d, th))


def test_metric_refs_and_first_event_idiom() -> None:
    expr = promql.events('stepwatch_oom_total{instance=~"$instance", shape=~"$shape"}', "$__rate_interval",
                         by="job, instance, shape")
    assert {n for n, _ in lint.metric_refs(expr)} == {"stepwatch_oom_total", "up"}
    kinds = {"stepwatch_oom_total": "counter"}
    assert lint.lint_expr(expr, {"stepwatch_oom_total", "up"}, kinds, {"instance", "shape"}) == []
    q = 'histogram_quantile(0.99, sum by (pool, le) (rate(x_bucket{pool=~"a|b"}[$__rate_interval]))) * 1e+3'
    assert [n for n, _ in lint.metric_refs(q)] == ["x_bucket"]
    assert lint.lint_expr(q, {"x_bucket"}, {"x": "histogram"}, {"pool"}) == []
    assert lint.metric_refs('sum by (job) (up{job=~"stepwatch.*"}) or on (job) vector(0)') == [("up", 14)]


# ----- snapshot, offline --------------------------------------------------------------------------

def test_parse_time_and_formats() -> None:
    now = 1_800_000_000.0
    assert snapshot.parse_time("now", now) == now
    assert snapshot.parse_time("-10m", now) == now - 600
    assert snapshot.parse_time("now-1h", now) == now - 3600
    assert snapshot.parse_time("1790000000", now) == 1_790_000_000
    assert snapshot.parse_time("2027-01-15T08:00:00Z", now) == datetime(2027, 1, 15, 8, tzinfo=timezone.utc).timestamp()
    assert snapshot.parse_time("2027-01-15T08:00:00", now) == datetime(2027, 1, 15, 8, tzinfo=timezone.utc).timestamp()
    with pytest.raises(ValueError):
        snapshot.parse_time("yesterday", now)
    assert snapshot.rate_interval(5, 5) == 20 and snapshot.rate_interval(60, 15) == 75
    assert snapshot.fmt_duration(20) == "20s" and snapshot.fmt_duration(120) == "2m"
    assert snapshot.format_value(0.9, "percentunit") == "90%"
    assert snapshot.format_value(0.0123, "s") == "12.3 ms"
    assert snapshot.format_value(3 * 1024**3, "bytes") == "3 GiB"
    assert snapshot.format_value(31.5, "dB") == "31.5 dB"
    assert snapshot.format_value(1.41e9, "hertz") == "1.41 GHz"


class FakeProm:
    """query_range answers from a table keyed by a substring of the query."""

    def __init__(self, answers: dict[str, list[tuple[dict[str, str], list[tuple[float, float]]]]]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[Any]:
        self.asked.append(expr)
        for key, ans in self.answers.items():
            if key in expr:
                return ans
        return []


def test_snapshot_draws_series_thresholds_and_firing_spans(tmp_path: Path, th: Thresholds,
                                                           overview: dict[str, Any]) -> None:
    t0 = 1_800_000_000.0
    ts = [t0 + 5 * i for i in range(60)]
    p = model.panel(overview, th.alert("memory_pressure").panel)
    prom = FakeProm({
        "histogram_quantile": [({"device": "cpu", "instance": "i:1"}, [(t, 0.5 + (0.6 if 30 <= i < 40 else 0))
                                                                        for i, t in enumerate(ts)])],
        "ALERTS": [({"alertname": "StepwatchMemoryPressure"}, [(t, 1.0) for t in ts[31:38]])],
    })
    values = {"instance": ".*", "pool": ".*", "shape": ".*", "__rate_interval": "20s"}
    data = snapshot.fetch(p, prom, ts[0], ts[-1], 5, values, th)
    assert data.lines == [(th.alert("memory_pressure").threshold, "red")]
    assert data.firing == {"StepwatchMemoryPressure": [(ts[31], ts[37] + 5)]}
    assert [s.label for s in data.series] == ["cpu largest request @ i:1"]
    assert all("$" not in q for q in prom.asked) and any("[20s]" in q for q in prom.asked)
    assert 'alertname=~"StepwatchMemoryPressure"' in prom.asked[-1]
    out = snapshot.draw(data, tmp_path / "mem.png", ts[0], ts[-1], 5, "test")
    import matplotlib.image

    img = matplotlib.image.imread(out)
    assert img.shape[0] > 400 and img.shape[1] > 1000
    # Heatmap panels: cumulative buckets become counts per bucket.
    hp = model.panel(overview, "Cache hit positions (step / steps)")
    buckets = [({"le": le}, [(t, float(c * (i + 1))) for i, t in enumerate(ts)])
               for le, c in (("0.3", 0), ("0.5", 2), ("0.7", 3), ("1.0", 3), ("+Inf", 3))]
    hd = snapshot.fetch(hp, FakeProm({"hit_position": buckets}), ts[0], ts[-1], 5, values, th)
    assert len(hd.heat) == 5 and not hd.series
    assert snapshot.draw(hd, tmp_path / "heat.png", ts[0], ts[-1], 5, "test").stat().st_size > 10_000


# ----- live proof --------------------------------------------------------------------------------

RATE_INTERVAL = "1m"
# Queries that legitimately return nothing on this CPU-only practice stack; the test asserts that
# exactly these are empty, so each entry has to stay true.  (panel title, refId) -> why.
CPU_ONLY_EMPTY = {
    # The exporter knows no dense peak FLOP/s for a CPU (stepwatch_device_peak_flops_per_second is 0),
    # so MFU is undefined: the windowed MFU divides by the peak, the last-request gauge is filtered > 0.
    ("MFU, by shape", "A"): "no device peak FLOP/s on CPU",
    ("MFU, by shape", "B"): "no device peak FLOP/s on CPU",
    ("Achieved FLOP/s vs device peak, by shape", "B"): "no device peak FLOP/s on CPU",
    # NVML is absent without a GPU: stepwatch_nvml_up is 0 and no per-GPU gauge exists.
    ("GPU memory used / total (NVML)", "A"): "no NVML",
    ("GPU memory used / total (NVML)", "B"): "no NVML",
    ("GPU memory used / total (NVML)", "C"): "no NVML",
    ("GPU utilization (NVML)", "A"): "no NVML",
    ("GPU SM clock and throttling", "A"): "no NVML",
    ("GPU SM clock and throttling", "B"): "no NVML",
    ("GPU temperature", "A"): "no NVML",
    ("GPU power", "A"): "no NVML",
    ("GPU XID and NVML read errors", "A"): "no NVML",
    ("GPU XID and NVML read errors", "B"): "no NVML",
}
# Events this stack cannot cause without breaking what it measures; both counters are born on the
# first event (the panels show it through the first-event arm) and read "0" until then.
NEVER_HAPPENS_HERE = {
    ("Non-finite (NaN / black) images, by pool", "A"): "the practice model never outputs NaN / black images",
    ("Exporter hook errors, by component", "A"): "a healthy exporter has no hook errors",
}
# The video quality panels show probe sets with an SSIM gate (video sets); the practice stack's sidecar probes an
# image set (gated on PSNR: its SSIM gate gauge is 0), so they stay empty here; tests/test_service_video_http.py
# proves the video set's gauges on the real service.
# A fleet's parts the one-instance stack has not: node agents and a load balancer (tests/test_fleet.py queries
# this panel on the practice fleet).
FLEET_ONLY = {
    ("Node agents up", "A"): "no node agents on one instance",
    ("Node agents up", "B"): "no load balancer on one instance",
    ("Users' endpoint probe", "A"): "no black-box probe on one instance (its endpoint is the fleet's balancer)",
    ("Users' endpoint probe", "B"): "no load balancer on one instance",
}
IMAGE_PROBES_ONLY = {
    ("Probe SSIM worst frame vs gate, by probe set", "A"): "an image probe set: no SSIM gate",
    ("Probe SSIM worst frame vs gate, by probe set", "B"): "an image probe set: no SSIM gate",
    ("Probe PSNR worst frame vs gate, video sets", "A"): "an image probe set: no video set",
    ("Probe PSNR worst frame vs gate, video sets", "B"): "an image probe set: no video set",
}
# Rank metrics exist only in two-rank mode: test_live_rank_panels proves these on a two-rank stack.
SINGLE_RANK_EMPTY = {
    ("Per-rank step time vs fastest rank", "A"): "one rank",
    ("Per-rank step time vs fastest rank", "B"): "one rank",
    ("Per-rank busy time per step", "A"): "one rank",
    ("Per-rank busy time per step", "B"): "one rank",
    ("Per-rank busy time per step", "C"): "one rank",
}
def live_values() -> dict[str, str]:
    return {"instance": ".*", "pool": ".*", "shape": ".*", "__rate_interval": RATE_INTERVAL}


Result = list[tuple[dict[str, str], list[tuple[float, float]]]]


def run_panel_queries(prom: Any, dashboard: dict[str, Any], start: float, end: float,
                      step: float = 5.0) -> dict[tuple[str, str], Result]:
    """(title, refId) -> the series with at least one finite value, over [start, end], as Grafana asks."""
    out = {}
    for p in model.panels(dashboard):
        for q in model.queries(p):
            result = prom.query_range(model.expand(q.expr, live_values()), start, end, step)
            out[(q.panel, q.ref_id)] = [(labels, pts) for labels, pts in result
                                        if any(math.isfinite(v) for _, v in pts)]
    return out


def peak(series: Result, **match: str) -> float:
    vals = [v for labels, pts in series if all(labels.get(k) == v for k, v in match.items())
            for _, v in pts if math.isfinite(v)]
    return max(vals, default=float("-inf"))


def measured_baselines(prom: Any, shapes: set[str], timeout: float) -> dict[str, dict[str, float]]:
    """Per-shape step time and hit ratio over the last minute, once every shape has both."""
    deadline = time.time() + timeout
    while True:
        steps = {s.label("shape"): s.value for s in prom.query(
            "sum by (shape) (rate(stepwatch_pipeline_step_duration_seconds_sum[1m])) / "
            "sum by (shape) (rate(stepwatch_pipeline_step_duration_seconds_count[1m]))")}
        hits = {s.label("shape"): s.value for s in prom.query(
            'sum by (shape) (rate(stepwatch_cache_decisions_total{decision="hit"}[1m])) / '
            "sum by (shape) (rate(stepwatch_cache_decisions_total[1m]))")}
        base = {k: {"step_seconds": steps[k], "cache_hit_ratio": hits[k]} for k in shapes
                if math.isfinite(steps.get(k, math.nan)) and math.isfinite(hits.get(k, math.nan))}
        if set(base) == shapes:
            return base
        if time.time() > deadline:
            raise AssertionError(f"no step time / hit ratio for {shapes - set(base)} after {timeout:.0f}s")
        time.sleep(2)


@pytest.fixture(scope="module")
def live_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The practice service, sidecar, Prometheus and Alertmanager after traffic, an OOM and a recompile."""
    from stepwatch.fault_injection.stack import LocalStack

    # Warm up the two traffic shapes only: 2048² warm-up costs minutes on a CPU, and the OOM request
    # below fails in the VAE decode whether or not its transformer was compiled first.
    with LocalStack(tmp_path_factory.mktemp("dash") / "stack", compile_backend="aot_eager",
                    service_overrides={"warmup": ["256x256", "512x512"]}, stream_probe=True) as st:
        st.up = time.time()
        with st.traffic(concurrency=2):
            base = measured_baselines(st.prom, {"256x256_8s", "512x512_8s"}, timeout=90)
            st.knobs(baselines={"shapes": base})  # what this deployment measures now: lines next to the data
            time.sleep(25)
        # Event panels show a counter's first event once Prometheus has one rate interval of history for
        # the job (so a restarted Prometheus does not mistake old counters for new events): give it that,
        # counted from Prometheus' first scrape, not the stack's start (Prometheus starts last; on a 2-core
        # host the compile and the few-step hits below can fall inside its first minute and leave panels empty).
        time.sleep(max(0.0, st.prometheus_started + 80 - time.time()))
        st.knobs(vae_tiling=False)
        status, body, _ = st.generate(size="2048x2048", steps=1)
        assert status == 507, body
        st.knobs(vae_tiling=True)
        for _ in range(2):  # not warmed up: a serving recompile (the second, if a session's tracing made the
            status, body, _ = st.generate(size="384x384")  # first run eagerly: worker_knobs._set_compile)
            assert status == 200, body
        _video_job_with_a_cache(st)
        _two_sessions(st)
        # The job's hits reach Prometheus through the worker, the service and a scrape: on a loaded host more
        # than the two scrapes below (with those alone the few-step panel can come back empty).
        _wait_for_series(st.prom, "stepwatch_cache_few_step_hits_total", timeout=60)
        time.sleep(12)  # two scrapes and a rule evaluation after the last event
        st.end = time.time()
        yield st


def _wait_for_series(prom: Any, name: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while not prom.query(name):
        if time.time() > deadline:
            raise AssertionError(f"{name} never reached Prometheus in {timeout:.0f}s")
        time.sleep(1)


def _video_job_with_a_cache(st: Any) -> None:
    """One video job with a cache on the few-step video model: the video rows' job, frame and few-step-hit panels
    get their data (a finished job, and the hits StepwatchCacheOnDistilledModel exists for)."""
    from stepwatch.fault_injection.video_drills import run_video

    st.knobs(video_cache="first_block_cache", video_cache_threshold=0.5)
    try:
        job = run_video(st)
    finally:
        st.knobs(video_cache="none")
    assert job["status"] == "completed" and job["stepwatch"]["cache"]["hits"] > 0, job


def _two_sessions(st: Any) -> None:
    """Two streaming sessions (the drill stack serves them): the streaming row's chunk, real-time-factor and KV
    panels get their data."""
    from stepwatch.fault_injection.stream_drills import run_session

    for chunks in (4, 6):
        seen = run_session(st.service_url, size="64x64", chunks=chunks)
        assert seen["outcome"] == "done" and seen["chunks"] == chunks, seen


@pytest.mark.heavy
def test_live_every_panel_query_returns_data(live_stack: Any, overview: dict[str, Any], th: Thresholds) -> None:
    st = live_stack
    committed = model.load(DASHBOARDS / generate.OVERVIEW_FILE)
    results = run_panel_queries(st.prom, committed, st.started, st.end)
    empty = {k for k, v in results.items() if not v}
    allowed = (set(CPU_ONLY_EMPTY) | set(NEVER_HAPPENS_HERE) | set(SINGLE_RANK_EMPTY) | set(IMAGE_PROBES_ONLY)
               | set(FLEET_ONLY))
    assert empty - allowed == set(), f"queries without data: {sorted(empty - allowed)}"
    assert allowed - empty == set(), f"allowlisted but now have data (remove them): {sorted(allowed - empty)}"

    # The events this stack caused are on their panels, with the labels on-call needs.
    oom = results[(th.alert("oom").panel, "A")]
    assert peak(oom, stage="vae_decode") >= 1, oom
    recompiles = results[(th.alert("recompile").panel, "A")]
    assert peak(recompiles, shape="other") >= 1, recompiles  # 384x384 is off the allowlist: shape "other"
    assert peak(results[("Requests by pool and code", "A")], code="507") > 0
    # The histogram sees the OOM's demand whatever the scrape interval (the last-request gauge may not: the
    # next request can overwrite it before a scrape).
    mp = th.alert("memory_pressure")
    assert peak(results[(mp.panel, "A")]) > mp.threshold
    assert peak(results[(f"Requests above {promql.pct(mp.threshold)} of memory", "A")]) > 0.5
    # The two sessions: first chunks, chunk ranges 0 and 1, real-time factors below 1 on the tiny model.
    assert peak(results[("First-chunk and chunk latency (streaming)", "A")]) > 0
    assert {labels["chunk_index"] for labels, _ in results[("Chunk latency by chunk index", "A")]} >= {"0", "1", "2-3"}
    assert 0 < peak(results[(th.alert("stream_stalling").panel, "A")]) < 1
    firing = {labels["alertname"] for labels, _ in results[("Firing stepwatch alerts", "A")]}
    assert {"StepwatchOutOfMemory", "StepwatchServingRecompile", "StepwatchMemoryPressure"} <= firing
    # Baselines, bands and the quality gate are real lines next to real data.
    assert results[(th.alert("step_time_regression").panel, "B")]
    ratio = results[("Per-step time / baseline, by shape", "A")]
    for shape in ("256x256_8s", "512x512_8s"):  # measured = baseline right after the baselines were set
        assert 0.5 < -peak([(labels, [(t, -v) for t, v in pts]) for labels, pts in ratio], shape=shape) < 1.5
    assert peak(results[(th.alert("quality_drop").panel, "C")]) == th.quality.gate()
    assert peak(results[(th.alert("quality_drop").panel, "A")]) > th.quality.gate()
    assert peak(results[("Worker and NVML up", "C")]) == 0  # no GPU here: NVML down, GPU panels empty

    # Template variables resolve to real values.
    for v in model.variables(committed):
        if v["type"] != "query":
            continue
        selector = v["query"].removeprefix("label_values(").rsplit(",", 1)[0]
        label = v["query"].rsplit(",", 1)[1].strip(" )")
        found = st.prom.query(f"count by ({label}) ({model.expand(selector, live_values())})")
        values = {s.label(label) for s in found}
        assert values - {""}, v["name"]
        if v["name"] == "pool":
            assert {"small", "large"} <= values


@pytest.mark.heavy
def test_live_snapshots(live_stack: Any, th: Thresholds, tmp_path: Path) -> None:
    st = live_stack
    titles = [th.alert("oom").panel, th.alert("memory_pressure").panel, th.alert("step_time_regression").panel,
              th.alert("cache_hit_rate_shift").panel, th.alert("quality_drop").panel,
              "Cache hit positions (step / steps)", "Latency p50 / p99, by pool", "Worker and NVML up"]
    out = Path(os.environ.get("STEPWATCH_SNAPSHOT_DIR") or tmp_path)  # set it to look at the PNGs
    paths = snapshot.render_panels(DASHBOARDS / generate.OVERVIEW_FILE, titles, st.prometheus_url, st.up - 10,
                                   st.end, out)
    assert [p.name for p in paths] == [f"{snapshot.slug(t)}.png" for t in titles]
    assert all(p.stat().st_size > 15_000 for p in paths)
    # The OOM panel's alert was firing inside the window, so its span is shaded.
    from stepwatch.promapi import Prometheus

    prom = Prometheus(st.prometheus_url)
    values = {**live_values(), "__rate_interval": "20s"}
    data = snapshot.fetch(model.panel(model.load(DASHBOARDS / generate.OVERVIEW_FILE), th.alert("oom").panel), prom,
                          st.started, st.end, 5, values, th)
    assert data.firing.get("StepwatchOutOfMemory")
    assert any(s.labels.get("stage") == "vae_decode" for s in data.series)
    # The command line does the same.
    from stepwatch import cli

    rc = cli.main(["snapshot", "--panels", th.alert("queue_wait").panel, "--from", f"{st.started:.0f}",
                   "--to", f"{st.end:.0f}", "--prometheus", st.prometheus_url, "--out", str(tmp_path / "cli")])
    assert rc == 0 and (tmp_path / "cli" / f"{snapshot.slug(th.alert('queue_wait').panel)}.png").is_file()


@pytest.mark.heavy
def test_live_rank_panels(tmp_path: Path, th: Thresholds) -> None:
    """Two-rank mode with a straggler: the rank panels have data, and rank 1 is the slow one."""
    from stepwatch.fault_injection.stack import LocalStack

    dashboard = model.load(DASHBOARDS / generate.OVERVIEW_FILE)
    with LocalStack(tmp_path / "stack", ranks=2, sidecar=False,
                    service_overrides={"compile": {"enabled": False}, "warmup": ["256x256"]}) as st:
        st.knobs(rank_delay_seconds={"1": 0.03})
        with st.traffic(bodies=[{"prompt": "a red bicycle", "size": "256x256"}], concurrency=1):
            time.sleep(25)
        time.sleep(6)
        end = time.time()
        for title in ("Per-rank step time vs fastest rank", "Per-rank busy time per step"):
            p = model.panel(dashboard, title)
            for q in model.queries(p):
                res = st.prom.query_range(model.expand(q.expr, live_values()), st.started, end, 5)
                ranks = {labels.get("rank") for labels, pts in res if any(math.isfinite(v) for _, v in pts)}
                assert ranks == {"0", "1"}, (title, q.ref_id, res)
        ratio = st.prom.query_range(model.expand(model.queries(model.panel(
            dashboard, th.alert("rank_skew").panel))[0].expr, live_values()), end - 20, end, 5)
        slow = {labels["rank"]: max(v for _, v in pts) for labels, pts in ratio}
        assert slow["0"] == pytest.approx(1.0) and slow["1"] > 1 + th.alert("rank_skew").threshold, slow
