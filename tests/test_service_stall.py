"""A hung worker is seen by the service itself: the stall limit, /readyz, the gauges, the restart."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from stepwatch.service.stall import Busy, InFlight, StallPolicy, restart_due, stalled_seconds
from stepwatch.thresholds import ThresholdsError, default_path, load, stall_floor
from tests.promtext import samples, value


def test_the_limit_is_the_factor_times_the_prediction_never_below_the_floor() -> None:
    policy = StallPolicy(factor=10, min_seconds=60)
    assert policy.limit(10) == 100
    assert policy.limit(2) == 60
    assert policy.limit(-1) == 60


def test_the_policy_is_the_alerts_own_numbers() -> None:
    spec = load().alert("worker_stalled")
    floors = spec.extra["min_seconds"]
    assert StallPolicy.from_thresholds() == StallPolicy(spec.threshold, float(floors["production"]))
    assert StallPolicy.from_thresholds(profile="drill") == StallPolicy(spec.threshold, float(floors["drill"]))
    assert floors["drill"] * 2 <= 60 < floors["production"]  # a drill sees the stall (and restart) within 60 s


@pytest.mark.parametrize("floor", [{"production": 300}, 0, "300", True])
def test_a_floor_missing_for_a_profile_or_not_seconds_is_an_error(floor: Any) -> None:
    spec = load().alert("worker_stalled")
    spec.extra["min_seconds"] = floor
    with pytest.raises(ThresholdsError, match="min_seconds"):
        stall_floor(spec, "drill")


def test_in_flight_busy_time_follows_the_clock() -> None:
    now = [100.0]
    inflight = InFlight(clock=lambda: now[0])
    assert inflight.busy() is None
    inflight.start("small", 2.5)
    now[0] = 130.0
    assert inflight.busy() == Busy("small", 30.0, 2.5)
    inflight.finish()
    assert inflight.busy() is None


@pytest.mark.parametrize(("seconds", "stalled", "restart"), [(59, 0, False), (61, 61, False), (121, 121, True)])
def test_stalled_past_the_limit_restart_past_twice_it(seconds: float, stalled: float, restart: bool) -> None:
    policy = StallPolicy(factor=10, min_seconds=60)
    busy = Busy("small", seconds, 1.0)  # predicted 1 s: the floor (60 s) decides
    assert stalled_seconds(busy, policy) == stalled
    assert restart_due(busy, policy) is restart
    assert stalled_seconds(None, policy) == 0 and not restart_due(None, policy)


def _fast_thresholds(tmp: Path) -> Path:
    """The packaged thresholds with a stall limit a test can wait for: 2 x prediction, at least 4 s."""
    raw: dict[str, Any] = yaml.safe_load(default_path().read_text())
    raw["alerts"]["worker_stalled"].update(threshold=2, min_seconds=4)
    path = tmp / "thresholds.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _wait_for(what: str, fn: Any, timeout: float) -> Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.heavy
def test_a_frozen_worker_turns_readiness_red_and_is_restarted(tmp_path: Path) -> None:
    from tests.servicefixture import ServiceProc

    svc = ServiceProc(tmp_path, {"thresholds": str(_fast_thresholds(tmp_path)), "compile": {"enabled": False},
                                 "cache": {"kind": "none"}})
    try:
        pid = svc.get("/v1/stepwatch/info")[1]["worker"]["pid"]
        os.kill(pid, signal.SIGSTOP)  # frozen: no reply, no metrics of its own, yet its process is alive
        answer: dict[str, Any] = {}
        t = threading.Thread(target=lambda: answer.update(code=svc.generate(size="256x256", steps=4)))
        t.start()
        _wait_for("/readyz 503", lambda: svc.get("/readyz")[0] == 503, 15)
        code, body, _ = svc.get("/readyz")
        assert code == 503 and body["stalled_seconds"] >= 4, body
        m = samples(svc.get("/metrics")[1])
        assert value(m, "stepwatch_worker_busy_seconds", pool="small") >= 4
        assert value(m, "stepwatch_worker_expected_seconds", pool="small") > 0
        assert value(m, "stepwatch_worker_busy_seconds", pool="large") == 0
        t.join(timeout=60)
        code, body, _ = answer["code"]
        assert code == 504 and "stalled" in body["error"]["message"], body
        svc.wait_ready(240)  # restarted and warmed up again
        assert svc.generate(size="256x256", steps=4)[0] == 200
        m = samples(svc.get("/metrics")[1])
        assert value(m, "stepwatch_worker_restarts_total") == 1
        assert value(m, "stepwatch_worker_busy_seconds", pool="small") == 0
    finally:
        svc.close()
