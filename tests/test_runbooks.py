"""Runbooks: format, links from the alerts, executable checks, and names checked against live /metrics."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest

from stepwatch.alerts import defs, promql, rulegen
from stepwatch.catalog import METRICS, readable_names
from stepwatch.runbooks import parse
from stepwatch.runbooks.parse import CAUSES, RunbookError
from stepwatch.thresholds import PROFILES, load
from tests.conftest import need_tool
from tests.promtext import absent, scrape, value

ROOT = Path(__file__).resolve().parent.parent
RUNBOOKS = ROOT / "runbooks"

# Example values for every label an alert can carry (rendering placeholders for the checks).
EXAMPLE_LABELS = {"job": "stepwatch-service", "instance": "10.0.0.1:8000", "shape": "1024x1024_8s_cfg",
                  "pool": "large", "device": "cuda:0", "gpu": "0", "rank": "1", "stage": "vae_decode",
                  "probe_set": "default", "instance_id": "svc-a", "stat": "p10", "phase": "serving",
                  "reason": "timeout", "component": "scheduler.step", "cache": "first_block_cache",
                  "outcome": "failed", "pod": "replica-1", "node": "node-1"}


@pytest.fixture(scope="module")
def th() -> Any:
    return load()


@pytest.fixture(scope="module")
def runbooks() -> dict[str, parse.Runbook]:
    return parse.load_all()


def _alert_labels(key: str) -> dict[str, str]:
    return {k: EXAMPLE_LABELS[k] for k in ("job", *defs.ALERTS[key].labels)}


def _rendered(th: Any, runbooks: dict[str, parse.Runbook]) -> list[tuple[str, str, str, str]]:
    """(alert, check id, profile, PromQL) for every check in both profiles."""
    out = []
    for spec in th.alerts.values():
        for c in runbooks[spec.name].checks:
            for p in PROFILES:
                out.append((spec.name, c.id, p, c.render(_alert_labels(spec.key), th, p)))
    return out


# ----- alerts <-> runbooks --------------------------------------------------------------------

def test_every_runbook_url_resolves(th: Any, runbooks: dict[str, parse.Runbook]) -> None:
    files = {p.name for p in RUNBOOKS.glob("*.md")} - parse.NOT_RUNBOOKS
    assert files == {a.runbook_file for a in th.alerts.values()}  # one file per alert, no orphans
    for spec in th.alerts.values():
        url = th.runbook_url(spec.key)
        assert url.startswith(th.runbook_base_url + "/")
        rb = parse.load_for_url(url)
        assert rb.alert == spec.name and rb.anchor == url.split("#")[1] and rb.anchor in rb.anchors
        assert (RUNBOOKS / url.rsplit("/", 1)[1].split("#")[0]).is_file()
        assert runbooks[spec.name] == rb == parse.load_for_alert(spec.name)
    with pytest.raises(RunbookError, match="no heading with anchor #nope"):
        parse.load_for_url(f"{th.runbook_base_url}/rank-skew.md#nope")


def test_runbook_sections_panel_and_glance(th: Any, runbooks: dict[str, parse.Runbook]) -> None:
    for spec in th.alerts.values():
        rb = runbooks[spec.name]
        assert list(rb.sections)[:5] == list(parse.SECTIONS), rb.file
        assert f"**{spec.panel}**" in rb.sections["Dashboard"], rb.file  # the panel the dashboards title
        text = (RUNBOOKS / rb.file).read_text()
        assert f"| Dashboard panel | **{spec.panel}** |" in text
        assert f"| Severity | **{spec.severity}**" in text
        assert len(rb.checks) >= 1
        for c in rb.checks:
            assert c.title.endswith("?"), (rb.file, c.id)  # a question a person can answer
            assert c.text, (rb.file, c.id)
        assert "{{ $labels" not in rb.sections["Meaning"] + rb.sections["Impact"]  # prose is for people


def test_checks_use_only_the_alerts_labels(th: Any, runbooks: dict[str, parse.Runbook]) -> None:
    for spec in th.alerts.values():
        allowed = {"job", *defs.ALERTS[spec.key].labels}
        for c in runbooks[spec.name].checks:
            assert c.labels_needed() <= allowed, (spec.name, c.id, c.labels_needed() - allowed)


def test_rendering_fills_every_placeholder(th: Any, runbooks: dict[str, parse.Runbook]) -> None:
    for alert, cid, p, q in _rendered(th, runbooks):
        assert "{{" not in q and "${" not in q, (alert, cid, p, q)
    c = runbooks["StepwatchRankSkew"].check("throttled")
    q = c.render({"instance": '10.0.0.1:8000', "rank": 'a"b\\c'}, th, "drill")
    assert 'instance=~"10.0.0.1:.*"' in q and 'gpu="a\\"b\\\\c"' in q and "[15m]" in q
    q = runbooks["StepwatchStepTimeRegression"].check("cache_hits_down").render({}, th, "drill")
    assert "hit_ratio_rate1m" in q and 'shape=""' in q  # a missing label renders empty
    assert runbooks["StepwatchOutOfMemory"].check("vae_stage").render({}, th, "production").count("[15m]") == 1


@pytest.mark.needs_tool("promtool")
def test_every_check_query_parses_as_promql(th: Any, runbooks: dict[str, parse.Runbook], tmp_path: Path) -> None:
    rules = []
    for i, (_alert, _cid, _p, q) in enumerate(_rendered(th, runbooks)):
        rules.append({"record": f"runbook_check:q{i}", "expr": q})
    f = tmp_path / "checks.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "runbook-checks", "rules": rules}]}))
    r = subprocess.run([need_tool("promtool"), "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout


def test_checks_name_only_series_that_exist(th: Any, runbooks: dict[str, parse.Runbook]) -> None:
    known = readable_names() | rulegen.recorded_names(th)
    for alert, cid, p, q in _rendered(th, runbooks):
        names = promql.metric_names(q)
        assert names, (alert, cid)
        assert names <= known, (alert, cid, p, names - known)
        for name, labels in promql.selector_labels(q).items():
            can = promql.known_labels(name)
            assert can is None or labels <= can, (alert, cid, name, labels - (can or set()))


# ----- flow and causes ------------------------------------------------------------------------

def test_cause_vocabulary_is_shared_and_documented(th: Any, runbooks: dict[str, parse.Runbook]) -> None:
    used = set().union(*(rb.causes() for rb in runbooks.values()))
    assert used == set(CAUSES)  # every cause reachable, nothing outside the vocabulary
    table = re.findall(r"^\| `([a-z_0-9]+)` \|", (RUNBOOKS / "README.md").read_text(), re.M)
    assert table == list(CAUSES)
    # Every diagnosis number in the thresholds is used by some check.
    text = "".join(c.query + str(c.healthy) for rb in runbooks.values() for c in rb.checks)
    for name in th.diagnosis:
        assert "${diagnosis." + name + "}" in text, name


def test_explained_by_names_another_alert(th: Any, runbooks: dict[str, parse.Runbook]) -> None:
    names = {a.name for a in th.alerts.values()}
    joins = {(rb.alert, c.id): c.explained_by for rb in runbooks.values() for c in rb.checks if c.explained_by}
    assert joins == {("StepwatchQualityProbeFailing", "stalled"): "StepwatchWorkerStalled",
                     ("StepwatchQueueWaitHigh", "stalled"): "StepwatchWorkerStalled",
                     ("StepwatchQueueWaitHigh", "stall_compiled"): "StepwatchServingRecompile",
                     ("StepwatchQualityProbeFailing", "serving_compiles"): "StepwatchServingRecompile",
                     ("StepwatchQualityProbeFailing", "pipeline_errors"): "StepwatchRequestErrorRatio",
                     ("StepwatchQualityProbeFailing", "slower"): "StepwatchStepTimeRegression",
                     ("StepwatchStepTimeRegression", "serving_compiles"): "StepwatchServingRecompile",
                     ("StepwatchVideoJobsFailing", "oom"): "StepwatchOutOfMemory",
                     ("StepwatchQualitySsimDrop", "few_step_hits"): "StepwatchCacheOnDistilledModel",
                     ("StepwatchInstanceSlow", "data_complete"): "StepwatchNodeSilent"}
    for (alert, _cid), target in joins.items():
        assert target in names and target != alert


def test_probe_stall_check_restates_the_stall_alerts_limit(th: Any, runbooks: dict[str, parse.Runbook]) -> None:
    """quality-probe-failing.md's stall check and StepwatchWorkerStalled must agree about one series: the same
    limit, in the same words (promql.floored_multiple), from the same numbers, in both profiles."""
    from stepwatch.thresholds import stall_floor

    spec = th.alert("worker_stalled")
    check = runbooks["StepwatchQualityProbeFailing"].check("stalled")
    for p in PROFILES:
        q = check.render({"instance": "10.0.0.1:9465"}, th, p)
        expected = promql.sel("stepwatch_worker_expected_seconds", 'instance=~"10.0.0.1:.*"')
        assert promql.floored_multiple(expected, spec.threshold, stall_floor(spec, p)) in q, (p, q)
        limit = promql.floored_multiple("stepwatch_worker_expected_seconds", spec.threshold, stall_floor(spec, p))
        assert limit in defs.ALERTS["worker_stalled"].expr(th, spec, p)
        probe_window = th.alert("probe_failing").window[p]
        assert f"[{probe_window}:{th.profiles[p].scrape_interval}]" in q
    with pytest.raises(RunbookError, match=r"unknown placeholder \$\{no_such_setting.worker_stalled\}"):
        parse.Check(1, "x", "x?", "", "${no_such_setting.worker_stalled}", parse.Condition("<", "1"), "end",
                    "end").render({}, th)


STALL_CHECKS = ("stall_answers", "stall_ranks", "stall_cpu")


def test_queue_stall_checks_are_the_probes(th: Any, runbooks: dict[str, parse.Runbook]) -> None:
    """queue-wait-high.md #3-#5 (which stall) are a copy of quality-probe-failing.md's (the runbook format has
    no includes): the same conditions, branches, causes and join, and the same queries but for two words: this
    instance instead of the probe's host (the queue and the worker's gauges are one target), and the restart
    check's lookback instead of the probe alert's window (a stall several ranks deep stays countable while the
    backlog drains). #1 is the queue's own question: whether one generation held the queue."""
    queue, probe = runbooks["StepwatchQueueWaitHigh"], runbooks["StepwatchQualityProbeFailing"]
    assert [c.id for c in queue.checks[:5]] == ["stalled", "stall_compiled", *STALL_CHECKS]
    assert queue.checks[5].id == "pool_short"
    lookback = "${diagnosis.change_lookback}"
    assert lookback in queue.check("restarts").query
    for cid in STALL_CHECKS:
        q, pr = queue.check(cid), probe.check(cid)
        assert (q.healthy, q.if_unhealthy, q.if_healthy, q.empty, q.explained_by) == (
            pr.healthy, pr.if_unhealthy, pr.if_healthy, pr.empty, pr.explained_by), cid
        copied = pr.query.replace('instance=~"{{ $labels.instance_host }}:.*"', 'instance="{{ $labels.instance }}"')
        assert q.query == copied.replace("${window}", lookback), cid
    stalled = queue.check("stalled")
    assert (stalled.if_unhealthy, stalled.if_healthy, stalled.explained_by) == (
        "next", "pool_short", "StepwatchWorkerStalled")
    for p in PROFILES:
        rendered = stalled.render({"instance": "10.0.0.1:8000", "pool": "large"}, th, p)
        assert f"* {th.alert('worker_stalled').threshold:g})" in rendered, rendered  # the stall alert's factor
        assert f"* {th.alert('queue_wait').threshold:g})" in rendered  # this alert's line, not the stall floor
        assert f"[{th.profiles[p].rate_window}:{th.profiles[p].scrape_interval}]" in rendered
        assert 'pool="' not in rendered  # a stall on any pool holds the one worker, so every pool's queue


