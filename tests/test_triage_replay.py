"""Triage on real data: recorded drills replayed into a real Prometheus, the webhook server, and the eval CLI.

Each scenario under triage/scenarios/ is a recording of the practice service
during a drill (or a no-fault control); see triage/README.md.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepwatch import httpclient
from stepwatch.alerts import rulegen, stack
from stepwatch.procs import free_port
from stepwatch.promapi import Alertmanager
from stepwatch.thresholds import load
from stepwatch.triage import render, scoring
from stepwatch.triage.alert import Alert, webhook_payload
from stepwatch.triage.engine import triage
from stepwatch.triage.evaluate import evaluate
from stepwatch.triage.false_alarms import committed_scenarios
from stepwatch.triage.in_hand import write_in_hand
from stepwatch.triage.receiver import TriageServer
from stepwatch.triage.record import load_scenario, record_scenario
from stepwatch.triage.replay import Replay
from tests.fakes import Recorder

SCENARIOS = Path(__file__).resolve().parent.parent / "triage" / "scenarios"
# Skipped when missing, failed under STEPWATCH_REQUIRE_TOOLS=1 (./dev test, CI): see tests/conftest.py.
pytestmark = [pytest.mark.needs_tool("prometheus"), pytest.mark.needs_tool("promtool")]


@pytest.fixture(scope="module")
def replays(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Replay]]:
    out: dict[str, Replay] = {}
    try:
        for name in ("straggler-5", "vae-tiling-oom-5", "queue-overload-5", "compile-cache-dropped-5",
                     "straggler-step-time-5"):
            out[name] = Replay(SCENARIOS / name, tmp_path_factory.mktemp(name)).start()
        yield out
    finally:
        for rp in out.values():
            rp.stop()


def test_straggler_names_rank_1_with_its_numbers(replays: dict[str, Replay]) -> None:
    rp = replays["straggler-5"]
    report = triage(rp.alerts(), rp.prom, at=rp.evaluated_at)
    inc = report.incident_for("StepwatchRankSkew")
    assert inc is not None and inc.cause == "straggler_rank" and inc.confidence == "high"
    d = inc.primary
    assert d.alert.labels["rank"] == "1"
    assert d.path == ["throttled", "clock_low", "still_slow"]
    assert [c.outcome for c in d.checks] == ["unknown", "unknown", "unhealthy"]  # no NVML on CPU hosts
    ev = inc.evidence(4)
    assert [c.id for c in ev] == ["still_slow"]
    # The evidence is the runbook's query at the alert's labels, and its value is Prometheus' answer.
    assert 'rank="1"' in ev[0].query and f'instance="{d.alert.labels["instance"]}"' in ev[0].query
    direct = rp.prom.query(ev[0].query, at=rp.evaluated_at)
    assert len(direct) == 1 and ev[0].values[0][1] == pytest.approx(direct[0].value)
    assert direct[0].value > 0.1 and ev[0].condition == "<= 0.1"  # rank 1 is >10% slower than rank 0
    assert inc.to_json()["runbook_url"].endswith("/rank-skew.md#stepwatchrankskew")


def test_vae_oom_and_memory_pressure_are_one_incident(replays: dict[str, Replay]) -> None:
    rp = replays["vae-tiling-oom-5"]
    report = triage(rp.alerts(), rp.prom, at=rp.evaluated_at)
    inc = report.incident_for("StepwatchMemoryPressure")
    assert inc is not None and inc is report.incident_for("StepwatchOutOfMemory")
    assert inc.cause == "vae_tiling_off" and inc.confidence == "high" and inc.severity == "critical"
    assert sorted(a.name for a in inc.alerts) == ["StepwatchMemoryPressure", "StepwatchOutOfMemory"]
    assert [(c.runbook, c.id, c.outcome) for c in inc.evidence(4)] == [
        ("out-of-memory.md", "vae_stage", "unhealthy"), ("out-of-memory.md", "tiling_off", "unhealthy"),
        ("memory-pressure.md", "vae_peak", "unhealthy"),
        ("out-of-memory.md", "kv_stage", "healthy")]  # no streaming session's KV cache: ruled out
    assert report.incidents == [inc]  # 2048x2048 is on the warm-up list of this stack: no recompile beside it


def test_alerts_sharing_a_cause_are_one_incident(replays: dict[str, Replay]) -> None:
    """Both serving shapes compiled again after the graphs were dropped: one incident, one cause."""
    rp = replays["compile-cache-dropped-5"]
    assert sorted(a["labels"]["shape"] for a in rp.alerts()) == ["256x256_8s", "512x512_8s"]
    report = triage(rp.alerts(), rp.prom, at=rp.evaluated_at)
    [inc] = report.incidents
    assert inc.cause == "compile_cache_evicted" and len(inc.diagnoses) == 2
    for d in inc.diagnoses:  # warmed as 256x256_2s / 512x512_2s: the same compiled graph as the 8-step shapes
        assert d.path == ["unlisted_shape", "warmed_up", "knob_changed"]
        assert d.checks[1].values[0][1] > 0 and 'shape=~"' in d.checks[1].query


def test_a_straggler_behind_the_step_time_alert(replays: dict[str, Replay]) -> None:
    """The step-time alert in hand, a straggler behind it: the runbook asks about ranks first."""
    rp = replays["straggler-step-time-5"]
    report = triage(rp.alerts(), rp.prom, at=rp.evaluated_at)
    inc = report.incident_for("StepwatchStepTimeRegression")
    assert inc is not None and inc.cause == "straggler_rank"
    step = next(d for d in inc.diagnoses if d.alert.name == "StepwatchStepTimeRegression")
    skew = next(c for c in step.checks if c.id == "rank_skew")
    assert step.path == ["gpu_throttle", "rank_skew"] and skew.values[0][1] > 0.1


def test_queue_overload_under_provisioned_and_probe_failures_follow(replays: dict[str, Replay]) -> None:
    rp = replays["queue-overload-5"]
    report = triage(rp.alerts(), rp.prom, at=rp.evaluated_at)
    assert len(report.incidents) == 1
    inc = report.incidents[0]
    assert inc.cause == "under_provisioned" and inc.primary.alert.labels["pool"] == "small"
    assert inc.primary.path == ["stalled", "pool_short", "pool_wide", "slower", "restarts", "not_ready"]
    assert inc.primary.checks[0].outcome == "healthy"  # the worker was busy, not stalled
    values = {c.id: c.values[0][1] for c in inc.primary.checks if c.values}
    assert values["pool_wide"] > 0.5 and values["slower"] <= 1.2 and values["not_ready"] == 1
    # The prober's requests got 429s behind the same queue: that alert is in this incident too.
    assert [d.alert.name for d in inc.followers + inc.related] == ["StepwatchQualityProbeFailing"]
    assert {c for c, _ in inc.ruled_out()} >= {"queue_backlog", "instance_slowdown", "cold_start"}


def test_serve_writes_the_report_within_5s_of_the_webhook(replays: dict[str, Replay], tmp_path: Path) -> None:
    rp = replays["vae-tiling-oom-5"]
    sink = Recorder("http://sink.test/reports")  # the --forward target, in-process; Prometheus is real
    with httpclient.use_transport(sink):
        server = TriageServer(rp.url, tmp_path / "out", port=0, forward=sink.url, at=rp.evaluated_at).start()
    try:
        # Alertmanager notifies the memory alert alone; the OOM firing on the same host joins it from context.
        mem = [a for a in rp.alerts() if a["labels"]["alertname"] == "StepwatchMemoryPressure"]
        payload = {**webhook_payload([]), "alerts": mem, "status": "firing"}
        t0 = time.time()
        assert httpclient.request("POST", server.url + "/alerts", json=payload, timeout=5).status_code == 200
        latest = tmp_path / "out" / "latest.json"
        while not latest.exists() and time.time() - t0 < 10:
            time.sleep(0.01)
        latency = time.time() - t0
        print(f"webhook -> report on disk: {latency * 1000:.0f} ms")
        assert latest.exists() and latency < 5.0
        data = json.loads(latest.read_text())
        assert data["latency_s"] < 5.0
        assert data["incidents"][0]["cause"] == "vae_tiling_off"
        assert sorted(data["incidents"][0]["alerts"])[0].startswith("StepwatchMemoryPressure")
        assert any(a.startswith("StepwatchOutOfMemory") for a in data["incidents"][0]["alerts"])
        assert len(data["incidents"]) == 1  # the recompile on the same host shares no cause: left out
        for f in data["files"]:
            assert (tmp_path / "out" / f).is_file()
        txt = (tmp_path / "out" / data["files"][0]).read_text()
        assert txt.splitlines()[2].startswith("LIKELY CAUSE: vae_tiling_off")
        deadline = time.time() + 5
        while not sink.bodies and time.time() < deadline:
            time.sleep(0.01)
        assert sink.bodies and sink.bodies[0]["incidents"][0]["cause"] == "vae_tiling_off"
        # A resolved-only notification is recorded, not triaged; a bad body is refused.
        resolved = {**payload, "status": "resolved", "alerts": [{**mem[0], "status": "resolved"}]}
        assert httpclient.request("POST", server.url + "/alerts", json=resolved, timeout=5).status_code == 200
        deadline = time.time() + 5
        while len(server.written) < 2 and time.time() < deadline:
            time.sleep(0.01)
        assert server.written[-1]["status"] == "resolved"
        assert httpclient.request("POST", server.url + "/alerts", content=b"[1,2", timeout=5).status_code == 400
    finally:
        server.stop()
        sink.close()


@pytest.mark.needs_tool("prometheus-alertmanager", "alertmanager")
def test_real_alertmanager_notifies_serve(replays: dict[str, Replay], tmp_path: Path) -> None:
    """Alertmanager (drill routing, one notification per alert) -> triage serve -> one incident for both OOM alerts."""
    rp = replays["vae-tiling-oom-5"]
    server = TriageServer(rp.url, tmp_path / "out", port=0, at=rp.evaluated_at).start()
    am_port = free_port()
    cfg = tmp_path / "am.yml"
    cfg.write_text(stack.alertmanager_config(server.url + "/alerts", "drill"))
    with open(tmp_path / "am.log", "w") as log:
        am = subprocess.Popen(stack.alertmanager_argv(cfg, tmp_path / "am-data", f"127.0.0.1:{am_port}"),
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{am_port}"
        deadline = time.time() + 30
        while not httpclient.ok(base + "/-/ready", timeout=1) and time.time() < deadline:
            time.sleep(0.1)
        oom = [{"labels": a["labels"], "annotations": a["annotations"]} for a in rp.alerts()
               if a["labels"]["alertname"] in ("StepwatchMemoryPressure", "StepwatchOutOfMemory")]
        httpclient.request("POST", base + "/api/v2/alerts", json=oom, timeout=5).raise_for_status()
        with Alertmanager(base, timeout=5.0) as api:  # the API client against the real thing
            assert api.ready()
            assert sorted(a["labels"]["alertname"] for a in api.alerts()) == sorted(a["labels"]["alertname"]
                                                                                   for a in oom)
        deadline = time.time() + 30
        while len(server.written) < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert len(server.written) >= 2, (tmp_path / "am.log").read_text()
        assert all(w["latency_s"] < 5.0 for w in server.written)
        reports = [json.loads((tmp_path / "out" / w["files"][2]).read_text()) for w in server.written[:2]]
        for data in reports:
            assert len(data["notification"]["alerts"]) == 1  # the drill route notifies per alert
            assert [i["cause"] for i in data["incidents"]] == ["vae_tiling_off"]
            assert len(data["incidents"][0]["alerts"]) == 2  # the other one joined from Prometheus
    finally:
        am.terminate()
        am.wait(timeout=10)
        server.stop()


def test_cli_run_at_a_past_time_reads_alerts_from_the_data(replays: dict[str, Replay]) -> None:
    rp = replays["straggler-5"]
    r = subprocess.run([sys.executable, "-m", "stepwatch.cli", "triage", "run", "--prometheus", rp.url,
                        "--at", f"{rp.evaluated_at}", "--format", "json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr  # 1: incidents reported
    data = json.loads(r.stdout)
    assert data["status"] == "incidents"
    assert [i["cause"] for i in data["incidents"]] == ["straggler_rank"]
    r = subprocess.run([sys.executable, "-m", "stepwatch.cli", "triage", "run", "--prometheus", rp.url,
                        "--at", f"{rp.evaluated_at - 120}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ALL CLEAR"), r.stdout  # before the fault


def test_record_round_trip(replays: dict[str, Replay], tmp_path: Path) -> None:
    """Recording a Prometheus (here: a replay) and replaying the recording gives the same answers."""
    src = replays["straggler-5"]
    at = src.evaluated_at
    out = record_scenario(src.url, at - 120, at, tmp_path / "copy", {
        "expected_cause": "straggler_rank", "expected_alert": "StepwatchRankSkew", "recorded": "round trip test",
        "alerts": ["StepwatchRankSkew"], "detected_at": at})
    sc = load_scenario(out)
    assert sc["evaluated_at"] == round(at, 3) and sc["expected_alerts"] == ["StepwatchRankSkew"]
    assert [a["labels"]["alertname"] for a in sc["alerts"]] == ["StepwatchRankSkew"]  # read back from ALERTS
    assert sc["alerts"][0]["annotations"]["runbook_url"].endswith("rank-skew.md#stepwatchrankskew")
    assert 0 < sc["samples"]["bytes_gz"] < 200_000 and sc["samples"]["series"] > 100
    q = 'instance_rank:stepwatch_rank_step_duration_seconds:ratio_to_fastest{rank="1"}'
    with Replay(out, tmp_path / "replay") as copy:
        assert copy.prom.query(q, at=at)[0].value == pytest.approx(src.prom.query(q, at=at)[0].value)
        report = triage(copy.alerts(), copy.prom, at=at)
        assert report.causes == ["straggler_rank"]


def committed_set() -> dict[str, Any]:
    """The committed set as it is on disk: what `triage eval` must count (triage/README.md, "The evaluation set")."""
    scenarios = committed_scenarios(SCENARIOS)
    faults = [sc for sc in scenarios if sc.get("expected_cause") is not None]
    return {"cases": len(scenarios), "faults": len(faults), "controls": len(scenarios) - len(faults),
            "false_alarms": sorted(sc["expected_alert"] for sc in scenarios if sc.get("kind") == "false_alarm"),
            "fault_alerts": {sc["expected_alert"] for sc in faults}, "names": [sc["name"] for sc in scenarios]}


def test_every_alert_has_exactly_one_false_alarm_and_faults_name_known_alerts() -> None:
    """The set's shape, from the thresholds and the recordings: one false alarm per alert, nothing else."""
    th = load()
    committed = committed_set()
    assert committed["false_alarms"] == sorted(spec.name for spec in th.alerts.values())
    assert committed["fault_alerts"] <= {spec.name for spec in th.alerts.values()}
    recorded = {p.parent.name for p in SCENARIOS.glob("*/samples.om.gz")}
    for sc in committed_scenarios(SCENARIOS):  # every case replays a recording on disk, its own or a control's
        assert (sc.get("samples_from") or sc["name"]) in recorded, sc["name"]
        if sc.get("kind") == "false_alarm":
            assert sc["expected_cause"] is None and sc["samples_from"] != sc["name"], sc["name"]
    assert committed["faults"] > 0 and committed["controls"] > len(committed["false_alarms"])
