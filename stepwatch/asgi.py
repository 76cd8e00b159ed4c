"""Serving an ASGI app (FastAPI, Starlette) on uvicorn in a thread, for the in-process servers.

The triage webhook receiver and the drills' webhook sink both run inside a process that
does other work, so they serve from a daemon thread on a socket bound up front.  The
practice service runs uvicorn as its main loop instead (``service/app.py``).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


class ThreadedServer:
    """uvicorn serving an ASGI app on a socket bound at construction, in a daemon thread.

    Binding first gives the caller the port (``port=0`` picks a free one) and an
    OSError it can report before anything runs.
    """

    def __init__(self, app: Any, host: str, port: int, name: str = "asgi-http") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = _listen(family, host, port)
        self.url = f"http://{host if family == socket.AF_INET else f'[{host}]'}:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                        name=name)

    def start(self, timeout: float = 10.0) -> None:
        """Serve, and return once uvicorn accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        if not self.server.started:
            self.stop()
            raise OSError(f"the HTTP server on {self.url} did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.sock.close()


def _listen(family: socket.AddressFamily, host: str, port: int) -> socket.socket:
    """A listening socket, as http.server made it (address reuse on); a failure is the OS's plain OSError."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock
