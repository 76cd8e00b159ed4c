"""The documentation's readability bar: no paragraph, list item or table cell of a tracked ``.md`` file is over
``MAX_CHARS`` characters.

Code fences (```` ``` ```` or ``~~~``, any length, indented or not) are left out.  A paragraph is a run of
non-blank lines, its lines stripped and joined by one space; a heading is a paragraph of its own, and a new list
item (``- ``, ``* ``, ``+ ``, ``1. ``, ``1) ``) starts a new one.  Each cell of a table row (a line that starts
with ``|``) counts alone.  A failure names the file, the line and the length.

Run ``python tests/test_prose.py`` to list every paragraph over the bar.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_CHARS = 600
SKIP_DIRS = frozenset({".git", ".venv", "build", "dist", "node_modules", "__pycache__", ".pytest_cache"})

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_HEADING = re.compile(r"^\s{0,3}#{1,6}(\s|$)")
_LIST_ITEM = re.compile(r"^\s*([-*+]|\d{1,9}[.)])(\s|$)")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")


def table_cells(line: str) -> list[str]:
    """The cells of a table row, each stripped (a ``\\|`` stays inside its cell)."""
    row = line.strip()
    if row.startswith("|"):
        row = row[1:]
    if row.endswith("|") and not row.endswith("\\|"):
        row = row[:-1]
    return [cell.strip() for cell in _CELL_SPLIT.split(row)]


def paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line, text) of every paragraph, list item, heading and table cell outside code fences."""
    out: list[tuple[int, str]] = []
    lines: list[str] = []
    start = 0
    fence: str | None = None

    def flush() -> None:
        if lines:
            out.append((start, " ".join(lines)))
            lines.clear()

    for number, line in enumerate(text.split("\n"), 1):
        opening = _FENCE.match(line)
        if fence is not None:
            # A closing fence: the opening's character, at least as many, nothing after but spaces.
            if opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= len(fence) \
                    and not line.strip()[len(opening.group(1)):].strip():
                fence = None
            continue
        if opening:
            flush()
            fence = opening.group(1)
            continue
        stripped = line.strip()
        if not stripped:
            flush()
            continue
        if stripped.startswith("|"):
            flush()
            out.extend((number, cell) for cell in table_cells(line))
            continue
        heading = bool(_HEADING.match(line))
        if heading or _LIST_ITEM.match(line):
            flush()
        if not lines:
            start = number
        lines.append(stripped)
        if heading:
            flush()
    flush()
    return out


def too_long(text: str, limit: int = MAX_CHARS) -> list[tuple[int, int]]:
    """(line, length) of every paragraph or cell of ``text`` over ``limit`` characters."""
    return [(number, len(para)) for number, para in paragraphs(text) if len(para) > limit]


def markdown_files(root: Path = ROOT) -> list[Path]:
    """The tracked ``.md`` files (``git ls-files``); without git, every ``.md`` under root outside SKIP_DIRS."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "*.md"], cwd=root, capture_output=True, text=True,
                                check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        listed = None
    if listed is not None:
        return sorted(root / name for name in listed.split("\0") if name and (root / name).is_file())
    found = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        found += [Path(here) / f for f in files if f.endswith(".md")]
    return sorted(found)


def offenders(root: Path = ROOT) -> list[str]:
    """``path:line: N characters`` for every paragraph or cell over the bar."""
    return [f"{path.relative_to(root)}:{number}: {length} characters (at most {MAX_CHARS})"
            for path in markdown_files(root) for number, length in too_long(path.read_text())]


def test_markdown_files_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    assert {"README.md", "docs/contracts.md", "runbooks/README.md"} <= names


def test_no_paragraph_or_cell_over_the_bar() -> None:
    bad = offenders()
    assert not bad, "split these into shorter paragraphs, list items or cells:\n" + "\n".join(bad)


def test_a_paragraph_one_over_the_bar_fails() -> None:
    first, second = "a" * 300, "b" * 300
    text = f"# Title\n\nshort\n\n{first}\n{second}\n\nshort\n"  # two lines joined by one space: 601
    assert too_long(text) == [(5, MAX_CHARS + 1)]
    assert too_long(text.replace(second, second[1:])) == []  # 600 passes


def test_a_table_cell_one_over_the_bar_fails() -> None:
    cell = "x" * (MAX_CHARS + 1)
    text = f"intro\n\n| a | b |\n|---|---|\n| short | {cell} |\n"
    assert too_long(text) == [(5, MAX_CHARS + 1)]
    assert too_long(text.replace(cell, cell[1:])) == []


def test_list_items_headings_and_fences_split_paragraphs() -> None:
    item = "y" * 400
    text = (f"# {item}\n{item}\n\n- {item}\n  {item[:10]}\n- {item}\n1. {item}\n\n"
            f"```\n{item}\n{item}\n```\n\n"
            f"````\n```\n{item}\n{item}\n```\n````\n\n"  # a longer fence holds a shorter one
            f"   ```check\n{item}\n{item}\n   ```\n")  # an indented fence (a runbook's check)
    assert [len(p) for _, p in paragraphs(text)] == [402, 400, 413, 402, 403]
    assert too_long(text) == []
    assert too_long(f"{item}\n{item}\n") == [(1, 801)]


@pytest.mark.parametrize(("row", "cells"), [
    ("| a | b |", ["a", "b"]),
    ("| `x \\| y` | z |", ["`x \\| y`", "z"]),
    ("|---|:--:|", ["---", ":--:"]),
])
def test_table_cells(row: str, cells: list[str]) -> None:
    assert table_cells(row) == cells


if __name__ == "__main__":
    found = offenders()
    print("\n".join(found) or "none over the bar")
    print(f"{len(found)} over {MAX_CHARS} characters", file=sys.stderr)