# Cases recorded fresh and wrong on the runbooks as they are: open defects, kept in the set so that the score
# says so (triage/README.md); a fix is scored on a fresh recording, not on these.  Cases a runbook (or a label)
# was fitted to are not in the set; batches 12-14 score those fits.
KNOWN_MISSES: set[str] = {
    "worker-killed-9",  # cold_start: the second kill waited 65 s for a ready worker; the restarts left the window
}


def test_eval_over_committed_scenarios() -> None:
    """The committed set, scored as `triage eval --json` scores it: exact counts, the issue's bars, the baseline."""
    r = subprocess.run([sys.executable, "-m", "stepwatch.cli", "triage", "eval", "--json"],
                       capture_output=True, text=True, timeout=600)
    missed = {line.split()[0] for line in r.stdout.splitlines() if " XX " in line}
    assert missed == KNOWN_MISSES, r.stdout + r.stderr
    assert r.returncode == (1 if KNOWN_MISSES else 0), r.stdout + r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert tuple(summary) == scoring.KEYS
    committed = committed_set()
    assert (summary["cases"], summary["faults"], summary["controls"]) == (
        committed["cases"], committed["faults"], committed["controls"])
    assert len(committed["false_alarms"]) == len(load().alerts)  # every alert once
    # Issue 13's bars: AC@1 >= 0.9, AC@3 >= 0.97, 0 false causes on controls, a lookup table at most 0.6.
    assert summary["ac1"] >= 0.9 and summary["ac3"] >= 0.97 and 0 < summary["strict_precision"] <= 1.0
    assert summary["lookup_baseline_ac1"] <= 0.6
    control_misses = {n for n in KNOWN_MISSES if n.startswith(("control", "false-alarm"))}
    assert summary["false_causes_on_controls"] == len(control_misses) and summary["all_clear_during_fault"] == 0
    # Rival causes: a fixed alert -> cause table scores below triage on this set (reported, never an exit status).
    assert summary["lookup_baseline_ac1"] < summary["ac1"]
    rivals = [a for a, v in summary["per_alert"].items() if len(v["causes"]) >= 2]
    assert len(rivals) >= 5, summary["per_alert"]
    assert sum(a["cases"] for a in summary["per_alert"].values()) == summary["faults"]
    assert "lookup baseline" in r.stdout and "AC@3" in r.stdout
    day_two = [n for n in committed["names"] if n.startswith(scoring.DAY_TWO_PREFIXES)]
    assert summary["day_two"]["cases"] == len(day_two) > 0 and summary["day_two"]["false_causes"] == 0
    for p in SCENARIOS.glob("*/scenario.yaml"):  # recorded on the current code, with the runbooks they met
        sc = load_scenario(p.parent)
        assert sc.get("runbooks_revision"), p.parent.name
    total = sum(f.stat().st_size for f in SCENARIOS.rglob("*") if f.is_file())
    # Committed data stays small: ~100 KB a recorded case (9.9 MiB for 160 cases, 2026-12-05); past 10 MiB an older
    # batch's cases that a newer batch repeats leave the set.
    assert total < 10 * 2**20


