"""A small client for the Prometheus and Alertmanager HTTP APIs (stdlib only).

Used by the drills (watch alerts), the triage agent (run runbook checks) and
the dashboard proof (run every panel query).  Errors are PromError with the
server's message, never a bare HTTP exception.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


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


def _get(url: str, timeout: float) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        try:
            body = json.loads(e.read())
            msg = body.get("error") or body
        except Exception:
            msg = e.reason
        raise PromError(f"{url.split('?')[0]}: HTTP {e.code}: {msg}") from None
    except (urllib.error.URLError, OSError) as e:
        raise PromError(f"{url.split('?')[0]}: {getattr(e, 'reason', e)}") from None
    try:
        return json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError: an HTML page, a truncated body
        text = raw[:80].decode(errors="replace").strip()
        raise _not_api(url.split("?")[0], f"{type(e).__name__}: {e} ({text!r})") from None


class Prometheus:
    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _api(self, path: str, params: dict[str, Any] | None = None) -> Any:
        q = ("?" + urllib.parse.urlencode(params)) if params else ""
        body = _get(f"{self.url}/api/v1/{path}{q}", self.timeout)
        if not isinstance(body, dict) or "status" not in body:
            raise _not_api(f"{self.url}/api/v1/{path}", f"expected an object with 'status', got {_brief(body)}")
        if body.get("status") != "success":
            raise PromError(f"{path}: {body.get('errorType')}: {body.get('error')}")
        if "data" not in body:
            raise _not_api(f"{self.url}/api/v1/{path}", "'status' is success but there is no 'data'")
        return body["data"]

    def ready(self) -> bool:
        return _ready(self.url)

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


class Alertmanager:
    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def ready(self) -> bool:
        return _ready(self.url)

    def alerts(self) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v2/alerts"
        body = _get(url, self.timeout)
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


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan
