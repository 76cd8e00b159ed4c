"""stepwatch sidecar: NVML GPU collector and sampled-quality prober, with its own /metrics.

Runs next to the inference container: reads the GPUs through NVML at scrape
time and probes output quality through the service's public API on a cadence
that stays within the probe budget.  It never imports torch; if NVML is absent
it reports ``stepwatch_nvml_up 0`` and keeps probing.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

log = logging.getLogger("stepwatch.sidecar")

DEFAULT_PORT = 9465
DEFAULT_HOST = "127.0.0.1"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="the service's base URL, e.g. http://127.0.0.1:8000 (or `target` in --config)")
    p.add_argument("--config", help="YAML config: probe_set, baseline_dir, gate, interval_s, timeout_s, ...")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port of /metrics (default %(default)s; 0 = any)")
    p.add_argument("--host", default=DEFAULT_HOST, help="address of /metrics (default %(default)s; 0.0.0.0 in a pod)")
    p.add_argument("--baseline-dir", help="baseline root folder (default: the config's, else ./baselines)")
    p.add_argument("--probe-set", help="probe set YAML (default: the config's, else 20 probes at 256x256 x 8 steps)")
    p.add_argument("--gate", help="gate kind the probe set guards: a key of quality.gates_db or `video` "
                                  "(default: the probe set's, else quality.default_gate)")
    p.add_argument("--interval", type=float, help="seconds between probe runs (default: from the probe budget)")
    p.add_argument("--timeout", type=float, help="seconds per probe request (default: a few seconds beyond the "
                                                 "slowest probe seen)")
    p.add_argument("--thresholds", help="thresholds YAML (default: the packaged alerts/thresholds.yaml)")
    p.add_argument("--no-nvml", action="store_true", help="do not read GPUs")
    p.add_argument("--no-prober", action="store_true", help="do not probe quality (GPU metrics only)")


def quiet_http_logs() -> None:
    """httpx logs every request at INFO: one line per probe is noise, failures are logged by the prober."""
    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        logging.getLogger("httpx").setLevel(logging.WARNING)


def resolve_config(args: argparse.Namespace) -> Any:
    """The config file with the CLI flags applied; raises ConfigError naming the bad key."""
    from stepwatch.exporter.sidecar.config import (
        ConfigError,
        SidecarConfig,
        check_target,
        load_config,
        load_probe_set,
        positive,
    )

    cfg = load_config(args.config) if args.config else SidecarConfig()
    kw: dict[str, Any] = {}
    if args.target:
        kw["target"] = check_target(args.target, "--target")
    if args.baseline_dir:
        kw["baseline_dir"] = Path(args.baseline_dir)
    if args.probe_set:
        kw["probe_set"] = load_probe_set(args.probe_set)
    if args.gate:
        kw["gate"] = args.gate
    if args.interval is not None:
        kw["interval_s"] = positive(args.interval, "--interval")
    if args.timeout is not None:
        kw["timeout_s"] = positive(args.timeout, "--timeout")
    if args.thresholds:
        kw["thresholds"] = Path(args.thresholds)
    if args.no_nvml:
        kw["nvml"] = False
    if args.no_prober:
        kw["prober"] = False
    cfg = replace(cfg, **kw)
    if cfg.prober and not cfg.target:
        raise ConfigError("target: missing (give --target URL or `target:` in the config, or --no-prober)")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port: {args.port} is not a port")
    return cfg


def run(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry, start_http_server

    from stepwatch.alerts.thresholds import ThresholdsError, load
    from stepwatch.exporter.sidecar.config import ConfigError, check_gate
    from stepwatch.exporter.sidecar.nvml import NvmlCollector
    from stepwatch.exporter.sidecar.prober import Prober

    try:
        cfg = resolve_config(args)
        thresholds = load(cfg.thresholds)
        gate = cfg.probe_set.gate_kind(cfg.gate) or thresholds.quality.default_gate
        check_gate(thresholds.quality, gate, "gate" if cfg.gate or not cfg.probe_set.gate else "probe_set.gate")
    except (ConfigError, ThresholdsError) as e:
        print(f"stepwatch sidecar: bad config: {e}", file=sys.stderr)
        return 2

    quiet_http_logs()
    registry = CollectorRegistry()
    collector = None
    nvml_state = "off"
    if cfg.nvml:
        collector = NvmlCollector()
        registry.register(collector)
        snap = collector.reader.read()  # at start, so an absent NVML is logged now, once
        nvml_state = f"{len(snap.gpus)} GPU(s)" if snap.up else "unavailable (stepwatch_nvml_up 0)"
    prober = None
    if cfg.prober:
        prober = Prober(cfg.target, registry=registry, baseline_dir=cfg.baseline_dir, probe_set=cfg.probe_set,
                        thresholds=thresholds, gate=cfg.gate, interval_s=cfg.interval_s, timeout_s=cfg.timeout_s,
                        timeout_margin_s=cfg.timeout_margin_s, initial_timeout_s=cfg.initial_timeout_s,
                        budget_ratio=cfg.budget_ratio, min_interval_s=cfg.min_interval_s,
                        retry_interval_s=cfg.retry_interval_s)
    try:
        server, _ = start_http_server(args.port, args.host, registry)
    except OSError as e:
        print(f"stepwatch sidecar: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    port = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics; NVML: %s", args.host, port, nvml_state)

    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():  # signals can only be caught there
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    thread = None
    if prober is not None:
        log.info("probing %s with probe set %r (%d probes, gate %s = %g dB, alert below %g dB); baselines in %s",
                 prober.target, prober.probe_set.name, len(prober.probe_set.items), prober.gate_kind,
                 prober.gate_db, prober.alert_below_db, prober.store.root)
        thread = threading.Thread(target=prober.run_forever, args=(stop,), name="stepwatch-prober", daemon=True)
        thread.start()
    try:
        while not stop.wait(0.5):
            if thread is not None and not thread.is_alive():
                log.error("the prober thread ended unexpectedly; restarting it")
                thread = threading.Thread(target=prober.run_forever, args=(stop,),  # type: ignore[union-attr]
                                          name="stepwatch-prober", daemon=True)
                thread.start()
    finally:
        stop.set()
        if thread is not None and prober is not None:
            thread.join(timeout=prober.request_timeout() + 2.0)
            prober.close(timeout=1.0)
        server.shutdown()
        server.server_close()
        if collector is not None:
            collector.close()
        for s, h in previous.items():
            signal.signal(s, h)
    log.info("stopped")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="stepwatch sidecar", description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