# ----- the strict scores of `triage eval` on in-memory cases (triage/scoring.py) --------------------------

def _fault(alert: str, expected: str, got: str | None, named: list[str] | None = None,
           ranked: list[str] | None = None) -> dict[str, Any]:
    """One scored fault case as triage.evaluate.evaluate returns it."""
    names = named if named is not None else ([got] if got else [])
    return {"name": f"{alert}-{expected}", "expected": expected, "alert": alert, "got": got, "control": False,
            "ranked": ranked if ranked is not None else ([got] if got else []),
            "named": [[c, "high"] for c in names], "verdict": "cause" if got else "no_cause"}


def _control(named: list[list[str]] | None = None) -> dict[str, Any]:
    return {"name": "control", "expected": None, "alert": None, "got": None, "control": True, "ranked": [],
            "named": named or [], "verdict": "cause" if named else "no_cause"}


def test_scores_have_exactly_the_issue_keys_and_count_cases() -> None:
    s = scoring.summarize([_fault("A", "x", "x"), _fault("B", "y", "z"), _control()])
    assert tuple(s) == scoring.KEYS
    assert (s["cases"], s["faults"], s["controls"]) == (3, 2, 1)
    assert s["ac1"] == 0.5 and s["strict_precision"] == 0.5
    assert s["per_cause"] == {"x": {"cases": 1, "ac1": 1.0}, "y": {"cases": 1, "ac1": 0.0}}


