"""Typed metric access: the generated declarations match the catalog and what MetricSet builds, and mypy
rejects a misspelled metric, a method its kind lacks, and another owner's metric."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import get_args, get_type_hints

import pytest
from prometheus_client import CollectorRegistry

from stepwatch import metric_fields_gen
from stepwatch.alerts import generate
from stepwatch.catalog import Owner
from stepwatch.metrics import BY_OWNER, MetricSet
from stepwatch.thresholds import load

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ROOT / "stepwatch" / "metric_fields.py"


def test_committed_metric_fields_match_the_catalog() -> None:
    assert FIELDS.read_text() == metric_fields_gen.render(), (
        "stepwatch/metric_fields.py differs from the catalog; run `stepwatch rules generate`")


def test_rules_generate_writes_the_metric_fields() -> None:
    assert generate.metric_fields_path(ROOT) == "stepwatch/metric_fields.py"
    assert generate.render_all(load(), ROOT)["stepwatch/metric_fields.py"] == metric_fields_gen.render()
    # An installed stepwatch: root is site-packages/stepwatch, which holds the core modules itself.
    assert generate.metric_fields_path(ROOT / "stepwatch") == "metric_fields.py"


@pytest.mark.parametrize("owner", get_args(Owner))
def test_each_owner_class_declares_exactly_the_collectors_it_builds(owner: Owner) -> None:
    cls = BY_OWNER[owner]
    assert owner == cls.OWNER
    declared = {k: v for k, v in get_type_hints(cls).items() if k not in get_type_hints(MetricSet)}
    ms = cls(CollectorRegistry())
    built = {k: v for k, v in vars(ms).items() if k != "registry"}
    assert set(declared) == set(built)
    for name, collector in built.items():
        assert type(collector) is declared[name], name
    assert not set(declared) & set(dir(MetricSet)), "a metric attribute would hide MetricSet's own"


def test_shared_returns_one_set_per_registry_and_owner_of_the_owners_class() -> None:
    reg = CollectorRegistry()
    exporter = MetricSet.shared(reg, "exporter")
    assert MetricSet.shared(reg, "exporter") is exporter
    assert type(exporter) is BY_OWNER["exporter"]
    stream = MetricSet.shared(reg, "stream")
    assert type(stream) is BY_OWNER["stream"] and stream is not exporter
    assert MetricSet.shared(CollectorRegistry(), "exporter") is not exporter


GOOD = """
    from prometheus_client import CollectorRegistry
    from stepwatch.metrics import MetricSet

    ms = MetricSet.shared(CollectorRegistry(), "exporter")
    ms.pipeline_step_duration_seconds.labels(shape="s").observe(0.1)
    ms.cache_hit_position_ratio.observe(0.5)
    ms.pipeline_requests_total.labels(shape="s", outcome="ok").inc()
    MetricSet.shared(CollectorRegistry(), "service").service_config.clear()
"""
BAD = """
    from prometheus_client import CollectorRegistry
    from stepwatch.metrics import MetricSet

    ms = MetricSet.shared(CollectorRegistry(), "exporter")
    ms.pipeline_step_duration_secondz.labels(shape="s").observe(0.1)
    ms.cache_hit_position_ratio.inc()
    ms.service_config.clear()
"""


def test_mypy_rejects_a_misspelled_metric_a_wrong_method_and_another_owners_metric(tmp_path: Path) -> None:
    """The real package under the project's mypy settings: the misspelled snippet fails naming the
    attribute, the correctly spelled one passes."""
    for name, text in (("good.py", GOOD), ("bad.py", BAD)):
        (tmp_path / name).write_text(textwrap.dedent(text))
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir",
         str(tmp_path / "cache"), "--no-error-summary", str(tmp_path / "good.py"), str(tmp_path / "bad.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert not [e for e in errors if "good.py" in e], proc.stdout + proc.stderr
    bad = "\n".join(errors)
    assert '"ExporterMetrics" has no attribute "pipeline_step_duration_secondz"' in bad, proc.stdout + proc.stderr
    assert '"Histogram" has no attribute "inc"' in bad, bad
    assert '"ExporterMetrics" has no attribute "service_config"' in bad, bad
    assert len(errors) == 3 and proc.returncode == 1, proc.stdout + proc.stderr
