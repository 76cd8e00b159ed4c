"""Read an exposition back into numbers, the way Prometheus would see it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def scrape(registry: CollectorRegistry) -> Samples:
    return samples(generate_latest(registry).decode())


def _fmt(name: str, labels: frozenset[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels))
    return f"{name}{{{inner}}}"


def value(data: Samples, name: str, **labels: str) -> float:
    """The one sample matching name and labels exactly; KeyError when there is none.

    A missing series is not zero: a test that means "no such series" uses absent().
    """
    key = (name, frozenset(labels.items()))
    if key not in data:
        present = sorted(_fmt(n, ls) for n, ls in data if n == name)
        raise KeyError(f"no series {_fmt(*key)}; samples named {name}: {present or 'none'}")
    return data[key]


def absent(data: Samples, name: str, **labels: str) -> bool:
    """True when no sample has exactly this name and these labels."""
    return (name, frozenset(labels.items())) not in data


def counter_before(data: Samples, name: str, **labels: str) -> float:
    """A counter read from a snapshot taken *before* the action a test measures.  A labelled counter whose
    series is not born yet reads 0 there (as increase() treats a new series); the snapshot after the action
    is read with value(), which refuses a missing series."""
    return 0.0 if absent(data, name, **labels) else value(data, name, **labels)


def total(data: Samples, name: str, **labels: str) -> float:
    """Sum over samples of name whose labels include the given ones."""
    want = set(labels.items())
    return sum(v for (n, ls), v in data.items() if n == name and want <= set(ls))