def test_day_two_scores_its_own_cases_only() -> None:
    rollout = {**_fault("Shift", "config_changed", "config_changed"), "name": "config-rollout-1"}
    restart = {**_control([["bad_instance", "high"]]), "name": "control-restart-1rank-3"}
    in_hand = {**_control(), "name": "routine-restart-3-as-probe-failing"}
    s = scoring.summarize([rollout, restart, in_hand, _fault("A", "x", "y"), _control([["z", "high"]])])
    assert s["day_two"] == {"cases": 3, "ac1": 1.0, "false_causes": 1}


def test_lookup_baseline_is_1_when_every_alert_has_one_cause() -> None:
    cases = [_fault("A", "x", "x"), _fault("A", "x", "y"), _fault("B", "z", "z")]
    s = scoring.summarize(cases)
    assert s["lookup_baseline_ac1"] == 1.0 and s["ac1"] == round(2 / 3, 4)
    assert s["per_alert"]["A"] == {"cases": 2, "ac1": 0.5, "lookup_ac1": 1.0, "causes": ["x"]}


def test_lookup_baseline_is_half_when_one_alert_has_two_causes_equally_often() -> None:
    s = scoring.summarize([_fault("A", "x", "x"), _fault("A", "y", "y")])
    assert s["lookup_baseline_ac1"] == 0.5 and s["ac1"] == 1.0
    assert s["per_alert"]["A"] == {"cases": 2, "ac1": 1.0, "lookup_ac1": 0.5, "causes": ["x", "y"]}