def test_every_path_ends(runbooks: dict[str, parse.Runbook]) -> None:
    for rb in runbooks.values():
        for pattern in ("healthy", "unhealthy", "unknown"):
            cause, trail = parse.follow(rb, lambda c, o=pattern: o)  # type: ignore[misc]
            assert trail and (cause is None or cause in CAUSES)


def test_judge_and_follow(th: Any, runbooks: dict[str, parse.Runbook]) -> None:
    rb = runbooks["StepwatchQualityDrop"]
    hits = rb.check("hits_up")
    assert hits.judge([0.1, 0.2], th) == "healthy"
    assert hits.judge([0.1, 0.31], th) == "unhealthy"
    assert hits.judge([float("nan")], th) == "unknown"  # 0/0 is no answer: the check's empty outcome
    assert hits.judge([0.1, float("nan")], th) == "healthy"
    assert hits.judge([], th) == "unknown"
    assert rb.check("cache_kind").judge([0.0], th) == "healthy"
    assert rb.check("cache_kind").judge([float("nan")], th) == "unknown"
    outcomes = {"fingerprint": "healthy", "one_instance": "healthy", "rolled_out": "healthy", "hits_up": "unhealthy"}
    cause, trail = parse.follow(rb, lambda c: outcomes[c.id])  # type: ignore[return-value]
    assert cause == "cache_threshold_too_high"
    assert [(s.check.id, s.outcome, s.goes_to) for s in trail] == [
        ("fingerprint", "healthy", "next"), ("one_instance", "healthy", "next"), ("rolled_out", "healthy", "next"),
        ("hits_up", "unhealthy", "cache_threshold_too_high")]
    cause, _ = parse.follow(rb, lambda c: {**outcomes, "rolled_out": "unhealthy"}[c.id])  # type: ignore[return-value]
    assert cause == "config_changed"  # a rollout is named before the hit rate it raised
    # A jump: hit rate below baseline goes straight to "is the cache running?".
    shift = runbooks["StepwatchCacheHitRateShift"]
    cause, trail = parse.follow(shift, lambda c: "healthy" if c.id == "direction" else "unhealthy")
    assert cause == "cache_disabled" and [s.check.id for s in trail] == ["direction", "cache_running"]
    # More hits with the threshold as it started but another cache kind: a config change, not a threshold.
    up = {"direction": "unhealthy", "distilled": "healthy", "knob_up": "healthy", "kind_up": "unhealthy"}
    cause, trail = parse.follow(shift, lambda c: up[c.id])  # type: ignore[return-value]
    assert cause == "config_changed" and [s.check.id for s in trail] == list(up)
    # Nothing changed on the instance, by knob or by rollout: the prompts did.
    quiet = {**up, "kind_up": "healthy", "rolled_out": "healthy"}
    cause, _ = parse.follow(shift, lambda c: quiet[c.id])  # type: ignore[return-value]
    assert cause == "prompt_mix_shift"
    # The knobs as the process started, but the process started on a rolled-out threshold.
    cause, trail = parse.follow(shift, lambda c: {**quiet, "rolled_out": "unhealthy"}[c.id])  # type: ignore[return-value]
    assert cause == "config_changed" and [s.check.id for s in trail][-1] == "rolled_out"


