"""The service's dispatcher and worker-death paths, in-process: no request is run for nobody or left hanging."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from stepwatch.service import api
from stepwatch.service.config import parse
from stepwatch.service.engine import Admission, Service

CFG = parse({"pools": {"small": {"sizes": ["256x256"], "slo_seconds": 10}}, "warmup": []})


class RecordingWorker:
    """Stands in for the worker process (a separate test covers the real one): answers each generate at once."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.ready.set()
        self.proc = None
        self.seen: list[int] = []

    def call(self, msg: dict[str, Any]) -> Future[dict[str, Any]]:
        fut: Future[dict[str, Any]] = Future()
        self.seen.append(msg["request"]["seed"])
        fut.set_result({"op": "result", "seconds": 0.01, "images": [], "stages": {}})
        return fut

    def stop(self) -> None:
        pass


def req(seed: int) -> api.GenerationRequest:
    return api.GenerationRequest("p", 1, 256, 256, 4, 1.0, seed)


def test_a_ticket_whose_client_gave_up_is_not_run() -> None:
    svc = Service(CFG, CollectorRegistry())
    worker = RecordingWorker()
    svc.worker = worker  # type: ignore[assignment]
    abandoned = svc.scheduler.submit(req(1), "small")
    kept = svc.scheduler.submit(req(2), "small")
    assert abandoned.future.cancel()
    svc._dispatcher.start()
    try:
        assert kept.future.result(timeout=10)["op"] == "result"
        assert worker.seen == [2]
    finally:
        svc._stop.set()


def test_a_worker_that_cannot_restart_fails_the_queued_requests() -> None:
    svc = Service(CFG, CollectorRegistry())
    queued = [svc.scheduler.submit(req(i), "small") for i in range(3)]
    svc.fatal = "ImportError: no module named diffusers"
    t0 = time.monotonic()
    svc.on_worker_died(1)
    assert time.monotonic() - t0 < 1
    for t in queued:
        with pytest.raises(api.ApiError) as e:
            t.future.result(timeout=0)
        assert e.value.status == 503 and e.value.code == "worker_failed"
    assert svc.scheduler.snapshot()["small"]["depth"] == 0


def test_an_abandoned_admission_leaves_the_queue_and_a_running_one_is_left_alone() -> None:
    svc = Service(CFG, CollectorRegistry())
    pool = CFG.pool_for("256x256")
    running = Admission(req(1), pool, svc.scheduler.submit(req(1), "small"), time.monotonic())
    queued = Admission(req(2), pool, svc.scheduler.submit(req(2), "small"), time.monotonic())
    assert svc.scheduler.take(timeout=0) is running.ticket and running.ticket.future.set_running_or_notify_cancel()
    svc.abandon(queued)  # its client disconnected while it queued
    svc.abandon(running)  # too late: it runs, and its answer goes nowhere
    assert queued.ticket.future.cancelled() and not running.ticket.future.cancelled()
    assert svc.scheduler.snapshot()["small"]["depth"] == 0
