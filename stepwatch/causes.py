"""The cause vocabulary: what triage may name, declared by the runbooks in their ```causes blocks.

Each runbook declares the causes it owns at the top of its ``## Mitigation``, one line each::

    ```causes
    cache_disabled: the cross-step cache is off or no longer hits: every step computes, so steps are slower
    ```

Lines that start indented continue the one before.  A cause is declared once in all the runbooks;
other runbooks name it in their checks.  Plain text reading, so that the rule generator (which may
not import the runbook parser) and the parser read the same vocabulary.
"""

from __future__ import annotations

import re
from pathlib import Path

NOT_RUNBOOKS = frozenset({"README.md", "fault-table.md", "drills.md"})
_FENCE = re.compile(r"^[ \t]*```causes[ \t]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
_LINE = re.compile(r"^([a-z][a-z0-9_]*):\s+(\S.*)$")


class CausesError(ValueError):
    """A malformed causes block, or a cause declared twice."""


def declared_causes(text: str, file: str = "<text>") -> dict[str, str]:
    """The causes a runbook's ```causes blocks declare: ``cause_id: one line for people``."""
    out: dict[str, str] = {}
    for block in _FENCE.findall(text):
        current = ""
        for line in block.splitlines():
            if not line.strip():
                continue
            if line[0] in " \t" and current:
                out[current] += " " + line.strip()
                continue
            m = _LINE.match(line)
            if m is None:
                raise CausesError(f"{file}: a ```causes line is 'cause_id: what it means', not {line.strip()!r}")
            current = m.group(1)
            if current in out:
                raise CausesError(f"{file}: cause {current!r} declared twice")
            out[current] = m.group(2).strip()
    return out


def load_causes(directory: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Every runbook's declared causes: ({cause: meaning}, {cause: runbook file}), by file name, then block order."""
    meanings: dict[str, str] = {}
    home: dict[str, str] = {}
    for p in sorted(directory.glob("*.md")):
        if p.name in NOT_RUNBOOKS:
            continue
        for cause, meaning in declared_causes(p.read_text(), p.name).items():
            if cause in home:
                raise CausesError(f"{p.name}: cause {cause!r} is already declared in {home[cause]}")
            meanings[cause], home[cause] = meaning, p.name
    return meanings, home
