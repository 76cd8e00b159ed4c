"""The sidecar process: NVML GPU collector and sampled-quality prober, with its own /metrics.

Runs next to the inference container: reads the GPUs through NVML at scrape
time and probes output quality through the service's public API on a cadence
that stays within the probe budget.  It never imports torch (tested with torch
made unimportable); if NVML is absent it reports ``stepwatch_nvml_up 0`` and
keeps probing.  The command line is ``cli_sidecar``.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from stepwatch.exporter.sidecar.config import SidecarConfig
from stepwatch.exporter.sidecar.nvml import NvmlCollector
from stepwatch.exporter.sidecar.practice_gpus import PracticeGpus
from stepwatch.exporter.sidecar.prober import Prober
from stepwatch.exporter.sidecar.stream_probe import StreamProber
from stepwatch.exposition import serve_metrics
from stepwatch.thresholds import Thresholds

log = logging.getLogger("stepwatch.sidecar")

DEFAULT_PORT = 9465
PRACTICE_RETRY_S = 1.0  # stand-in GPUs appear when a drill writes their file: look again every second
DEFAULT_HOST = "127.0.0.1"


def _collector(registry: CollectorRegistry, practice: Path | None = None) -> tuple[NvmlCollector, str]:
    """The NVML collector on ``registry`` and what it found at start (so an absent NVML is logged now, once);
    with ``practice``, on the stand-in GPUs of that state file instead of NVML."""
    collector = (NvmlCollector(PracticeGpus(practice), retry_init_s=PRACTICE_RETRY_S) if practice is not None
                 else NvmlCollector())
    registry.register(collector)
    snap = collector.reader.read()
    return collector, (f"{len(snap.gpus)} GPU(s)" if snap.up else "unavailable (stepwatch_nvml_up 0)")


def _probers(cfg: SidecarConfig, registry: CollectorRegistry, thresholds: Thresholds) -> list[Prober]:
    """The image (or video) prober and, when a stream probe set is given, the drift prober beside it (on the
    same quality series; each has its own cadence within the probe budget)."""
    assert cfg.target is not None  # resolve_config refuses a prober without a target
    kw: dict[str, Any] = dict(registry=registry, baseline_dir=cfg.baseline_dir, thresholds=thresholds,
                              interval_s=cfg.interval_s, timeout_s=cfg.timeout_s,
                              timeout_margin_s=cfg.timeout_margin_s, initial_timeout_s=cfg.initial_timeout_s,
                              budget_ratio=cfg.budget_ratio, min_interval_s=cfg.min_interval_s,
                              retry_interval_s=cfg.retry_interval_s, not_ready_grace_s=cfg.not_ready_grace_s)
    out = [Prober(cfg.target, probe_set=cfg.probe_set, gate=cfg.gate, **kw)]
    if cfg.stream_probe_set is not None:
        out.append(StreamProber(cfg.target, probe_set=cfg.stream_probe_set, metrics=out[0].metrics, **kw))
    return out


def _on_signals(stop: threading.Event) -> Callable[[], None]:
    """SIGTERM/SIGINT set ``stop``; returns what puts the previous handlers back."""
    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():  # signals can only be caught there
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for s, h in previous.items():
            signal.signal(s, h)

    return restore


def _prober_thread(prober: Prober, stop: threading.Event) -> threading.Thread:
    thread = threading.Thread(target=prober.run_forever, args=(stop,), name=f"stepwatch-prober-{prober.probe_set.name}",
                              daemon=True)
    thread.start()
    return thread


def _supervise(probers: list[Prober], stop: threading.Event, threads: list[threading.Thread]) -> None:
    """Run the probers until ``stop``; a prober thread that dies is restarted.  ``threads`` holds each prober's
    current thread (same order), so the caller can join them even when this is interrupted."""
    for prober in probers:
        log.info("probing %s with probe set %r (%d probes, gate %s = %g dB, alert below %g dB); baselines in %s",
                 prober.target, prober.probe_set.name, len(prober.probe_set.items), prober.gate_kind,
                 prober.gate_db, prober.alert_below_db, prober.store.root)
        threads.append(_prober_thread(prober, stop))
    while not stop.wait(0.5):
        for n, prober in enumerate(probers):
            if not threads[n].is_alive():
                log.error("the prober thread of %r ended unexpectedly; restarting it", prober.probe_set.name)
                threads[n] = _prober_thread(prober, stop)


def serve(cfg: SidecarConfig, thresholds: Thresholds, host: str, port: int,
          stop: threading.Event | None = None) -> int:
    """Serve /metrics and probe until SIGTERM/SIGINT (or ``stop``); 1 when the port cannot be bound."""
    registry = CollectorRegistry()
    collector, nvml_state = _collector(registry, cfg.practice_gpus) if cfg.nvml else (None, "off")
    probers = _probers(cfg, registry, thresholds) if cfg.prober else []
    try:
        server, _ = serve_metrics(port, host, registry)
    except OSError as e:
        print(f"stepwatch sidecar: cannot listen on {host}:{port}: {e}", file=sys.stderr)
        return 1
    log.info("metrics on http://%s:%d/metrics; NVML: %s", host, server.server_address[1], nvml_state)
    stop = stop or threading.Event()
    restore_signals = _on_signals(stop)
    threads: list[threading.Thread] = []
    try:
        _supervise(probers, stop, threads)
    finally:
        stop.set()
        for prober, thread in zip(probers, threads, strict=False):
            thread.join(timeout=prober.request_timeout() + 2.0)
            prober.close(timeout=1.0)
        server.shutdown()
        server.server_close()
        if collector is not None:
            collector.close()
        restore_signals()
    log.info("stopped")
    return 0
