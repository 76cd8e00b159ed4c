"""Writing a file whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file beside it and a rename: a crash mid-write leaves the old
    file (or none), never half of one, and a reader never sees a partial file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
