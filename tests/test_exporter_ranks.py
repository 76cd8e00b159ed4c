"""Rank timing without a collective: stamps, shipping, alignment, the straggler and the stall signals."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from stepwatch.exporter.rank_align import Aligner
from stepwatch.exporter.rank_timeline import Chunk, Shipper, StoreChannel, Timeline, stamping
from stepwatch.exporter.ranks import RankReporter
from stepwatch.metrics import ExporterMetrics


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class ListChannel:
    """Followers' chunks in a list, as the store's queues would hold them."""

    def __init__(self) -> None:
        self.queue: list[Chunk] = []

    def send(self, chunk: Chunk) -> None:
        self.queue.append(Chunk.decode(chunk.encode()))

    def receive(self) -> list[Chunk]:
        out, self.queue = self.queue, []
        return out


def two_ranks(clock: Clock, cpu_wait: list[float] | None = None,
              ) -> tuple[RankReporter, RankReporter, ListChannel, CollectorRegistry]:
    """Two ranks in one process; ``cpu_wait[r]``: rank r's cumulative wait for a CPU (None: not measured)."""
    ch, registry = ListChannel(), CollectorRegistry()

    def waits(r: int) -> Any:
        return lambda: None if cpu_wait is None else cpu_wait[r]

    r0 = RankReporter(channel=ch, interval=None, clock=clock, rank=0, world=2, hook=False, cpu_wait=waits(0))
    r1 = RankReporter(channel=ch, interval=None, clock=clock, rank=1, world=2, hook=False, cpu_wait=waits(1))
    r0.bind(ExporterMetrics(registry))
    return r0, r1, ch, registry


def collectives(tls: list[Timeline], clock: Clock, n: int, compute: list[float], late_exit: list[float]) -> None:
    """``n`` collectives: rank r computes ``compute[r]`` after the previous, leaves ``late_exit[r]`` after the
    last arrival (its side of the transfer).  Stamps as the wrapped wait would take them."""
    released = [clock.t] * len(tls)
    for _ in range(n):
        arrive = [released[r] + compute[r] for r in range(len(tls))]
        last = max(arrive)
        released = [last + 0.001 + late_exit[r] for r in range(len(tls))]
        for r, tl in enumerate(tls):
            tl.marks.append((arrive[r], released[r]))
        clock.t = max(released)


def request(r0: RankReporter, r1: RankReporter, clock: Clock, compute: list[float], late_exit: list[float],
            n: int = 40, steps: int = 4) -> None:
    for rep in (r0, r1):
        rep.begin_request()
    collectives([r0.timeline, r1.timeline], clock, n, compute, late_exit)
    for rep in (r0, r1):
        rep.end_request()
        rep.timeline.steps(rep.timeline.request, steps)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    v = registry.get_sample_value(name, labels)
    assert v is not None, name
    return v


def test_a_rank_that_computes_longer_is_named_and_the_ranks_agree_otherwise() -> None:
    clock = Clock()
    r0, r1, _ch, registry = two_ranks(clock)
    request(r0, r1, clock, compute=[0.010, 0.010], late_exit=[0, 0])
    r1.tick()
    r0.tick()
    assert value(registry, "stepwatch_rank_skew_ratio") == pytest.approx(0, abs=1e-9)
    request(r0, r1, clock, compute=[0.010, 0.013], late_exit=[0, 0])
    r1.tick()
    r0.tick()
    busy0 = value(registry, "stepwatch_rank_step_duration_seconds", rank="0")
    busy1 = value(registry, "stepwatch_rank_step_duration_seconds", rank="1")
    assert busy1 / busy0 == pytest.approx(1.3, rel=1e-6)
    assert value(registry, "stepwatch_rank_skew_ratio") == pytest.approx(0.3, rel=1e-6)
    assert value(registry, "stepwatch_rank_steps_total", rank="1") == 8
    assert r0.last == [busy0, busy1] and not r0.aligner.requests