def test_strict_precision_is_half_when_two_causes_are_named_and_one_is_right() -> None:
    s = scoring.summarize([_fault("A", "x", "x", named=["x", "other"])])
    assert s["strict_precision"] == 0.5 and s["ac1"] == 1.0
    assert scoring.summarize([_fault("A", "x", "y", named=["y", "z"])])["strict_precision"] == 0.0


def test_ac3_counts_the_engines_ranked_alternatives() -> None:
    cases = [_fault("A", "x", "y", ranked=["y", "w", "x"]), _fault("A", "x", "y", ranked=["y", "w", "v", "x"])]
    s = scoring.summarize(cases)
    assert s["ac1"] == 0.0 and s["ac3"] == 0.5


def test_a_control_naming_a_cause_is_a_false_cause_not_precision() -> None:
    cases = [_fault("A", "x", "x"), _control([["x", "medium"]]), _control([["y", "low"]]), _control()]
    s = scoring.summarize(cases)
    assert s["false_causes_on_controls"] == 1  # the low-confidence one is not counted
    assert s["strict_precision"] == 1.0 and s["controls"] == 3


def test_a_fault_with_no_incident_for_its_alert_is_missed_and_all_clear() -> None:
    s = scoring.summarize([_fault("A", "x", None, named=["x"]), _fault("B", "y", "y")])
    assert s["ac1"] == 0.5 and s["ac3"] == 0.5 and s["all_clear_during_fault"] == 1
    failed = {**_fault("C", "z", None), "verdict": "error"}  # a replay that failed: missed, but triage said nothing
    assert scoring.summarize([failed])["all_clear_during_fault"] == 0


