"""Shared fixtures.  Every test gets a fresh registry; pipelines are shared but restored.

Tools: a test that needs an external binary (prometheus, promtool, amtool, alertmanager) calls
``need_tool`` or carries ``@pytest.mark.needs_tool(name, *alternatives)``.  Locally a missing tool skips the
test; with ``STEPWATCH_REQUIRE_TOOLS=1`` (what ``./dev test`` and CI set) it fails it, so a CI image that
lost a tool cannot pass by skipping.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from prometheus_client import CollectorRegistry

if TYPE_CHECKING:
    from tests.fakes import StandIn

REQUIRE_TOOLS_ENV = "STEPWATCH_REQUIRE_TOOLS"


def tools_required() -> bool:
    return os.environ.get(REQUIRE_TOOLS_ENV, "") == "1"


def need_tool(name: str, *alternatives: str) -> str:
    """The path of ``name`` (or of the first alternative found) on PATH.  Missing: the test fails when
    STEPWATCH_REQUIRE_TOOLS=1, and is skipped otherwise."""
    for n in (name, *alternatives):
        found = shutil.which(n)
        if found:
            return found
    what = " or ".join((name, *alternatives))
    if tools_required():
        pytest.fail(f"{what} not on PATH and {REQUIRE_TOOLS_ENV}=1 (apt-get install prometheus "
                    "prometheus-alertmanager)", pytrace=False)
    pytest.skip(f"{what} not installed (set {REQUIRE_TOOLS_ENV}=1 to make this a failure)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs_tool(name, *alternatives): the test needs this binary on PATH "
                                       "(skipped when missing, failed when STEPWATCH_REQUIRE_TOOLS=1)")
    # Explicit, once per session, before any test module is imported (collection comes after configure):
    # the tokenizers library reads TOKENIZERS_PARALLELISM when it is first used, and the service/sidecar
    # subprocesses the tests start inherit it.  Without it, a tokenizer used before a fork warns and may
    # deadlock.  setdefault: a value the caller chose wins.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before any fixture is set up, so a module-scoped fixture that starts Prometheus never runs without it.
    for mark in item.iter_markers("needs_tool"):
        need_tool(*mark.args)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def standin() -> Iterator[StandIn]:
    """A fresh stand-in for the practice service's HTTP API (tests/fakes.py), stopped afterwards."""
    from tests.fakes import StandIn

    s = StandIn()
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def flux_pipe() -> Any:
    from stepwatch.service.pipeline import build_pipeline

    return build_pipeline("flux", seed=0)


@pytest.fixture(scope="session")
def wan_pipe() -> Any:
    from stepwatch.service.pipeline import build_pipeline

    return build_pipeline("wan", seed=0)


@pytest.fixture
def clean_flux(flux_pipe: Any) -> Iterator[Any]:
    """The shared FLUX pipeline, guaranteed uninstrumented and cache-free afterwards."""
    from stepwatch.exporter import uninstrument
    from stepwatch.service.cache import apply_cache

    yield flux_pipe
    uninstrument(flux_pipe)
    apply_cache(flux_pipe, "none")
    flux_pipe.vae.disable_tiling()