def test_a_starved_rank_whose_transfers_drag_is_named_where_busy_minus_wait_is_not() -> None:
    """The operator's case: rank 1 computes as fast, but leaves each collective 3 ms late (its side of
    the transfer runs on the starved CPU).  Its arrivals are late; its own waits look short."""
    clock = Clock()
    r0, r1, _ch, registry = two_ranks(clock)
    request(r0, r1, clock, compute=[0.010, 0.010], late_exit=[0, 0.003])
    for tl in (r0.timeline, r1.timeline):  # the naive measure: step time minus time waiting in collectives
        marks = next(iter(tl.by_request.values()))
        tl.old = sum(a - b for (a, _), (_, b) in zip(marks[1:], marks[:-1], strict=True))
    assert abs(r1.timeline.old / r0.timeline.old - 1) < 0.01  # blind to it
    r1.tick()
    r0.tick()
    assert value(registry, "stepwatch_rank_skew_ratio") == pytest.approx(0.3, rel=0.01)
    assert value(registry, "stepwatch_rank_busy_seconds_total", rank="1") > value(
        registry, "stepwatch_rank_busy_seconds_total", rank="0") * 1.25


def test_a_rank_starved_of_cpu_is_named_when_the_ranks_arrive_together() -> None:
    """The practice stack with a busy loop beside rank 1: arrivals equal, both ranks wait longer inside every
    transfer, and only rank 1's threads wait for a CPU (measured live: 0.82 s/s against 0.25 on rank 0)."""
    clock, waits = Clock(), [0.0, 0.0]
    r0, r1, _ch, registry = two_ranks(clock, waits)
    for rep in (r1, r0):
        rep.tick()  # the first heartbeat: the schedstat baseline
    for rep in (r0, r1):
        rep.begin_request()
    collectives([r0.timeline, r1.timeline], clock, 40, [0.010, 0.010], [0, 0])
    waits[0], waits[1] = 0.10, 0.33
    for rep in (r0, r1):
        rep.end_request()
        rep.timeline.steps(rep.timeline.request, 4)
    r1.tick()
    r0.tick()
    assert value(registry, "stepwatch_rank_cpu_wait_seconds_total", rank="1") == pytest.approx(0.33)
    busy0 = value(registry, "stepwatch_rank_busy_seconds_total", rank="0")
    busy1 = value(registry, "stepwatch_rank_busy_seconds_total", rank="1")
    assert busy1 - busy0 == pytest.approx(0.23, rel=0.01)  # arrivals equal: the CPU waits make the difference
    assert value(registry, "stepwatch_rank_skew_ratio") > 0.1 and r0.last[1] > r0.last[0]


def test_busy_time_is_published_during_a_long_request_not_only_at_its_end() -> None:
    clock = Clock()
    r0, r1, _ch, registry = two_ranks(clock)
    for rep in (r0, r1):
        rep.begin_request()
    collectives([r0.timeline, r1.timeline], clock, 20, [0.01, 0.02], [0, 0])
    r1.tick()
    r0.tick()
    first = value(registry, "stepwatch_rank_busy_seconds_total", rank="1")
    assert first == pytest.approx(19 * 0.02, rel=0.01)
    collectives([r0.timeline, r1.timeline], clock, 20, [0.01, 0.02], [0, 0])
    r1.tick()
    r0.tick()
    assert value(registry, "stepwatch_rank_busy_seconds_total", rank="1") == pytest.approx(39 * 0.02, rel=0.01)
    assert registry.get_sample_value("stepwatch_rank_step_duration_seconds", {"rank": "1"}) is None


def test_a_frozen_rank_shows_as_progress_age_while_the_other_waits_in_its_collective() -> None:
    clock = Clock()
    r0, r1, _ch, registry = two_ranks(clock)
    request(r0, r1, clock, compute=[0.01, 0.01], late_exit=[0, 0])
    r1.tick()
    r0.tick()
    for rep in (r0, r1):
        rep.begin_request()
    r1.tick()  # rank 1's last heartbeat: in the request, then it freezes (SIGSTOP) and ships nothing more
    r0.timeline.in_since = clock.t  # rank 0 arrives at the first collective and waits for rank 1
    clock.t += 30
    r0.tick()
    assert value(registry, "stepwatch_rank_collective_wait_seconds", rank="0") == pytest.approx(30)
    assert value(registry, "stepwatch_rank_collective_wait_seconds", rank="1") == 0
    assert value(registry, "stepwatch_rank_progress_age_seconds", rank="1") == pytest.approx(30)
    r0.timeline.in_since = None  # healthy again: both idle
    for rep in (r0, r1):
        rep.end_request()
    r1.tick()
    r0.tick()
    assert value(registry, "stepwatch_rank_progress_age_seconds", rank="1") == 0


def test_a_host_collective_stamped_by_the_reporter_shows_as_a_wait_for_the_frozen_rank() -> None:
    """The practice service's cache agreement is an all-reduce of its own, not diffusers' attention wait.
    Unstamped, rank 0 blocked in it looks like a rank stuck in its own code: the two-rank stall drill names
    a hung worker, not the collective hang.  ``stamp`` makes it a wait like any other."""
    clock = Clock()
    r0, r1, _ch, registry = two_ranks(clock)
    for rep in (r0, r1):
        rep.begin_request()
    r1.tick()  # rank 1's last heartbeat: it freezes before the all-reduce
    seen: list[float] = []

    def all_reduce(t: list[int]) -> None:  # blocks until the frozen rank joins: here, 30 s of rank 0's ticks
        for _ in range(30):
            clock.t += 1
            r0.tick()
        seen.append(value(registry, "stepwatch_rank_collective_wait_seconds", rank="0"))

    r0.stamp(all_reduce)([1])
    assert seen == [pytest.approx(30)]
    assert value(registry, "stepwatch_rank_progress_age_seconds", rank="1") == pytest.approx(30)
    assert len(r0.timeline.marks) == 1 and r0.timeline.in_since is None


def test_a_rank_frozen_inside_a_wait_does_not_look_like_the_rank_waiting_for_it() -> None:
    """SIGSTOP lands mostly inside a wait (gloo's transfers take most of a small step): both ranks' last
    heartbeats say "in a collective", but only the live one keeps saying it."""
    clock = Clock()
    r0, r1, _ch, registry = two_ranks(clock)
    for rep in (r0, r1):
        rep.begin_request()
    r0.timeline.in_since = r1.timeline.in_since = clock.t
    r1.tick()  # rank 1's last heartbeat, then SIGSTOP
    for _ in range(30):
        clock.t += 1
        r0.tick()
    assert value(registry, "stepwatch_rank_collective_wait_seconds", rank="0") == pytest.approx(30)
    assert value(registry, "stepwatch_rank_collective_wait_seconds", rank="1") == 0
    assert value(registry, "stepwatch_rank_progress_age_seconds", rank="1") == pytest.approx(30)


def test_a_silent_rank_counts_from_its_last_heartbeat_once_the_others_run_a_request() -> None:
    clock = Clock()
    r0, r1, _ch, registry = two_ranks(clock)
    r1.tick()  # idle, then frozen before the next request
    clock.t += 1
    r0.begin_request()
    r0.timeline.in_since = clock.t
    clock.t += 20
    r0.tick()
    assert value(registry, "stepwatch_rank_progress_age_seconds", rank="1") == pytest.approx(21)
    assert value(registry, "stepwatch_rank_progress_age_seconds", rank="0") == pytest.approx(20)


def test_a_rank_frozen_between_requests_counts_while_rank_0_waits_to_send_it_the_next() -> None:
    """Rank 0 broadcasts each request to the others before it begins it; a follower frozen while idle leaves it
    waiting in that send (stamped by the worker), not in a request: the frozen rank still counts from its last
    heartbeat, so the stall reads as a collective hang (unstamped, the two-rank stall drill reads as a hung worker)."""
    clock = Clock()
    r0, r1, _ch, registry = two_ranks(clock)
    r1.tick()  # idle, then frozen
    clock.t += 1
    seen: list[tuple[float, float]] = []

    def send(box: list[object]) -> None:
        for _ in range(20):
            clock.t += 1
            r0.tick()
        seen.append((value(registry, "stepwatch_rank_collective_wait_seconds", rank="0"),
                     value(registry, "stepwatch_rank_progress_age_seconds", rank="1")))

    r0.stamp(send)([{"op": "generate"}])
    assert seen == [(pytest.approx(20), pytest.approx(21))]
    assert value(registry, "stepwatch_rank_progress_age_seconds", rank="0") == 0  # not in a request


def test_the_output_all_gather_of_a_transformer_call_is_stamped_and_uninstall_restores_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The context-parallel output gather is waited on lazily, outside _wait_tensor: a rank waiting in it looked
    like a rank stuck in its own code.  Installed, each gather adds one (arrival, departure) stamp."""
    import torch
    from diffusers.hooks import context_parallel

    class Mesh:
        def get_group(self) -> None:
            return None

    monkeypatch.setattr(context_parallel.AllGatherFunction, "apply", staticmethod(lambda t, dim, group: t * 2))
    before = context_parallel.EquipartitionSharder.__dict__["unshard"]
    rep = RankReporter(interval=None, rank=0, world=1)
    try:
        rep.begin_request()
        out = context_parallel.EquipartitionSharder.unshard(torch.ones(2), 0, Mesh())
        assert out.tolist() == [2.0, 2.0] and len(rep.timeline.marks) == 1
    finally:
        rep.close()
    assert context_parallel.EquipartitionSharder.__dict__["unshard"] is before
    context_parallel.EquipartitionSharder.unshard(torch.ones(2), 0, Mesh())
    assert len(rep.timeline.marks) == 1  # uninstalled: the gather is diffusers' own again, no stamp


def test_a_lost_chunk_drops_that_request_and_nothing_else() -> None:
    clock = Clock()
    r0, r1, ch, registry = two_ranks(clock)
    for rep in (r0, r1):
        rep.begin_request()
    collectives([r0.timeline, r1.timeline], clock, 10, [0.01, 0.01], [0, 0])
    r1.tick()
    ch.queue.clear()  # lost on the way
    collectives([r0.timeline, r1.timeline], clock, 10, [0.01, 0.01], [0, 0])
    for rep in (r0, r1):
        rep.end_request()
        rep.timeline.steps(0, 4)
    r1.tick()
    r0.tick()
    assert not r0.aligner.requests
    request(r0, r1, clock, compute=[0.01, 0.02], late_exit=[0, 0])
    r1.tick()
    r0.tick()
    assert value(registry, "stepwatch_rank_skew_ratio") == pytest.approx(1.0, rel=0.01)


def test_shipping_never_raises_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def send(self, chunk: Chunk) -> None:
            raise ConnectionError("store gone")

        def receive(self) -> list[Chunk]:
            raise ConnectionError("store gone")

    r1 = RankReporter(channel=Broken(), interval=None, rank=1, world=2, hook=False)
    r1.tick()
    r1.tick()
    assert sum("shipping rank timings failed" in r.message for r in caplog.records) == 1


def test_a_shipper_sends_each_stamp_once_and_lets_a_finished_request_go() -> None:
    clock = Clock()
    tl = Timeline(clock)
    sh = Shipper(tl, 1)
    tl.begin()
    tl.marks.append((1.0, 2.0))
    c1 = sh.cut()
    tl.marks.append((3.0, 4.0))
    tl.end()
    c2 = sh.cut()
    tl.steps(0, 2)
    c3 = sh.cut()
    assert list(c1.marks[0][1]) == [1.0, 2.0] and c2.marks[0] == (1, c2.marks[0][1])
    assert list(c2.marks[0][1]) == [3.0, 4.0] and c3.ended == {0: 2} and not tl.by_request


def test_the_store_channel_carries_chunks_through_a_real_tcpstore() -> None:
    import torch.distributed as dist

    from stepwatch.procs import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    follower, leader = StoreChannel(client, 2), StoreChannel(server, 2)
    assert leader.receive() == []
    follower.send(Chunk(1, 5.0, inflight=True))
    follower.send(Chunk(1, 6.0))
    got = leader.receive()
    assert [(c.rank, c.sent, c.inflight) for c in got] == [(1, 5.0, True), (1, 6.0, False)]
    assert leader.receive() == []


def test_the_aligner_charges_from_the_earliest_release(monkeypatch: Any) -> None:
    a = Aligner(2, Clock())
    a.add(Chunk(0, 0.0, marks={0: (0, _flat([(0, 1), (2, 3), (4, 5)]))}))
    a.add(Chunk(1, 0.0, marks={0: (0, _flat([(0.5, 1), (2.5, 3.5), (5, 5.5)]))}))
    assert a.charge() == {0: pytest.approx(1 + 1), 1: pytest.approx(1.5 + 2)}


def _flat(pairs: list[tuple[float, float]]) -> Any:
    from array import array

    return array("d", [t for p in pairs for t in p])


def test_the_stamped_wait_records_arrival_and_departure_and_passes_errors_through() -> None:
    clock = Clock()
    tl = Timeline(clock)
    tl.begin()

    def wait(t: Any) -> Any:
        assert tl.in_since == 1000.0  # inside: the heartbeat says so
        clock.t += 0.5
        if t is None:
            raise RuntimeError("gloo timeout")
        return t

    stamped = stamping(wait, tl)
    assert stamped("x") == "x"
    with pytest.raises(RuntimeError, match="gloo timeout"):
        clock.t = 1000.0
        stamped(None)
    assert tl.marks == [(1000.0, 1000.5), (1000.0, 1000.5)] and tl.in_since is None and tl.progress == 1000.5


@pytest.mark.heavy
def test_bench_overhead_puts_the_rank_timing_beside_the_old_one_on_two_ranks() -> None:
    import json
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "stepwatch.cli", "bench", "overhead", "--cases", "two_ranks",
                        "--rounds", "3", "--json"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])["two_ranks"]
    assert r["ranks"] == 2 and r["rounds"] == 3 and set(r["request_ms"]) == {"bare", "before", "now"}
    assert all(v > 0 for v in r["request_ms"].values()) and all(v > 0 for v in r["per_collective_ns"].values())
    assert {"ratio_now_to_before", "ratio_now_to_bare", "ratio_before_to_bare"} <= set(r)


def test_a_long_request_still_shipping_is_kept_and_a_silent_one_is_dropped_without_gauges() -> None:
    """Staleness counts from the last chunk that carried the request, not from its first: a request that
    runs for ten minutes is still aligned; one nothing is heard of for STALE_REQUEST_S is dropped as broken
    (no gauge from a half), and a late chunk of it is not taken for a new request."""
    clock = Clock()
    r0, r1, _ch, registry = two_ranks(clock)
    for rep in (r0, r1):
        rep.begin_request()
    for _ in range(10):  # a minute of collectives (12 s each on rank 1), ten times, shipped every minute
        collectives([r0.timeline, r1.timeline], clock, 5, [6.0, 12.0], [0, 0])
        r1.tick()
        r0.tick()
    assert 0 in r0.aligner.requests
    for rep in (r0, r1):
        rep.end_request()
        rep.timeline.steps(0, 4)
    r1.tick()
    r0.tick()
    assert value(registry, "stepwatch_rank_skew_ratio") == pytest.approx(1.0, rel=0.01)
    for rep in (r0, r1):
        rep.begin_request()
    collectives([r0.timeline, r1.timeline], clock, 5, [0.02, 0.02], [0, 0])
    r0.tick()  # rank 1 freezes before shipping any of request 1
    clock.t += 121
    r0.tick()
    assert 1 not in r0.aligner.requests and 1 in r0.aligner.retired
    r1.tick()  # it thaws: its stamps of request 1 arrive late and are let go
    r0.tick()
    assert r0.aligner.late >= 1 and 1 not in r0.aligner.requests
    assert value(registry, "stepwatch_rank_skew_ratio") == pytest.approx(1.0, rel=0.01)  # not from a half


def test_ranks_that_count_different_requests_are_not_compared() -> None:
    """Rank 1 missed a begin: its request 1 is rank 0's request 2.  It began after rank 0 had left that
    request's first collective, so the request is dropped, and logged, instead of read as a skew."""
    clock = Clock()
    r0, r1, _ch, registry = two_ranks(clock)
    request(r0, r1, clock, compute=[0.01, 0.01], late_exit=[0, 0])
    r0.begin_request()  # request 1 on rank 0 only
    collectives([r0.timeline, Timeline(clock)], clock, 10, [0.01, 0.01], [0, 0])
    r0.end_request()
    r0.timeline.steps(1, 4)
    r1.begin_request()  # rank 1's "request 1" starts now, after rank 0 left request 1's first collective
    collectives([r0.timeline, r1.timeline], clock, 10, [0.01, 0.03], [0, 0])
    r1.end_request()
    r1.timeline.steps(1, 4)
    r1.tick()
    r0.tick()
    assert r0.aligner.mismatched == 1 and 1 in r0.aligner.retired
    assert value(registry, "stepwatch_rank_skew_ratio") == pytest.approx(0, abs=1e-9)  # request 0's, kept


