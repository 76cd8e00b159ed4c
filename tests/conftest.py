"""Shared fixtures.  Every test gets a fresh registry; pipelines are shared but restored."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


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
