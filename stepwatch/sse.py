"""Server-sent events as a streaming session sends them: the service writes them, the sidecar's drift probe,
the stream drills and the tests read them with the same reader.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def parse_sse(lines: Iterable[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event, data) of a session's stream, read line by line as a client reads it (the inverse of ``sse``)."""
    kind = ""
    for line in lines:
        if line.startswith("event: "):
            kind = line[len("event: "):]
        elif line.startswith("data: "):
            yield kind, json.loads(line[len("data: "):])