def test_eval_scores_only_the_incident_holding_the_expected_alert(tmp_path: Path) -> None:
    """A scenario whose expected alert is not among the alerts is missed, not scored on another incident."""
    src = SCENARIOS / "shape-too-large-5"
    dst = tmp_path / "wrong-alert"
    dst.mkdir()
    (dst / "samples.om.gz").write_bytes((src / "samples.om.gz").read_bytes())
    text = (src / "scenario.yaml").read_text().replace("expected_alert: StepwatchMemoryPressure",
                                                       "expected_alert: StepwatchNoSuchAlert")
    (dst / "scenario.yaml").write_text(text)
    r = evaluate(dst)
    assert r["got"] is None and r["ranked"] == [] and not r["correct"] and r["verdict"] == "no_cause"
    assert {c for c, _ in r["named"]} == {"shape_too_large", "recompile_unwarmed_shape"}
    good = evaluate(src)
    assert good["correct"] and good["ranked"][0] == "shape_too_large"
    assert scoring.precision_of(good) == 0.5  # four 2048^2 images were a new shape too: recompile_unwarmed_shape


def test_an_alert_in_hand_is_a_case_on_the_drill_samples_only_if_it_fired(tmp_path: Path) -> None:
    """write_in_hand: one scenario per ``also`` alert firing with the drill's alert, replaying the drill's samples;
    an alert that was not firing is no case.  The OOM alert in hand gets the fault's cause, like the memory one."""
    src = tmp_path / "vae-tiling-oom-5"
    src.mkdir()
    for f in ("samples.om.gz", "scenario.yaml"):
        (src / f).write_bytes((SCENARIOS / "vae-tiling-oom-5" / f).read_bytes())
    written, absent = write_in_hand(src, {"StepwatchOutOfMemory": "vae_tiling_off",
                                          "StepwatchRequestErrorRatio": "out_of_memory"})
    assert [p.name for p in written] == ["vae-tiling-oom-5-as-out-of-memory"]
    assert absent == ["StepwatchRequestErrorRatio"]
    sc = load_scenario(written[0])
    assert (sc["expected_alert"], sc["expected_cause"], sc["samples_from"]) == (
        "StepwatchOutOfMemory", "vae_tiling_off", "vae-tiling-oom-5")
    assert not (written[0] / "samples.om.gz").exists() and "live" not in sc
    r = evaluate(written[0])
    assert r["correct"] and r["got"] == "vae_tiling_off"
    wrong = tmp_path / "vae-tiling-oom-5-as-wrong"
    wrong.mkdir()
    (wrong / "scenario.yaml").write_text((written[0] / "scenario.yaml").read_text().replace(
        "expected_cause: vae_tiling_off", "expected_cause: shape_too_large"))
    assert not evaluate(wrong)["correct"]


# ----- a failing probe and the worker behind it, on real PromQL (synthetic series, drill profile) ---------

T0 = 1_795_960_000.0  # the synthetic recording's last sample
FREEZE = T0 - 120  # host .11: the worker freezes here; the drill stall limit is 20 s, the restart at 40 s
RESTART = FREEZE + 40
HOSTS = {"stall": "127.0.0.11", "backlog": "127.0.0.12", "quiet": "127.0.0.13"}


