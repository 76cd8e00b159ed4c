"""The Prometheus and Alertmanager client in-process: ``httpclient.use_transport`` swaps the network out.

Each case answers through an ``httpx.MockTransport``, so no socket is opened: success, Prometheus'
error JSON on an HTTP error, a body that is not JSON, an answer of the wrong shape, and a
connection that fails.  The messages are what the drills and triage print.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import pytest

from stepwatch import httpclient
from stepwatch.promapi import Alertmanager, PromError, Prometheus

URL = "http://prom.test:9090"
Handler = Callable[[httpx.Request], httpx.Response]


@pytest.fixture
def served() -> Iterator[Callable[[Handler], Prometheus]]:
    """``served(handler)``: a Prometheus client whose every request ``handler`` answers in-process."""
    made: list[Prometheus] = []

    def make(handler: Handler) -> Prometheus:
        with httpclient.use_transport(httpx.MockTransport(handler)):
            prom = Prometheus(URL, timeout=1.0)
        made.append(prom)
        return prom

    yield make
    for prom in made:
        prom.close()


def _vector(*values: float) -> dict[str, object]:
    return {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"instance": f"h{i}"}, "value": [1700000000.0, str(v)]} for i, v in enumerate(values)]}}


def test_query_success_sends_the_expression_and_time(served: Callable[[Handler], Prometheus]) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=_vector(0.5, 2.0))

    prom = served(handler)
    samples = prom.query('sum(rate(x{a="b c"}[1m]))', at=1700000000.0)
    assert [(s.label("instance"), s.value) for s in samples] == [("h0", 0.5), ("h1", 2.0)]
    assert prom.value("x") == 2.0
    q = seen[0].url.params
    assert seen[0].url.path == "/api/v1/query" and q["query"] == 'sum(rate(x{a="b c"}[1m]))'
    assert q["time"] == "1700000000.000"


def test_one_keep_alive_client_per_object(served: Callable[[Handler], Prometheus]) -> None:
    prom = served(lambda request: httpx.Response(200, json=_vector(1.0)))
    client = prom._client
    prom.query("a")
    prom.query("b")
    assert prom._client is client and not client.is_closed
    prom.close()
    assert client.is_closed


def test_http_error_carries_prometheus_error_message(served: Callable[[Handler], Prometheus]) -> None:
    body = {"status": "error", "errorType": "bad_data", "error": 'parse error at char 5: unexpected "}"'}
    prom = served(lambda request: httpx.Response(400, json=body))
    with pytest.raises(PromError) as e:
        prom.query("up{")
    assert str(e.value) == f'{URL}/api/v1/query: HTTP 400: parse error at char 5: unexpected "}}"'


def test_http_error_without_json_gives_the_reason(served: Callable[[Handler], Prometheus]) -> None:
    prom = served(lambda request: httpx.Response(503, text="<html>down</html>"))
    with pytest.raises(PromError, match=r"/api/v1/alerts: HTTP 503: Service Unavailable$"):
        prom.alerts()


def test_error_status_in_a_200_answer(served: Callable[[Handler], Prometheus]) -> None:
    body = {"status": "error", "errorType": "timeout", "error": "query timed out"}
    prom = served(lambda request: httpx.Response(200, json=body))
    with pytest.raises(PromError, match=r"^query: timeout: query timed out$"):
        prom.query("up")


def test_non_json_body(served: Callable[[Handler], Prometheus]) -> None:
    prom = served(lambda request: httpx.Response(200, text="<html><body>Sign in</body></html>"))
    with pytest.raises(PromError) as e:
        prom.query("up")
    msg = str(e.value)
    assert msg.startswith(f"{URL}/api/v1/query: not a Prometheus API answer: JSONDecodeError")
    assert "'<html><body>Sign in</body></html>'" in msg


def test_wrongly_shaped_answers(served: Callable[[Handler], Prometheus]) -> None:
    prom = served(lambda request: httpx.Response(200, json=[1, 2]))
    with pytest.raises(PromError, match=r"not a Prometheus API answer: expected an object with 'status', got list"):
        prom.query("up")
    prom = served(lambda request: httpx.Response(200, json={"status": "success", "data": {"alerts": {"a": 1}}}))
    with pytest.raises(PromError, match=r"/api/v1/alerts: not a Prometheus API answer: TypeError: expected a list"):
        prom.alerts()
    prom = served(lambda request: httpx.Response(200, json={"status": "success"}))
    with pytest.raises(PromError, match=r"'status' is success but there is no 'data'"):
        prom.rules()


def test_connection_error(served: Callable[[Handler], Prometheus]) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    prom = served(refuse)
    with pytest.raises(PromError, match=r"^http://prom.test:9090/api/v1/query: \[Errno 111\] Connection refused$"):
        prom.query("up")
    assert prom.ready() is False


def test_ready_and_alertmanager(served: Callable[[Handler], Prometheus]) -> None:
    alerts = [{"labels": {"alertname": "StepwatchOutOfMemory"}, "status": {"state": "active"}}]

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/-/ready":
            return httpx.Response(200, text="ready")
        if request.url.path == "/api/v2/alerts":
            return httpx.Response(200, content=json.dumps(alerts).encode())
        return httpx.Response(404)

    assert served(handler).ready()
    with httpclient.use_transport(httpx.MockTransport(handler)), Alertmanager("http://am.test:9093/") as am:
        assert am.ready() and am.alerts() == alerts
    with httpclient.use_transport(httpx.MockTransport(lambda r: httpx.Response(200, json={"a": 1}))):
        am = Alertmanager("http://am.test:9093")
    with am, pytest.raises(PromError, match="expected a list of objects"):
        am.alerts()
