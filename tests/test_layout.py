"""The package layout holds: each package imports only the packages it declares, and no module is over 600 lines.

``LAYERS`` is the one declaration of the import order (README, "Layout").  Every ``import`` in the package
code is checked, at the top of a module or inside a function, ``import x`` and ``from x import y``, relative
imports resolved; a failure names the file, the line and the edge.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the packages it may import.  "core" is stepwatch/ (less stepwatch/cli.py); "cli" is stepwatch/cli.py,
# which loads every subcommand by name (importlib) and so imports none of them.
LAYERS: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "alerts": frozenset({"core"}),
    "runbooks": frozenset({"core"}),
    "dashboards": frozenset({"core", "alerts"}),
    "exporter": frozenset({"core"}),
    "service": frozenset({"core", "exporter"}),
    "triage": frozenset({"core", "alerts", "runbooks"}),
    "fault_injection": frozenset({"core", "alerts", "runbooks", "dashboards", "exporter", "service", "triage"}),
    "bench": frozenset({"core", "exporter", "service", "fault_injection"}),
    "cli": frozenset(),
}
# Folder -> package (pyproject.toml's package-dir); stepwatch/ is core.
FOLDERS = ("stepwatch", "exporter", "service", "alerts", "dashboards", "runbooks", "triage", "fault_injection",
           "bench")
MAX_LINES = 600


def package_of(module: str) -> str | None:
    """The package a dotted module belongs to; None outside the project (the standard library, dependencies)."""
    parts = module.split(".")
    if parts[0] == "tests":
        return "tests"
    if parts[0] != "stepwatch":
        return None
    if len(parts) > 1 and parts[1] == "cli":
        return "cli"
    if len(parts) > 1 and parts[1] in LAYERS and parts[1] not in ("core", "cli"):
        return parts[1]
    return "core"


def module_name(path: Path, root: Path = ROOT) -> str:
    """The dotted name a file under ``root`` is imported as (``exporter/sidecar/nvml.py``: stepwatch.exporter...)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] != "stepwatch":
        parts.insert(0, "stepwatch")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, dotted module) of every import in ``source``, wherever it sits; ``from m import n`` yields
    ``m.n``, since n may be a module (``from stepwatch import triage``)."""
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                yield node.lineno, f"{target}.{alias.name}"


def violations_in(source: str, path: str, module: str, is_package: bool = False) -> list[str]:
    """``path:line: importer -> imported (module)`` for each import against ``LAYERS``."""
    importer = package_of(module)
    assert importer is not None, module
    out = []
    for line, target in imported(source, module, is_package):
        pkg = package_of(target)
        if pkg is not None and pkg != importer and pkg not in LAYERS[importer]:
            out.append(f"{path}:{line}: {importer} -> {pkg} ({target})")
    return out


def package_files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def test_every_import_follows_the_declared_layers() -> None:
    bad = []
    for p in package_files():
        bad += violations_in(p.read_text(), str(p.relative_to(ROOT)), module_name(p), p.name == "__init__.py")
    assert not bad, "imports against LAYERS (tests/test_layout.py):\n" + "\n".join(bad)


def test_no_module_is_over_600_lines() -> None:
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in package_files()
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines:\n" + "\n".join(long)


def test_the_declared_layers_have_no_cycle() -> None:
    done: set[str] = set()

    def visit(pkg: str, path: tuple[str, ...]) -> None:
        assert pkg not in path, f"cycle in LAYERS: {' -> '.join((*path, pkg))}"
        if pkg not in done:
            for dep in LAYERS[pkg]:
                visit(dep, (*path, pkg))
            done.add(pkg)

    for pkg in LAYERS:
        visit(pkg, ())


def test_every_cli_command_names_a_module_that_exists() -> None:
    """The CLI loads its commands by name, which no import check sees: each name must find its file."""
    from stepwatch.cli import COMMANDS

    specs = [s for v in COMMANDS.values() for s in (v.values() if isinstance(v, dict) else [v])]
    missing = [module for module, _ in specs if importlib.util.find_spec(module) is None]
    assert not missing, missing


@pytest.mark.parametrize(("path", "source", "edge"), [
    ("exporter/x.py", "import os\n\n\ndef f():\n    from stepwatch.service import app\n",
     "exporter/x.py:5: exporter -> service"),
    ("exporter/sidecar/x.py", "def f():\n    from ...service.sessions import parse_sse\n",
     "exporter/sidecar/x.py:2: exporter -> service"),
    ("alerts/x.py", "from stepwatch import triage\n", "alerts/x.py:1: alerts -> triage"),
    ("triage/x.py", "import stepwatch.fault_injection.stack\n", "triage/x.py:1: triage -> fault_injection"),
    ("service/x.py", "from tests.fakes import FakePipeline\n", "service/x.py:1: service -> tests"),
    ("stepwatch/x.py", "from .alerts import promql\n", "stepwatch/x.py:1: core -> alerts"),
])
def test_the_check_finds_a_forbidden_import(path: str, source: str, edge: str) -> None:
    found = violations_in(source, path, module_name(ROOT / path))
    assert len(found) == 1 and found[0].startswith(edge), found


def test_the_check_passes_allowed_and_outside_imports() -> None:
    source = ("import json\nfrom stepwatch import httpclient\nfrom . import engine\nfrom ..exporter import memory\n"
              "\n\ndef f():\n    import torch\n    from stepwatch.exporter.sidecar import client\n")
    assert violations_in(source, "service/x.py", module_name(ROOT / "service/x.py")) == []
    init = "from .sidecar import nvml\nfrom . import ranks\n"
    assert violations_in(init, "exporter/__init__.py", "stepwatch.exporter", is_package=True) == []