@pytest.mark.parametrize("alert, outcomes, cause", [
    # The endpoint's probe fails: the balancer's own scrape, its host's agent, the replicas behind it.
    ("StepwatchEndpointDown", {"balancer_scraped": "unhealthy", "balancer_host": "healthy"}, "balancer_down"),
    ("StepwatchEndpointDown", {"balancer_scraped": "unhealthy", "balancer_host": "unhealthy"}, "host_down"),
    ("StepwatchEndpointDown", {"balancer_scraped": "healthy", "replicas_ready": "unhealthy"}, "backends_down"),
    ("StepwatchEndpointDown", {"balancer_scraped": "healthy", "replicas_ready": "healthy"}, None),
    # TargetDown on the balancer's exporter asks the balancer's node agent, not other targets on its address.
    ("StepwatchTargetDown", {"balancer_target": "unhealthy", "balancer_host": "healthy"}, "balancer_down"),
    ("StepwatchTargetDown", {"balancer_target": "unhealthy", "balancer_host": "unhealthy"}, "host_down"),
    ("StepwatchTargetDown", {"balancer_target": "healthy", "host_alive": "healthy"}, "process_down"),
    ("StepwatchTargetDown", {"balancer_target": "healthy", "host_alive": "unhealthy"}, "host_down"),
])
def test_a_frozen_balancer_is_told_from_its_host_and_its_replicas(runbooks: dict[str, parse.Runbook], alert: str,
                                                                  outcomes: dict[str, str], cause: str | None) -> None:
    """Each path ends where the outcomes say, having asked exactly those checks."""
    got, trail = parse.follow(runbooks[alert], lambda c: outcomes[c.id])  # type: ignore[return-value]
    assert got == cause and [s.check.id for s in trail] == list(outcomes)


