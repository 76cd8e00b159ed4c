"""Read a Prometheus text exposition back into numbers."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, tuple[tuple[str, str], ...]]


def parse_exposition(text: str) -> dict[Key, float]:
    """{(sample name, sorted label pairs): value} for every sample."""
    out: dict[Key, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
