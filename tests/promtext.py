"""Read an exposition back into numbers, the way Prometheus would see it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def scrape(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return samples(generate_latest(registry).decode())


def value(data: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """The one sample matching name and labels exactly (0.0 when absent)."""
    return data.get((name, frozenset(labels.items())), 0.0)


def total(data: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """Sum over samples of name whose labels include the given ones."""
    want = set(labels.items())
    return sum(v for (n, ls), v in data.items() if n == name and want <= set(ls))
