"""``stepwatch serve``: the practice inference service, an OpenAI-style image API and asynchronous video jobs.

One HTTP process (validation, per-pool queues, admission, metrics) in front of
one worker process that runs the instrumented diffusers pipeline under a
memory budget.  Loopback by default.  The API is in ``app.py``, the service
behind it in ``engine.py``, the worker in ``worker.py``.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from prometheus_client import disable_created_metrics

from stepwatch.procs import keep_address_space_returnable
from stepwatch.service import app
from stepwatch.service.config import ConfigError, ServiceConfig, load
from stepwatch.service.engine import Service

log = logging.getLogger("stepwatch.service")
DEFAULT_PORT = 8000


class _Given(argparse.Action):
    """Stores the value and notes that the flag was given, so a config file's value wins over the default."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="service YAML (default: the embedded practice config)")
    p.add_argument("--host", default="127.0.0.1", action=_Given,
                   help="bind address (default: the config's host, else %(default)s; loopback)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, action=_Given,
                   help="port (default: the config's port, else %(default)s)")
    p.add_argument("--ranks", type=int, choices=(1, 2), help="parallel degree (2: Ulysses over gloo)")
    p.add_argument("--compile-backend", choices=("inductor", "aot_eager", "eager"),
                   help="override compile.backend")
    p.add_argument("--no-compile", action="store_true", help="serve eager")
    p.add_argument("--admin-token", help="enable POST /admin/knobs with this bearer token (loopback only)")
    p.add_argument("--instance-id", help="instance id in metrics and answers (default: hostname:port)")


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    """The config file (or the embedded default) with the flags given on the command line applied.

    ``--port`` and ``--host`` override only when given: otherwise the file's values hold, and the
    defaults without them.
    """
    given = getattr(args, "given", ())
    overrides: dict[str, Any] = {"host": args.host if "host" in given else None,
                                 "port": args.port if "port" in given else None, "ranks": args.ranks,
                                 "admin_token": args.admin_token, "instance_id": args.instance_id}
    cfg = load(args.config, overrides)
    if args.compile_backend:
        cfg.compile.backend = args.compile_backend
    if args.no_compile:
        cfg.compile.enabled = False
    return cfg


def run(args: argparse.Namespace) -> int:
    disable_created_metrics()
    keep_address_space_returnable()  # the chunks queued for slow stream clients come and go in MBs
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        print(f"stepwatch serve: bad config: {e}", flush=True)
        return 2
    svc = Service(cfg)
    try:
        sock = app.bind(cfg.host, cfg.port)
    except OSError as e:
        print(f"stepwatch serve: cannot listen on {cfg.host}:{cfg.port}: {e.strerror}", flush=True)
        return 2
    svc.start()
    log.info("stepwatch serve on http://%s:%d (instance %s); warming up %s", cfg.host, sock.getsockname()[1],
             svc.instance_id, ", ".join(cfg.warmup) or "nothing")
    try:
        app.serve(svc, sock)
    finally:
        svc.stop()
        sock.close()
    return 0
