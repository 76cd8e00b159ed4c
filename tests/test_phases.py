"""A campaign's phase lines: k of N, and a time left that follows the host's pace."""

from __future__ import annotations

from pathlib import Path

from stepwatch.fault_injection.phases import DRILL_S, STACK_S, Phases


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_phase_lines_count_and_scale_the_estimate_by_the_pace_so_far() -> None:
    said: list[str] = []
    clock = Clock()
    p = Phases.for_groups([(1, 3)], fleet_drills=0, say=said.append, clock=clock)
    assert p.planned == [STACK_S[1], DRILL_S, DRILL_S, DRILL_S]
    p.begin("the local stack (1 rank)")
    full = (STACK_S[1] + 3 * DRILL_S) / 60
    assert said[-1] == f"[1/4] the local stack (1 rank); about {full:.0f} min left"
    clock.t += 2 * STACK_S[1]  # this host runs at half the typical pace
    p.begin("cache-threshold")
    assert said[-1] == f"[2/4] cache-threshold; about {2 * 3 * DRILL_S / 60:.0f} min left"
    clock.t += DRILL_S * 100  # one odd phase: the pace is bounded
    p.begin("off-menu-resolution")
    assert said[-1] == f"[3/4] off-menu-resolution; about {3.0 * 2 * DRILL_S / 60:.0f} min left"


def test_two_stacks_and_the_fleet_are_planned_in_order() -> None:
    p = Phases.for_groups([(1, 2), (2, 1)], fleet_drills=2, say=lambda s: None)
    assert len(p.planned) == (1 + 2) + (1 + 1) + (1 + 2)
    assert p.planned[3] == STACK_S[2]


def test_the_summary_names_each_cause_and_where_to_look(tmp_path: Path) -> None:
    from stepwatch.fault_injection.campaign import expand
    from stepwatch.fault_injection.drill import DrillResult
    from stepwatch.fault_injection.report import summary_table

    assert expand(["demo"]) == ["cache-threshold", "off-menu-resolution", "vae-tiling-oom", "prompt-mix-shift"]
    ok = DrillResult("cache-threshold", "StepwatchQualityDrop", expected_cause="cache_threshold_too_high")
    ok.passed, ok.time_to_detect_s, ok.triage_cause = True, 19.6, "cache_threshold_too_high"
    bad = DrillResult("prompt-mix-shift", "StepwatchCacheHitRateShift", expected_cause="prompt_mix_shift")
    bad.failures.append("triage named cache_threshold_too_high")
    (tmp_path / "cache-threshold").mkdir()
    (tmp_path / "cache-threshold" / "quality.png").write_bytes(b"png")
    text = summary_table([ok, bad], tmp_path / "report.md")
    rows = text.splitlines()
    assert rows[2].split() == ["cache-threshold", "PASS", "19.6", "-", "StepwatchQualityDrop",
                               "cache_threshold_too_high"]
    assert rows[3].startswith("prompt-mix-shift") and "FAIL" in rows[3] and rows[3].endswith(
        "-   <- triage named cache_threshold_too_high")
    assert f"json:   {tmp_path / 'report.json'}" in rows
    assert f"panels: 1 PNG under {tmp_path}/<drill>/" in rows


def test_the_demo_hands_the_drill_command_a_complete_set_of_its_arguments() -> None:
    import argparse

    from stepwatch.fault_injection import cli_demo

    p = argparse.ArgumentParser()
    cli_demo.add_arguments(p)
    demo = p.parse_args([])
    assert (demo.drills, demo.compile_backend) == (["demo"], "aot_eager")
    args = cli_demo.drill_arguments(demo)
    assert (args.drills, args.out, args.compile_backend, args.variant, args.record) == (
        ["demo"], "reports", "aot_eager", 0, None)
    assert "about 10 min" in p.format_help()
