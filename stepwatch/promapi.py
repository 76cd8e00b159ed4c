"""A small client for the Prometheus and Alertmanager HTTP APIs, on the project's one HTTP client.

Used by the drills (watch alerts), the triage agent (run runbook checks) and
the dashboard proof (run every panel query).  Errors are PromError with the
server's message, never a bare HTTP exception.  Each Prometheus or
Alertmanager object holds one keep-alive client (``stepwatch.httpclient``), so
a test can run it in-process with ``httpclient.use_transport``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from stepwatch import httpclient

_A = TypeVar("_A", bound="_Api")


class PromError(RuntimeError):
    pass


@dataclass(frozen=True)
class Sample:
    labels: dict[str, str]
    value: float

    def label(self, key: str, default: str = "") -> str:
        return self.labels.get(key, default)


def _not_api(where: str, detail: object) -> PromError:
    return PromError(f"{where}: not a Prometheus API answer: {detail}")


@contextmanager
def _shape(where: str) -> Iterator[None]:
    """An answer of the wrong shape (a proxy's page, another API) becomes a PromError, not a KeyError."""
    try:
        yield
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
        raise _not_api(where, f"{type(e).__name__}: {e}") from None


class _Api:
    """One keep-alive client to one server (closed by ``close`` or ``with``); every answer is JSON or a PromError."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        # Redirects followed, as urllib did: a server behind a path-rewriting proxy still answers.
        self._client = httpclient.client(timeout=timeout, follow_redirects=True)

    def close(self) -> None:
        self._client.close()

    def __enter__(self: _A) -> _A:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ready(self) -> bool:
        """True when ``/-/ready`` answers 200; any failure is just 'not yet'."""
        try:
            return self._client.get(f"{self.url}/-/ready", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def get(self, url: str, params: dict[str, Any] | None = None) -> Any:
        """GET ``url`` and decode its JSON; HTTP, connection and decoding failures are PromError."""
        try:
            r = self._client.get(url, params=params)
        except httpx.HTTPError as e:
            raise PromError(f"{url}: {str(e) or type(e).__name__}") from None
        if r.status_code >= 400:
            raise PromError(f"{url}: HTTP {r.status_code}: {_error_message(r)}")
        try:
            return json.loads(r.content)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError: an HTML page, a truncated body
            text = r.content[:80].decode(errors="replace").strip()
            raise _not_api(url, f"{type(e).__name__}: {e} ({text!r})") from None


def _error_message(r: httpx.Response) -> Any:
    """Prometheus' ``error`` field of an error answer, else the status' reason phrase."""
    try:
        body = json.loads(r.content)
        return body.get("error") or body
    except Exception:
        return r.reason_phrase


class Prometheus(_Api):
    """Prometheus' HTTP API (``/api/v1``): queries, alerts, rules, targets, series."""

    def _api(self, path: str, params: dict[str, Any] | None = None) -> Any:
        body = self.get(f"{self.url}/api/v1/{path}", params)
        if not isinstance(body, dict) or "status" not in body:
            raise _not_api(f"{self.url}/api/v1/{path}", f"expected an object with 'status', got {_brief(body)}")
        if body.get("status") != "success":
            raise PromError(f"{path}: {body.get('errorType')}: {body.get('error')}")
        if "data" not in body:
            raise _not_api(f"{self.url}/api/v1/{path}", "'status' is success but there is no 'data'")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[Sample]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._api("query", params)
        with _shape(f"{self.url}/api/v1/query"):
            if data["resultType"] == "scalar":
                return [Sample({}, _num(data["result"][1]))]
            if data["resultType"] != "vector":
                raise PromError(f"query {expr!r}: expected a vector, got {data['resultType']}")
            return [Sample(dict(r["metric"]), _num(r["value"][1])) for r in data["result"]]

    def value(self, expr: str, default: float | None = None) -> float | None:
        """The single value of an expression (max over series), or default when empty."""
        res = self.query(expr)
        vals = [s.value for s in res if not math.isnan(s.value)]
        return max(vals) if vals else default

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[tuple[dict[str, str],
                                                                                         list[tuple[float, float]]]]:
        data = self._api("query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                         "step": f"{step:g}"})
        with _shape(f"{self.url}/api/v1/query_range"):
            return [(dict(r["metric"]), [(float(t), _num(v)) for t, v in r["values"]]) for r in data["result"]]

    def alerts(self) -> list[dict[str, Any]]:
        """Active alerts (pending and firing) with labels, annotations, state, activeAt."""
        data = self._api("alerts")
        with _shape(f"{self.url}/api/v1/alerts"):
            return _dicts(data["alerts"])

    def firing(self) -> list[dict[str, Any]]:
        return [a for a in self.alerts() if a.get("state") == "firing"]

    def rules(self) -> list[dict[str, Any]]:
        data = self._api("rules")
        with _shape(f"{self.url}/api/v1/rules"):
            return _dicts([r for g in data["groups"] for r in g["rules"]])

    def targets(self) -> list[dict[str, Any]]:
        data = self._api("targets")
        with _shape(f"{self.url}/api/v1/targets"):
            return _dicts(data["activeTargets"])

    def series(self, match: str) -> list[dict[str, str]]:
        data = self._api("series", {"match[]": match})
        with _shape(f"{self.url}/api/v1/series"):
            return _dicts(data)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.ready():
                return
            time.sleep(0.25)
        raise PromError(f"{self.url} not ready after {timeout:.0f}s")

    def wait_targets_up(self, jobs: set[str] | None = None, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        last: list[dict[str, Any]] = []
        while time.time() < deadline:
            try:
                last = [t for t in self.targets() if jobs is None or t["labels"].get("job") in jobs]
            except PromError:
                last = []
            if last and all(t.get("health") == "up" for t in last):
                return
            time.sleep(0.5)
        state = ", ".join(f"{t['labels'].get('job')}={t.get('health')} ({t.get('lastError', '')})" for t in last)
        raise PromError(f"targets not up after {timeout:.0f}s: {state or 'none'}")


class Alertmanager(_Api):
    """Alertmanager's HTTP API (``/api/v2``): the alerts it holds, in every state."""

    def alerts(self) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v2/alerts"
        body = self.get(url)
        with _shape(url):
            return _dicts(body)


def _dicts(value: Any) -> list[Any]:
    """A JSON list of objects, or a TypeError that ``_shape`` turns into a PromError."""
    if not isinstance(value, list) or not all(isinstance(x, dict) for x in value):
        raise TypeError(f"expected a list of objects, got {_brief(value)}")
    return list(value)


def _brief(value: Any) -> str:
    text = json.dumps(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan
