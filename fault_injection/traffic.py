"""Client load on the practice service: steady clients, open-loop arrivals, a client that repeats one call.

A drill's baseline traffic and its fault's own requests; ``running_traffic`` is the one ``traffic()`` of
LocalStack and FleetStack.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import httpx

from stepwatch import httpclient


def _http(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None, timeout: float = 600,
          via: httpx.Client | None = None) -> tuple[int, Any, Mapping[str, str]]:
    """(status, JSON body or text, headers) of one request; ``via`` reuses a client's connection.

    Error statuses are answers, not exceptions; a transport failure raises ``httpx.HTTPError``.
    """
    kwargs: dict[str, Any] = {"json": body, "headers": headers or {}, "timeout": timeout}
    r = via.request(method, url, **kwargs) if via is not None else httpclient.request(method, url, **kwargs)
    try:
        return r.status_code, r.json(), r.headers
    except ValueError:
        return r.status_code, r.text, r.headers


def set_knobs(service_url: str, admin_token: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """``POST /admin/knobs`` on one service; the knobs it now has, or RuntimeError naming the refusal."""
    status, body, _ = _http("POST", service_url + "/admin/knobs", knobs, {"Authorization": f"Bearer {admin_token}"})
    if status != 200:
        raise RuntimeError(f"admin knobs {knobs} on {service_url}: HTTP {status}: {body}")
    return dict(body)


class Traffic:
    """Steady client load: ``concurrency`` clients cycling through request bodies."""

    def __init__(self, service_url: str, bodies: list[dict[str, Any]], concurrency: int = 2,
                 pause: float = 0.0) -> None:
        self.url = service_url + "/v1/images/generations"
        self.bodies = bodies
        self.concurrency = concurrency
        self.pause = pause
        self.codes: dict[int, int] = {}
        self.latencies: list[tuple[float, float, int, str]] = []  # (end time, seconds, status, size)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self) -> Traffic:
        for i in range(self.concurrency):
            t = threading.Thread(target=self._client, args=(i,), daemon=True, name=f"stepwatch-traffic-{i}")
            t.start()
            self._threads.append(t)
        return self

    def add_client(self) -> None:
        """One more client, now (a ramp of load: the pool-short drill)."""
        t = threading.Thread(target=self._client, args=(len(self._threads),), daemon=True,
                             name=f"stepwatch-traffic-{len(self._threads)}")
        t.start()
        self._threads.append(t)

    def _client(self, i: int) -> None:
        """One client on one kept-alive connection, as an SDK client sends; 429s wait Retry-After (at most 2 s)."""
        k = i
        with httpclient.client(timeout=300) as via:
            while not self._stop.is_set():
                bodies = self.bodies  # once: a drill may swap the list meanwhile (prompt-mix-shift)
                status, headers = self._send({**bodies[k % len(bodies)], "seed": k}, via)
                if status == 429:
                    self._stop.wait(min(float(headers.get("Retry-After", "1")), 2.0))
                elif self.pause:
                    self._stop.wait(self.pause)
                k += max(1, self.concurrency)

    def _send(self, body: dict[str, Any], via: httpx.Client) -> tuple[int, Mapping[str, str]]:
        t = time.time()
        status: int
        headers: Mapping[str, str]
        try:
            status, _, headers = _http("POST", self.url, body, timeout=300, via=via)
        except httpx.HTTPError as e:
            status, headers = 0, {}
            with self._lock:
                self.errors.append(f"{type(e).__name__}: {e}")
        with self._lock:
            self.codes[status] = self.codes.get(status, 0) + 1
            self.latencies.append((time.time(), time.time() - t, status, str(body.get("size", ""))))
        return status, headers

    def median_by_size(self, start: float, end: float) -> dict[str, tuple[float, int]]:
        """(median seconds, count) of the 200s that ended in [start, end), per requested size: the baseline's
        typical request, exact (a histogram's p50 over a two-size mix sits between the sizes' modes and jumps
        from one to the other when the mix shifts slightly)."""
        with self._lock:
            rows = [(size, sec) for end_t, sec, status, size in self.latencies
                    if status == 200 and start <= end_t < end]
        out: dict[str, tuple[float, int]] = {}
        for size in sorted({size for size, _ in rows}):
            secs = [sec for sz, sec in rows if sz == size]
            out[size] = (statistics.median(secs), len(secs))
        return out

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.codes.values())


class Arrivals(Traffic):
    """Open-loop load: ``rate`` requests a second whatever the service answers, each on a thread of its own.

    Closed-loop clients (``Traffic``) wait for their answer, so a service that stops answering holds at
    most one request per client: the queue behind a hung worker never grows.  Users keep arriving, so
    behind a real one it does.  A request that waits ties up only its own thread (at most ``cap`` at once;
    past that an arrival is dropped and counted as status -1).  ``stop()`` ends the arrivals; the ones
    waiting keep their threads until the service answers them (``wait_answered``).
    """

    def __init__(self, service_url: str, body: dict[str, Any], rate: float, cap: int = 256) -> None:
        super().__init__(service_url, [body], concurrency=0)
        self.rate, self.cap = rate, cap
        self.waiting = 0  # arrivals not answered yet

    def start(self) -> Arrivals:
        t = threading.Thread(target=self._tick, daemon=True, name="stepwatch-arrivals")
        t.start()
        self._threads.append(t)
        return self

    def _tick(self) -> None:
        k, next_at = 0, time.monotonic()
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            next_at += 1.0 / self.rate
            k += 1
            with self._lock:
                full = self.waiting >= self.cap
                if full:
                    self.codes[-1] = self.codes.get(-1, 0) + 1
                else:
                    self.waiting += 1
            if not full:
                threading.Thread(target=self._one, args=({**self.bodies[0], "seed": k},), daemon=True,
                                 name="stepwatch-arrival").start()

    def _one(self, body: dict[str, Any]) -> None:
        try:
            with httpclient.client(timeout=300) as via:
                self._send(body, via)
        finally:
            with self._lock:
                self.waiting -= 1

    def wait_answered(self, timeout: float) -> bool:
        """True once every arrival has its answer (within ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while self.waiting and time.monotonic() < deadline:
            time.sleep(0.5)
        return not self.waiting


@contextmanager
def running_traffic(holder: Any, url: str, bodies: list[dict[str, Any]], concurrency: int,
                    pause: float) -> Iterator[Traffic]:
    """Clients on ``url`` for the ``with`` block, published as ``holder.active_traffic`` meanwhile (what a drill's
    checks read); the one stack.traffic() of LocalStack and FleetStack."""
    t = Traffic(url, bodies, concurrency, pause).start()
    holder.active_traffic = t
    try:
        yield t
    finally:
        t.stop()
        holder.active_traffic = None


class ClientLoop:
    """One client on a thread repeating a call until stopped (a user who resubmits, a viewer who reconnects):
    each call's outcome counted; one that raised counts as ``error``, noted, and waits a second."""

    def __init__(self, once: Callable[[], str], name: str, timeout_s: float) -> None:
        self.once, self.timeout_s = once, timeout_s
        self.outcomes: dict[str, int] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    def start(self) -> ClientLoop:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                outcome = self.once()
            except Exception as e:  # recorded; the drill judges by it
                self.errors.append(f"{type(e).__name__}: {e}")
                outcome = "error"
                self._stop.wait(1.0)
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s)
