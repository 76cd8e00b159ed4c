"""The per-pod cardinality budget (docs/contracts.md), held by exact series counts.

Render times are measured by ``stepwatch bench exposition``, not asserted here; what a test can
hold is the number of series a shape, a rank and a GPU add, so a new per-shape series fails
here until the budget in docs/contracts.md is updated with it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
from prometheus_client import disable_created_metrics, enable_created_metrics, generate_latest

from stepwatch.bench import exposition as be

PER_SHAPE, PER_RANK, PER_GPU, EXPORTER_FIXED = 25, 6, 18, 45


@pytest.fixture
def no_created() -> Iterator[None]:
    """As the service and the sidecar run (process-wide in prometheus_client: restored after the test)."""
    disable_created_metrics()
    yield
    enable_created_metrics()


def series(text: bytes) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))


def test_a_shape_and_a_rank_cost_what_the_budget_says(no_created: None) -> None:
    one = series(generate_latest(be._exporter_registry(1, 1)))
    assert one == EXPORTER_FIXED + PER_SHAPE
    assert series(generate_latest(be._exporter_registry(3, 1))) - one == 2 * PER_SHAPE
    two_ranks = series(generate_latest(be._exporter_registry(1, 2)))
    four_ranks = series(generate_latest(be._exporter_registry(1, 4)))
    assert four_ranks - two_ranks == 2 * PER_RANK


def test_a_gpu_costs_what_the_budget_says(no_created: None) -> None:
    assert series(generate_latest(be._sidecar_registry(3))) - series(generate_latest(be._sidecar_registry(1))) \
        == 2 * PER_GPU


def test_requests_off_their_shape_fail_the_case_rather_than_flatter_it(no_created: None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(be, "REQUESTS_PER_SHAPE", 0)  # the check expects 0 requests per shape: it sees 3
    with pytest.raises(RuntimeError, match="not labelled with their shape"):
        be._exporter_registry(1, 1)


@pytest.mark.heavy
def test_cli_reports_every_case_within_the_series_budget() -> None:
    out = subprocess.run([sys.executable, "-m", "stepwatch.cli", "bench", "exposition", "--json", "--renders", "2"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    cases = json.loads(out.strip().splitlines()[-1])["cases"]
    service = {(c["shapes"], c["ranks"]): c for c in cases if c["target"] == "service"}
    assert set(service) == {(s, r) for s in (1, 16, 50) for r in (1, 8)}
    assert service[(50, 8)]["series"] - service[(50, 1)]["series"] == 8 * PER_RANK
    assert service[(50, 1)]["series"] - service[(16, 1)]["series"] == 34 * PER_SHAPE
    assert service[(50, 8)]["series"] <= 3000
    sidecar = [c for c in cases if c["target"] == "sidecar"]
    assert len(sidecar) == 1 and sidecar[0]["gpus"] == 8
    assert all(c["bytes"] > 0 and c["render_ms_p99"] >= c["render_ms_median"] > 0 for c in cases)