def test_drills_name_causes_their_alerts_runbooks_reach(th: Any, runbooks: dict[str, parse.Runbook]) -> None:
    drills = parse.load_drills()
    assert [d.id for d in drills] == ["cache_past_gate", "off_menu_resolutions", "vae_tiling_off", "straggler_rank",
                                      "straggler_neighbour", "worker_stall", "queue_overload",
                                      # rival causes behind the same alerts
                                      "cache_off", "straggler_step_time", "compile_off", "fingerprint_change",
                                      "cache_threshold_raise", "cache_kind", "prompt_mix_shift",
                                      "compile_cache_dropped", "worker_killed", "pipeline_errors", "worker_freeze",
                                      "worker_freeze_backlog",
                                      "cpu_contention", "sidecar_killed", "host_down", "gpu_throttle",
                                      "shape_too_large",
                                      # video jobs and few-step serving
                                      "video_vae_untiled", "cache_on_distilled", "video_worker_killed",
                                      # streaming sessions
                                      "stream_stall", "stream_cpu_contention", "kv_window_too_long", "drift",
                                      "window_drift",
                                      # the practice fleet
                                      "replica_lost", "alertmanager_peer_lost", "central_store_outage",
                                      "bad_instance", "replica_gpu_throttle", "replica_config_drift", "rolling_update",
                                      "node_lost", "agent_lost", "pool_short",
                                      # day-two operations
                                      "routine_restart", "agent_paused", "config_rollout", "replica_bad_weights",
                                      "balancer_frozen"]
    for d in drills:
        assert d.within == "60s"
        for alert in d.alerts:
            assert d.cause in runbooks[th.by_name(alert).name].causes(), (d.id, alert)
        for alert, cause in d.also.items():  # an alert in hand: its runbook (or its join) can reach the cause
            assert d.alerts and alert != d.alerts[0] and th.by_name(alert) is not None, (d.id, alert)
            assert cause in CAUSES, (d.id, alert, cause)
    assert sum(len(d.also) for d in drills) == 38


def test_a_quiet_drill_has_no_alert_and_no_cause(tmp_path: Path) -> None:
    f = tmp_path / "drills.md"
    f.write_text("## A restart\n\n```drill\nid: a\nalerts: []\ncause: null\nwithin: 60s\n```\n")
    (quiet,) = parse.load_drills(f)
    assert (quiet.alerts, quiet.cause) == ((), "")
    for alerts, cause in (("[]", "worker_hung"), ("[StepwatchWorkerStalled]", "null")):
        f.write_text(f"## A restart\n\n```drill\nid: a\nalerts: {alerts}\ncause: {cause}\nwithin: 60s\n```\n")
        with pytest.raises(parse.RunbookError, match="both given, or both empty"):
            parse.load_drills(f)


@pytest.mark.parametrize("also, message", [
    ("[StepwatchOutOfMemory]", "also maps alert names"),
    ("{OutOfMemory: vae_tiling_off}", "also maps alert names"),
    ("{StepwatchOutOfMemory: made_up}", "not in the cause vocabulary: made_up"),
])
def test_a_bad_also_is_refused_naming_the_drill(tmp_path: Path, also: str, message: str) -> None:
    f = tmp_path / "drills.md"
    f.write_text(f"## A drill\n\n```drill\nid: a\nalerts: [StepwatchMemoryPressure]\ncause: vae_tiling_off\n"
                 f"within: 60s\nalso: {also}\n```\n")
    with pytest.raises(parse.RunbookError, match=f"drills.md: A drill: .*{message}"):
        parse.load_drills(f)


def test_fault_table_links_resolve() -> None:
    text = (RUNBOOKS / "fault-table.md").read_text()
    rows = [r for r in text.splitlines() if r.startswith("| ") and not r.startswith("| symptom")]
    assert len(rows) == 12 + 2 + 3  # DESIGN section 4, streaming sessions (seed 002: stalls, a KV window), the fleet
    for target in re.findall(r"\]\(([a-z-]+\.md)\)", text):
        assert (RUNBOOKS / target).is_file(), target
    for cause in re.findall(r"`([a-z_0-9]+)`", text):
        if "_" in cause and not cause.startswith("stepwatch"):
            assert cause in CAUSES, cause


def test_causes_are_declared_once_in_the_runbooks(tmp_path: Path) -> None:
    """The vocabulary is the runbooks' ```causes blocks: one line each (indented lines go on), once in all."""
    text = "## Mitigation\n\n```causes\nfoo_bar: one\n  line\nbaz: two\n```\n\n- **Foo** (`foo_bar`): fix\n"
    assert parse.declared_causes(text) == {"foo_bar": "one line", "baz": "two"}
    with pytest.raises(RunbookError, match="cause_id: what it means"):
        parse.declared_causes("```causes\nNot a cause\n```\n", "x.md")
    (tmp_path / "a.md").write_text(text)
    (tmp_path / "README.md").write_text("```causes\nignored: README is no runbook\n```\n")
    assert parse.load_causes(tmp_path) == ({"foo_bar": "one line", "baz": "two"}, {"foo_bar": "a.md", "baz": "a.md"})
    (tmp_path / "b.md").write_text("```causes\nbaz: again\n```\n")
    with pytest.raises(RunbookError, match=re.escape("b.md: cause 'baz' is already declared in a.md")):
        parse.load_causes(tmp_path)
    assert set(parse.CAUSE_RUNBOOK) == set(CAUSES)
    for cause, file in parse.CAUSE_RUNBOOK.items():  # declared where a check of that runbook names it
        assert cause in parse.load(file).causes(), (cause, file)


def _doc(item: str) -> str:
    return f"# X\n## Meaning\n## Impact\n## Diagnosis\n{item}\n## Mitigation\n## Dashboard\n"


def _item(**check: str) -> str:
    body = "\n".join(f"   {k}: {v}" for k, v in {"id": "a", "query": "up", **check}.items())
    return f"1. **A?**\n\n   ```check\n{body}\n   ```"


@pytest.mark.parametrize("text, message", [
    (_doc("1. **A?** b").replace("## Dashboard\n", ""), "missing section(s) ## Dashboard"),
    (_doc("1. **A?** no block"), "diagnosis item 1 needs exactly one ```check block"),
    (_doc(_item(healthy="'< 1'", if_unhealthy="made_up_cause", if_healthy="end")),
     "check a: if_unhealthy 'made_up_cause' is not a cause"),
    (_doc(_item(healthy="'about 1'", if_unhealthy="host_down", if_healthy="end")), "healthy 'about 1' is not"),
    (_doc(_item(healthy="'< 1'", if_unhealthy="host_down", if_healthy="next")), "'next' (not on the last check)"),
    (_doc(_item(healthy="'< 1'", if_unhealthy="host_down", if_healthy="end", empty="maybe")),
     "empty 'maybe' is not one of"),
    (_doc(_item(healthy="'< 1'", if_healthy="end")), "check 1 is missing if_unhealthy"),
    (_doc(_item(healthy="'< 1'", if_unhealthy="host_down", if_healthy="end", explained_by="worker stall")),
     "explained_by 'worker stall' is not an alert name"),
])
def test_parser_errors_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(RunbookError, match=re.escape(message)):
        parse.parse_runbook(text, "x.md")


# ----- names against live expositions ---------------------------------------------------------

def _exporter_exposition(flux_pipe: Any, registry: Any) -> str:
    """A real practice pipeline, instrumented, after two small requests (cache on, baselines published)."""
    from stepwatch.exporter import instrument
    from stepwatch.service.cache import apply_cache

    apply_cache(flux_pipe, "first_block_cache", 1.0)
    instrument(flux_pipe, registry=registry, shapes=["256x256_8s"], peak_flops=1e12,
               baselines={"256x256_8s": {"step_seconds": 0.05, "cache_hit_ratio": 0.25}})
    for _ in range(2):
        flux_pipe("w1", height=256, width=256, num_inference_steps=8, max_sequence_length=32, output_type="np")
    return generate_latest(registry).decode()


# owner -> how to get that owner's live /metrics text in-process; the service's and the sidecar's come from
# the real processes in test_service_and_sidecar_names_used_appear_live below.
LIVE_EXPOSITIONS = {"exporter": _exporter_exposition}
# Exporter series that a plain request cannot produce (they need a compile, an OOM, a hook
# error, or a multi-rank run): declared in the exposition, without samples.
EVENT_ONLY = {"stepwatch_compile_total", "stepwatch_oom_total", "stepwatch_exporter_errors_total",
              "stepwatch_rank_step_duration_seconds", "stepwatch_rank_busy_seconds_total", "stepwatch_rank_steps_total",
              "stepwatch_rank_progress_age_seconds", "stepwatch_rank_collective_wait_seconds",
              "stepwatch_rank_cpu_wait_seconds_total", "stepwatch_cache_few_step_hits_total"}


def _names_used(th: Any, runbooks: dict[str, parse.Runbook]) -> set[str]:
    used: set[str] = set()
    for p in PROFILES:
        for g in rulegen.rule_groups(th, p):
            for r in g["rules"]:
                used |= promql.metric_names(r["expr"])
    for _alert, _cid, _p, q in _rendered(th, runbooks):
        used |= promql.metric_names(q)
    return used


def _exposed(text: str) -> tuple[set[str], set[str]]:
    """(series names declared by # TYPE lines, series names with at least one sample)."""
    declared: set[str] = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        if kind in ("histogram", "summary"):
            declared |= {f"{name}_sum", f"{name}_count"} | ({f"{name}_bucket"} if kind == "histogram" else set())
        else:
            declared.add(name)
    sampled = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.M))
    return declared, sampled


@pytest.mark.parametrize("owner", sorted(LIVE_EXPOSITIONS))
def test_names_used_appear_in_live_exposition(owner: str, th: Any, runbooks: dict[str, parse.Runbook],
                                              clean_flux: Any, registry: Any) -> None:
    text = LIVE_EXPOSITIONS[owner](clean_flux, registry)
    declared, sampled = _exposed(text)
    owned = {s: m.name for m in METRICS if m.owner == owner for s in m.series_names()}
    used = {s for s in _names_used(th, runbooks) if s in owned}
    assert used, owner
    assert used <= declared, (owner, used - declared)
    if owner == "exporter":
        assert {"stepwatch_pipeline_step_duration_seconds_sum", "stepwatch_cache_decisions_total",
                "stepwatch_memory_peak_ratio_bucket", "stepwatch_baseline_step_duration_seconds",
                "stepwatch_ledger_flops_total", "stepwatch_device_peak_flops_per_second"} <= used
        assert {owned[s] for s in used - sampled} <= EVENT_ONLY, used - sampled
        # The exact series the rules select are there with the labels they select on.
        for sample in ('stepwatch_memory_peak_ratio_bucket{device="cpu",le="0.9"} ',
                       'stepwatch_memory_peak_ratio_count{device="cpu"} 2.0',
                       'stepwatch_pipeline_step_duration_seconds_count{shape="256x256_8s"} 16.0',
                       'stepwatch_cache_decisions_total{cache="first_block_cache",decision="hit",shape="256x256_8s"}',
                       'stepwatch_cache_decisions_total{cache="first_block_cache",decision="miss",shape="256x256_8s"}',
                       'stepwatch_baseline_cache_hit_ratio{shape="256x256_8s"} 0.25',
                       'stepwatch_device_peak_flops_per_second{device="cpu"} 1e+12',
                       'stepwatch_memory_peak_bytes{device="cpu",stage="vae_decode"}'):
            assert sample in text, sample


@pytest.mark.heavy
def test_service_and_sidecar_names_used_appear_live(th: Any, runbooks: dict[str, parse.Runbook],
                                                   tmp_path: Path) -> None:
    """The service's and the sidecar's own series that rules and runbooks use, from their real /metrics."""
    from prometheus_client import CollectorRegistry, generate_latest

    from stepwatch.exporter.sidecar.capture import capture_baseline
    from stepwatch.exporter.sidecar.config import default_probe_set, default_stream_probe_set
    from stepwatch.exporter.sidecar.prober import Prober
    from stepwatch.exporter.sidecar.stream_probe import StreamProber
    from tests.servicefixture import ServiceProc

    svc = ServiceProc(tmp_path / "svc", {"compile": {"enabled": False},
                                         "stream": {"enabled": True, "sizes": ["64x64"]}})
    try:
        probes, stream = default_probe_set(size="256x256", steps=4), default_stream_probe_set()
        capture_baseline(svc.url, probes, tmp_path / "base")
        capture_baseline(svc.url, stream, tmp_path / "base")
        reg = CollectorRegistry()
        # The prober's own loop, for one cycle: the interval gauge is what run_forever exports after a run.
        prober = Prober(svc.url, registry=reg, baseline_dir=tmp_path / "base", probe_set=probes, interval_s=60.0)
        stop = threading.Event()
        loop = threading.Thread(target=prober.run_forever, args=(stop,), daemon=True)
        interval = "stepwatch_quality_probe_interval_seconds"
        try:
            loop.start()
            deadline = time.monotonic() + 300
            while absent(scrape(reg), interval, probe_set=probes.name):
                assert loop.is_alive(), "the prober's loop died"
                assert time.monotonic() < deadline, "no probe cycle completed in 300 s"
                time.sleep(0.2)
        finally:
            stop.set()
            loop.join(timeout=60)
            prober.close()
        assert not loop.is_alive()
        assert prober.last_result is not None and prober.last_result.status == "ok"
        assert value(scrape(reg), interval, probe_set=probes.name) == 60.0
        # The drift probe beside it, on the same series (the drift alert reads its chunk ranges).
        streamer = StreamProber(svc.url, registry=reg, baseline_dir=tmp_path / "base", probe_set=stream,
                                metrics=prober.metrics)
        try:
            assert streamer.run_once().status == "ok"
        finally:
            streamer.close()
        # No GPU here: the NVML side reads the fake provider (the one hardware fake allowed).
        from tests.fakes import FakeNvml, collector, gpu

        collector(reg, FakeNvml([gpu(), gpu()]))
        texts = {"service": svc.get("/metrics")[1], "sidecar": generate_latest(reg).decode()}
    finally:
        svc.close()
    used_all = _names_used(th, runbooks)
    for owner, text in texts.items():
        declared, sampled = _exposed(text)
        owned = {s for m in METRICS if m.owner == owner for s in m.series_names()}
        used = used_all & owned
        assert used, owner
        assert used <= declared, (owner, used - declared)
        assert used <= sampled, (owner, used - sampled)


@pytest.mark.needs_tool("promtool")
@pytest.mark.parametrize("needed, ratios, expected", [
    # An overloaded pool on shared CPUs: one instance a few percent off the median is noise inside the
    # bad-instance line; it must not explain away a shortage of 2% (counting its whole excess names bad_instance).
    (3.06, (1.0, 1.0, 1.09), 1.02),
    # Past the line, only the excess beyond it counts: 20% slower, a 3% shortage is still the load's.
    (3.09, (1.0, 1.0, 1.2), 1.03 / (1 + 0.1 / 3)),
    (3.15, (1.0, 1.0, 1.2), 1.05 / (1 + 0.1 / 3)),
    # One instance 60% slower: its lost share (beyond the line) is more than the 10% shortage.
    (3.3, (1.0, 1.0, 1.6), 1.1 / (1 + 0.5 / 3)),
    # Nobody slow: the shortage as it stands.
    (3.6, (1.0, 0.98, 1.01), 1.2),
])
def test_pool_short_at_median_speed_counts_only_instances_past_the_line(
        th: Any, runbooks: dict[str, parse.Runbook], tmp_path: Path,
        needed: float, ratios: tuple[float, ...], expected: float) -> None:
    """The capacity runbook's third check, evaluated by promtool on series of a three-instance pool."""
    q = runbooks["StepwatchPoolCapacityShort"].check("short_at_median_speed").render({"job": "svc"}, th, "drill")
    w = th.profiles["drill"].rate_window
    series = [{"series": f'job:stepwatch_service_instances:needed_rate{w}{{job="svc"}}', "values": f"{needed}x2"},
              {"series": 'job:stepwatch_service_instances:ready{job="svc"}', "values": "3x2"}]
    series += [{"series": f'instance_shape:stepwatch_pipeline_step_duration_seconds:ratio_to_fleet_median_rate{w}'
                          f'{{job="svc", instance="i{i}", shape="512x512_8s"}}', "values": f"{r}x2"}
               for i, r in enumerate(ratios)]
    _promtool_evaluates(tmp_path, series, q, "1m", "1m", '{job="svc"}', expected)


