"""The fleet drills' count of notifications per alert: a stale copy, a repeat or a missing resolution is caught;
an alert that fires again after it resolved is a second episode, not a duplicate."""

from __future__ import annotations

from typing import Any

from stepwatch.alerts import fleet as fcfg
from stepwatch.fault_injection.notifications import episodes, settled
from stepwatch.fault_injection.webhook import Notification

T0 = 1_800_000_000.0


def _stamp(t: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _note(received: float, status: str, started: float, ended: float | None = None,
          pod: str = "replica-1", name: str = "StepwatchTargetDown") -> Notification:
    alert: dict[str, Any] = {"status": status, "labels": {"alertname": name, "pod": pod},
                             "startsAt": _stamp(started),
                             "endsAt": _stamp(ended) if ended is not None else "0001-01-01T00:00:00Z"}
    return Notification(received, status, [alert], {"externalURL": "http://am-1"})


def _counts(notes: list[Notification], since: float = T0) -> list[tuple[str, int, int]]:
    return [(e.alert, e.firing, e.resolved) for e in episodes(notes, since)]


def test_one_firing_and_one_resolved_pass() -> None:
    notes = [_note(T0 + 12, "firing", T0 + 10), _note(T0 + 60, "resolved", T0 + 10, T0 + 58)]
    found = episodes(notes, T0)
    assert [(e.firing, e.resolved, e.once_each) for e in found] == [(1, 1, True)]
    assert found[0].describe() == 'StepwatchTargetDown{pod="replica-1"}: 1 firing, 1 resolved'


def test_the_peers_stale_firing_after_the_resolved_is_a_duplicate() -> None:
    """Alertmanager HA's known failure (upstream #4008): resolved, firing 5 s later, then resolved again."""
    notes = [_note(T0 + 12, "firing", T0 + 10), _note(T0 + 60, "resolved", T0 + 10, T0 + 58),
             _note(T0 + 65, "firing", T0 + 10), _note(T0 + 80, "resolved", T0 + 10, T0 + 58)]
    assert _counts(notes) == [('StepwatchTargetDown{pod="replica-1"}', 2, 2)]
    assert episodes(notes, T0)[0].describe().endswith("(firing +12.0 s by http://am-1; resolved +60.0 s by "
                                                      "http://am-1; firing +65.0 s by http://am-1; resolved "
                                                      "+80.0 s by http://am-1)")


def test_a_repeat_while_firing_is_a_duplicate_and_a_missing_resolution_shows() -> None:
    notes = [_note(T0 + 12, "firing", T0 + 10), _note(T0 + 72, "firing", T0 + 10)]
    assert _counts(notes) == [('StepwatchTargetDown{pod="replica-1"}', 2, 0)]


def test_firing_again_after_resolving_is_a_second_episode() -> None:
    notes = [_note(T0 + 12, "firing", T0 + 10), _note(T0 + 30, "resolved", T0 + 10, T0 + 28),
             _note(T0 + 52, "firing", T0 + 50), _note(T0 + 70, "resolved", T0 + 50, T0 + 68)]
    assert _counts(notes) == [('StepwatchTargetDown{pod="replica-1"}', 1, 1)] * 2


def test_alerts_are_told_apart_by_labels_and_an_earlier_drills_alert_is_left_out() -> None:
    notes = [_note(T0 - 100, "firing", T0 - 102, pod="replica-0"),
             _note(T0 + 5, "resolved", T0 - 102, T0 + 3, pod="replica-0"),  # started before this drill
             _note(T0 + 12, "firing", T0 + 10), _note(T0 + 13, "firing", T0 + 10, pod="replica-2"),
             _note(T0 + 40, "resolved", T0 + 10, T0 + 38, pod="replica-2")]
    assert sorted(_counts(notes)) == [('StepwatchTargetDown{pod="replica-1"}', 1, 0),
                                      ('StepwatchTargetDown{pod="replica-2"}', 1, 1)]


def test_a_resolution_never_notified_firing_is_caught() -> None:
    assert _counts([_note(T0 + 30, "resolved", T0 + 10, T0 + 28)]) == [('StepwatchTargetDown{pod="replica-1"}', 0, 1)]


def test_settled_waits_for_every_resolution_and_a_quiet_receiver() -> None:
    import time

    now = time.time()
    notes = [_note(now - 30, "firing", now - 31)]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        if len(sleeps) == 2:
            notes.append(_note(time.time() - 20, "resolved", now - 31, now - 21))

    found = settled(lambda: list(notes), now - 40, tail_s=10, deadline=time.time() + 30, sleep=sleep)
    assert [(e.firing, e.resolved) for e in found] == [(1, 1)] and len(sleeps) == 2
    stuck = settled(lambda: [_note(now - 30, "firing", now - 31)], now - 40, tail_s=10,
                    deadline=time.time() + 0.5, sleep=lambda s: time.sleep(0.2))
    assert [(e.firing, e.resolved) for e in stuck] == [(1, 0)]  # at the deadline, as it is


def test_the_pairs_peer_timeout_is_the_profiles() -> None:
    argv = fcfg.alertmanager_cluster_argv("am.yml", "data", "127.0.0.1:1", "127.0.0.1:2", ["127.0.0.1:3"])
    assert "--cluster.peer-timeout=1s" in argv
    production = fcfg.alertmanager_cluster_argv("am.yml", "data", "127.0.0.1:1", "127.0.0.1:2", [],
                                                profile="production")
    assert "--cluster.peer-timeout=15s" in production