def _host_series(host: str, kind: str, t: float) -> list[tuple[str, dict[str, str], float | None]]:
    """(series name, labels, value at t, or None: no sample) of one host's service and sidecar."""
    svc = {"job": "stepwatch-service", "instance": f"{host}:8000"}
    pool = {**svc, "pool": "small"}
    probe = {"job": "stepwatch-sidecar", "instance": f"{host}:9465", "probe_set": "default"}
    since = t - FREEZE
    stall = kind == "stall"
    busy = since if stall and 0 <= since <= 40 else (t % 3) / 2  # else a sawtooth within the 1.5 s prediction
    timeouts = {"stall": sum(t >= FREEZE + s for s in (15, 45, 75)), "backlog": (t - T0 + 300) // 20,
                "quiet": 0}[kind]
    return [
        ("up", svc, 1), ("stepwatch_worker_busy_seconds", pool, busy),
        ("stepwatch_worker_expected_seconds", pool, 1.5),
        ("stepwatch_queue_slo_seconds", pool, 10.0),
        ("stepwatch_worker_restarts_total", svc, 1 if stall and t > RESTART else 0),
        ("stepwatch_service_ready", svc, 0 if stall and RESTART < t < RESTART + 20 else 1),
        ("stepwatch_worker_up", svc, 0 if stall and RESTART < t < RESTART + 10 else 1),
        # a frozen worker answers nothing, its own metrics included, until its successor is up
        ("stepwatch_exporter_build_info", {**svc, "stepwatch": "0"}, None if stall and 0 < since < 50 else 1),
        ("stepwatch_queue_estimated_wait_seconds", pool, 9.0 if kind == "backlog" else 0.5),
        # the recording rule the queue runbook reads (a replay loads no rules): the stalled host's queue grows
        # behind the stuck generation and drains after the restart; only the backlog host serves pool large
        ("instance_pool:stepwatch_queue_estimated_wait_seconds:slo_ratio", pool,
         {"stall": 1.5 if FREEZE <= t < RESTART + 60 else 0.2, "backlog": 0.9, "quiet": 0.1}[kind]),
        *([("instance_pool:stepwatch_queue_estimated_wait_seconds:slo_ratio", {**svc, "pool": "large"}, 0.9)]
          if kind == "backlog" else []),
        ("stepwatch_quality_probe_failures_total", {**probe, "reason": "timeout"}, timeouts),
        ("stepwatch_quality_probe_failures_total", {**probe, "reason": "bad_response"},
         (t - T0 + 300) // 30 if kind == "quiet" else 0),
    ]


def _write_world(directory: Path) -> Path:
    """A scenario directory: 5 minutes of 5 s scrapes of the three hosts."""
    samples: list[tuple[str, float, str]] = []
    for k in range(61):
        t = T0 - 300 + 5 * k
        for kind, host in HOSTS.items():
            for name, labels, value in _host_series(host, kind, t):
                if value is not None:
                    sel = name + "{" + ",".join(f'{a}="{b}"' for a, b in sorted(labels.items())) + "}"
                    samples.append((sel, t, f"{sel} {value} {t:.0f}"))
    directory.mkdir()
    with gzip.open(directory / "samples.om.gz", "wt") as f:  # OpenMetrics: each series' samples together
        f.write("\n".join([line for *_, line in sorted(samples)] + ["# EOF"]) + "\n")
    (directory / "scenario.yaml").write_text(f"name: probe-world\nevaluated_at: {T0}\nscrape_interval_s: 5\n"
                                             "alerts: []\n")
    return directory


def _drill_alert(key: str, **labels: str) -> Alert:
    th = load()
    spec = th.alert(key)
    return Alert(spec.name, {"alertname": spec.name, **rulegen.alert_labels(spec, "drill"), **labels},
                 rulegen.alert_annotations(th, spec, "drill"))


@pytest.fixture(scope="module")
def probe_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replay]:
    d = tmp_path_factory.mktemp("probe-world")
    with Replay(_write_world(d / "scenario"), d / "replay") as rp:
        yield rp


def _probe(host: str, reason: str = "timeout") -> Alert:
    return _drill_alert("probe_failing", job="stepwatch-sidecar", instance=f"{host}:9465", probe_set="default",
                        reason=reason)


def test_probe_failing_while_the_worker_stalls_joins_the_stall(probe_world: Replay) -> None:
    host = HOSTS["stall"]
    stall = _drill_alert("worker_stalled", job="stepwatch-service", instance=f"{host}:8000", pool="small")
    report = triage([_probe(host), stall], probe_world.prom, at=FREEZE + 35)  # 35 s on a 1.5 s generation
    assert report.causes == ["worker_hung"] and len(report.incidents) == 1
    inc = report.incidents[0]
    assert inc.primary.alert.name == "StepwatchWorkerStalled"
    [probe] = inc.followers
    assert probe.cause == "worker_hung" and probe.path == ["service_up", "baseline", "stalled", "stall_answers"]
    stalled = probe.checks[2]
    assert stalled.values == [({"instance": f"{host}:8000", "pool": "small"}, 35 / 20)]
    assert probe.explained_by is not None and probe.explained_by.firing == stall.short()
    assert "explained by StepwatchWorkerStalled{instance=127.0.0.11:8000, pool=small} (firing" in \
        render.terminal(report)