def _promtool_evaluates(tmp_path: Path, series: list[dict[str, str]], query: str, interval: str, at: str,
                        labels: str, value: float) -> None:
    """``query`` over ``series`` (one sample per ``interval``) reads ``value`` (to 0.001) at ``at``, as
    ``promtool test rules`` evaluates it: the real engine, no Prometheus to start."""
    (tmp_path / "empty.yml").write_text("groups: []\n")
    test = {"rule_files": ["empty.yml"], "evaluation_interval": interval,
            "tests": [{"interval": interval, "input_series": series,
                       "promql_expr_test": [{"expr": f"round({query}, 0.001)", "eval_time": at,
                                             "exp_samples": [{"labels": labels, "value": round(value, 3)}]}]}]}
    f = tmp_path / "t.yml"
    f.write_text(yaml.safe_dump(test))
    r = subprocess.run([need_tool("promtool"), "test", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.needs_tool("promtool")
@pytest.mark.parametrize("busy, expected_s, slo, value", [
    # A 512^2 generation predicted 0.19 s, frozen for 12 s: past the queue's line (half of 10 s) long before the
    # stall alert's floor (20 s in drills): the generation holds the queue (against the floor: 0.6, "not stalled").
    (12.0, 0.19, 10.0, 2.4),
    # A 2048^2 generation predicted 9 s, 40 s in: its own limit (10x its prediction) is the longer line.
    (40.0, 9.0, 60.0, 40 / 90),
    # Healthy traffic: a generation inside both lines.
    (0.3, 0.19, 10.0, 0.06),
])
def test_queue_stall_line_is_the_longer_of_the_stall_limit_and_the_queue_line(
        th: Any, runbooks: dict[str, parse.Runbook], tmp_path: Path,
        busy: float, expected_s: float, slo: float, value: float) -> None:
    """The queue runbook's first check, evaluated by promtool on one instance's gauges."""
    q = runbooks["StepwatchQueueWaitHigh"].check("stalled").render({"instance": "i0", "pool": "small"}, th, "drill")
    labels = 'job="svc", instance="i0", pool="small"'
    series = [{"series": f"stepwatch_worker_busy_seconds{{{labels}}}", "values": f"{busy}x12"},
              {"series": f"stepwatch_worker_expected_seconds{{{labels}}}", "values": f"{expected_s}x12"},
              {"series": f"stepwatch_queue_slo_seconds{{{labels}}}", "values": f"{slo}x12"}]
    _promtool_evaluates(tmp_path, series, q, "5s", "55s", '{instance="i0", pool="small"}', value)


@pytest.mark.needs_tool("promtool")
@pytest.mark.parametrize("silent_after_s, spread", [(None, 19.0), (60, 0.0)])
def test_the_quality_spread_counts_only_instances_with_complete_data(
        runbooks: dict[str, parse.Runbook], tmp_path: Path, silent_after_s: int | None, spread: float) -> None:
    """quality-drop.md's one_instance check, run by promtool on three sidecars: the third's PSNR 19 dB below the
    others.  Reported throughout, it is the spread (bad_instance); its node silent for the last minute (its last
    PSNR still within the lookback), it counts in no comparison and the spread is the complete two's, 0."""
    th = load()
    check = next(c for c in runbooks["StepwatchQualityDrop"].checks if c.id == "one_instance")
    query = check.render({"probe_set": "fleet"}, th, "drill")
    n = 24  # two minutes of 5 s scrapes
    series = []
    for i, psnr in enumerate((36.0, 36.0, 17.0)):
        labels = f'job="stepwatch-sidecar", instance="10.0.0.{i}:9400"'
        values = f"1x{n}" if i < 2 or silent_after_s is None else f"1x{silent_after_s // 5} _x{n - silent_after_s // 5}"
        psnr_values = f"{psnr}x{n}" if values.startswith("1x24") else f"{psnr}x{silent_after_s // 5}"
        series += [{"series": f"up{{{labels}}}", "values": values},
                   {"series": f'stepwatch_quality_psnr_decibels{{{labels}, probe_set="fleet", stat="p10"}}',
                    "values": psnr_values}]
    (tmp_path / "check.rules.yml").write_text(yaml.safe_dump(
        {"groups": [{"name": "check", "rules": [{"record": "check_value", "expr": query}]}]}))
    (tmp_path / "check.test.yml").write_text(yaml.safe_dump({
        "rule_files": ["check.rules.yml"], "evaluation_interval": "5s",
        "tests": [{"interval": "5s", "input_series": series,
                   "promql_expr_test": [{"expr": "check_value", "eval_time": "115s",
                                         "exp_samples": [{"labels": "check_value", "value": spread}]}]}]}))
    r = subprocess.run(["promtool", "test", "rules", "check.test.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert check.judge([spread], th, "drill") == ("unhealthy" if spread else "healthy")