def test_a_request_never_ended_is_closed_by_the_next_and_stamps_between_requests_are_dropped() -> None:
    clock = Clock()
    tl = Timeline(clock)
    sh = Shipper(tl, 1)
    tl.marks.append((1.0, 2.0))  # before any request: nowhere
    tl.begin()
    tl.marks.append((3.0, 4.0))
    tl.begin()  # request 0's end failed: it is closed with 0 steps, so it leaves with the next cut
    tl.marks.append((5.0, 6.0))
    tl.end()
    tl.marks.append((7.0, 8.0))  # between requests: nowhere
    c = sh.cut()
    assert c.ended == {0: 0} and list(c.marks[0][1]) == [3.0, 4.0] and list(c.marks[1][1]) == [5.0, 6.0]
    assert set(c.began) == {0, 1} and 0 not in tl.by_request and tl.by_request[1] == [(5.0, 6.0)]


def test_a_chunk_goes_as_json_and_anything_else_on_the_queue_is_skipped() -> None:
    import pickle

    import torch.distributed as dist

    from stepwatch.procs import free_port

    c = Chunk(1, 5.0, marks={3: (2, _flat([(1.0, 2.5)]))}, ended={3: 8}, ended_cpu_wait={3: 0.25},
              began={3: 0.5}, in_since=None, progress=2.5, inflight=True, request=3, cpu_wait=1.5)
    assert Chunk.decode(c.encode()) == c
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    leader = StoreChannel(server, 2)
    server.queue_push("stepwatch/ranks/1", pickle.dumps(c))  # not ours: never unpickled
    server.queue_push("stepwatch/ranks/1", b'{"rank": 1}')
    StoreChannel(server, 2).send(c)
    assert leader.receive() == [c] and leader.undecodable == 2