def test_probe_failing_after_the_restart_still_names_the_stall(probe_world: Replay) -> None:
    """30 s after the restart the stall alert has resolved and the worker is warm again; the probe's
    timeouts over its window are still the stall's, not a queue_backlog."""
    host = HOSTS["stall"]
    report = triage([_probe(host)], probe_world.prom, at=RESTART + 30)
    d = report.incidents[0].primary
    assert d.cause == "worker_hung" and d.path == ["service_up", "baseline", "stalled", "stall_answers",
                                                   "stall_ranks", "stall_cpu"]
    checks = {c.id: c for c in d.checks}
    assert checks["stalled"].values[0][1] == pytest.approx(2.0)  # 40 s: the last scrape before the restart
    assert checks["restarted"].outcome == checks["timeouts"].outcome == "unhealthy"  # off the path
    assert d.explained_by is not None and d.explained_by.firing == ""
    assert d.explained_by.labels == {"instance": f"{host}:8000", "pool": "small"}


@pytest.mark.parametrize("kind, reason, cause", [("backlog", "timeout", "queue_backlog"),
                                                 ("quiet", "bad_response", None)])
def test_probe_failing_with_a_healthy_worker_is_unchanged(probe_world: Replay, kind: str, reason: str,
                                                          cause: str | None) -> None:
    """Controls: timeouts behind a real backlog stay the queue's; bad answers with nothing else wrong end."""
    report = triage([_probe(HOSTS[kind], reason)], probe_world.prom, at=RESTART + 30)
    d = report.incidents[0].primary
    assert d.cause == cause and d.explained_by is None
    assert d.path == ["service_up", "baseline", "stalled", "restarted", "service_ready", "pipeline_errors",
                      "serving_compiles", "rewarmed", "slower", "timeouts"]
    assert [c.outcome for c in d.checks[2:3]] == ["healthy"] and d.checks[2].values[0][1] < 1  # real data


# ----- a high queue wait and the worker behind it, on the same synthetic series -------------------------------

def _queue(host: str, pool: str = "small") -> Alert:
    return _drill_alert("queue_wait", job="stepwatch-service", instance=f"{host}:8000", pool=pool)


def test_queue_wait_while_the_worker_stalls_joins_the_stall(probe_world: Replay) -> None:
    """The old flow named queue_backlog here (the other instances of the pool are fine)."""
    host = HOSTS["stall"]
    stall = _drill_alert("worker_stalled", job="stepwatch-service", instance=f"{host}:8000", pool="small")
    report = triage([_queue(host), stall], probe_world.prom, at=FREEZE + 35)
    assert report.causes == ["worker_hung"] and len(report.incidents) == 1
    inc = report.incidents[0]
    assert inc.primary.alert.name == "StepwatchWorkerStalled"
    [queue] = inc.followers
    assert queue.cause == "worker_hung" and queue.path == ["stalled", "stall_compiled", "stall_answers"]
    # the longer line is the stall alert's factor on its prediction (10 x 1.5 s), not its 20 s floor
    assert queue.checks[0].values == [({"instance": f"{host}:8000", "pool": "small"}, pytest.approx(35 / 15))]
    assert queue.explained_by is not None and queue.explained_by.firing == stall.short()


def test_queue_wait_after_the_restart_still_names_the_stall(probe_world: Replay) -> None:
    """30 s after the restart the stall alert has resolved and the backlog still drains: the stall in the
    lookback explains it, ahead of the restart it caused (which the restart check still sees)."""
    host = HOSTS["stall"]
    report = triage([_queue(host)], probe_world.prom, at=RESTART + 30)
    d = report.incidents[0].primary
    assert d.cause == "worker_hung" and d.path == ["stalled", "stall_compiled", "stall_answers", "stall_ranks",
                                                   "stall_cpu"]
    checks = {c.id: c for c in d.checks}
    assert checks["stalled"].values[0][1] == pytest.approx(40 / 15)  # 40 s (the last scrape before the restart)
    assert checks["restarts"].outcome == "unhealthy"  # off the path
    assert d.explained_by is not None and d.explained_by.firing == ""
    assert d.explained_by.labels == {"instance": f"{host}:8000", "pool": "small"}


@pytest.mark.parametrize("pool, cause, path", [
    ("small", "queue_backlog", ["stalled", "pool_short", "pool_wide"]),  # only this instance of the pool over the line
    ("large", "under_provisioned", ["stalled", "pool_short", "pool_wide", "slower", "restarts", "not_ready"]),
])
def test_queue_wait_with_a_healthy_worker_is_unchanged(probe_world: Replay, pool: str, cause: str,
                                                       path: list[str]) -> None:
    """Controls: a real backlog behind a healthy worker stays the queue's, although another instance of the
    job stalled and restarted (the stall and restart checks read this instance only)."""
    report = triage([_queue(HOSTS["backlog"], pool)], probe_world.prom, at=RESTART + 30)
    d = report.incidents[0].primary
    assert d.cause == cause and d.explained_by is None and d.path == path
    assert d.checks[0].outcome == "healthy" and d.checks[0].values[0][1] < 1  # real data
