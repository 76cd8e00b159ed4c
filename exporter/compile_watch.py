"""torch.compile events, attributed to the request (and so the shape) that caused them.

Dynamo's compile callbacks are process-global; one watcher registers them once
and hands each event to whichever instrumented pipeline is running a request
on the compiling thread.  A compile with no request in flight is reported to
every subscriber's ``on_orphan_compile``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

Sink = Callable[[float, float], None]  # (host start, seconds)


class _Watch:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscribers: list[Any] = []
        self._local = threading.local()
        self._installed = False
        self._start_cb = self._on_start
        self._end_cb = self._on_end
        self._handler: Any = None

    def ensure(self) -> None:
        """Re-register if someone cleared Dynamo's callbacks (torch._dynamo.reset() does)."""
        h = self._handler
        if h is not None and self._subscribers and self._start_cb not in h.start_callbacks:
            with self._lock:
                if self._start_cb not in h.start_callbacks:
                    h.register_start_callback(self._start_cb)
                    h.register_end_callback(self._end_cb)

    def subscribe(self, sub: Any) -> None:
        with self._lock:
            if sub not in self._subscribers:
                self._subscribers.append(sub)
            if not self._installed:
                self._install()

    def unsubscribe(self, sub: Any) -> None:
        with self._lock:
            if sub in self._subscribers:
                self._subscribers.remove(sub)
            if not self._subscribers and self._installed:
                self._uninstall()

    def set_sink(self, sink: Sink | None) -> Sink | None:
        prev = getattr(self._local, "sink", None)
        self._local.sink = sink
        return prev

    def _install(self) -> None:
        try:
            from torch._dynamo.callback import callback_handler  # lazy: keeps torch out of the sidecar
        except Exception:  # torch without dynamo: nothing to watch
            return
        self._handler = callback_handler
        callback_handler.register_start_callback(self._start_cb)
        callback_handler.register_end_callback(self._end_cb)
        self._installed = True

    def _uninstall(self) -> None:
        from torch._dynamo.callback import callback_handler  # lazy: keeps torch out of the sidecar

        for remove, cb in ((callback_handler.remove_start_callback, self._start_cb),
                           (callback_handler.remove_end_callback, self._end_cb)):
            try:
                remove(cb)
            except ValueError:
                pass
        self._installed = False

    def _on_start(self, args: Any) -> None:
        if _is_dynamo(args):
            self._local.started = time.perf_counter()

    def _on_end(self, args: Any) -> None:
        if not _is_dynamo(args):
            return
        start = getattr(self._local, "started", None)
        if start is None:
            return
        self._local.started = None
        seconds = time.perf_counter() - start
        sink = getattr(self._local, "sink", None)
        if sink is not None:
            sink(start, seconds)
            return
        for sub in list(self._subscribers):
            sub.on_orphan_compile(start, seconds)


def _is_dynamo(args: Any) -> bool:
    trigger = getattr(args, "callback_trigger", None)
    return trigger is None or getattr(trigger, "name", "DYNAMO") == "DYNAMO"


WATCH = _Watch()