def test_a_follower_stops_pushing_when_rank_0_stops_popping() -> None:
    import torch.distributed as dist

    from stepwatch.exporter.rank_timeline import MAX_QUEUED_CHUNKS
    from stepwatch.procs import free_port

    server = dist.TCPStore("127.0.0.1", free_port(), 2, is_master=True, wait_for_workers=False)
    follower = StoreChannel(server, 2)
    for i in range(MAX_QUEUED_CHUNKS + 5):
        follower.send(Chunk(1, float(i)))
    assert int(server.queue_len("stepwatch/ranks/1")) == MAX_QUEUED_CHUNKS and follower.dropped == 5


def test_one_reporter_per_process_group_and_its_keys_carry_the_group(tmp_path: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        first = RankReporter(interval=None, rank=1, world=2, hook=False)
        assert isinstance(first.channel, StoreChannel) and first.channel.prefix.startswith("stepwatch/ranks/")
        with pytest.raises(ValueError, match="already runs in this process"):
            RankReporter(interval=None, rank=1, world=2, hook=False)
        first.close()
        RankReporter(interval=None, rank=1, world=2, hook=False).close()
    finally:
        dist.destroy_process_group()


def test_bench_shipping_ticks_only_while_its_variant_is_timed() -> None:
    """The two-rank bench's shipping thread: parked while the other variants are timed, and ticking once
    per interval of the "now" variant's time, summed over requests shorter than the interval."""
    import time

    from stepwatch.bench.ranks import _Shipping

    ticks: list[float] = []
    ship = _Shipping(lambda: ticks.append(time.monotonic()), interval=0.1)
    try:
        time.sleep(0.3)  # the other variants: three intervals, no tick
        assert ticks == []
        for _ in range(8):  # eight 'now' requests of 0.04 s: 0.32 s of timed time, three intervals
            with ship.timed():
                time.sleep(0.04)
            n = len(ticks)
            time.sleep(0.05)
            assert len(ticks) == n  # nothing ships between the 'now' requests
        assert 1 <= len(ticks) <= 4
    finally:
        ship.close()


def test_a_wait_with_another_signature_is_stamped_all_the_same() -> None:
    clock = Clock()
    tl = Timeline(clock)
    tl.begin()

    def wait(t: Any, *, timeout: float = 1.0) -> Any:
        clock.t += timeout
        return t

    assert stamping(wait, tl)("x", timeout=0.25) == "x" and tl.marks == [(1000.0, 1000.25)]
