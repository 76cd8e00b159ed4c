"""Streaming sessions on an instrumented chunked video pipeline: the session mark, KV readings, chunk series.

A part of ``Instrumentation`` (``exporter/instrument.py``), which holds the
state it reads; the chunk model and its series are ``exporter/chunks.py``'s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from stepwatch.exporter import chunks
from stepwatch.exporter.memory import is_oom
from stepwatch.exporter.options import InstrumentationState
from stepwatch.exporter.report import RequestReport
from stepwatch.exporter.request import (
    RequestMarks,
)
from stepwatch.exporter.shapes import ShapeKey


@dataclass
class SessionMark:
    """A streaming session the host marked (Instrumentation.stream_session); the host sets its outcome."""

    outcome: str = "done"


class StreamSessions(InstrumentationState):
    """The streaming-session side of an Instrumentation: what a chunked call adds to the request's marks."""


    def _kv_read(self, req: RequestMarks, kv_cache: Any, flag: Any) -> None:
        """After a chunk was encoded into the cache: its bytes (tensor sizes), and the worker's KV gauges."""
        stream, model = req.stream, self._chunks
        allocated, element = chunks.cache_bytes(kv_cache)
        cached = int(flag.get("num_cached_chunks", 0)) if isinstance(flag, dict) else len(stream.outs)
        reading = chunks.KvReading(allocated, element, cached)
        stream.kv.append(reading)
        if self._stream is not None and model is not None:
            self._stream.live(id(stream), allocated, chunks.in_use_bytes(model, stream, reading), stream.ledger_bytes)
            if self.phase == "serving":  # a session's chunks show while it runs, not only at its end
                for index, seconds, frames in chunks.ready_chunks(model, stream, self.clock.seconds, req.start,
                                                                  self.clock.ready):
                    self._stream.chunk(index, seconds, frames, self.options.stream_fps, stream.lead_seconds)

    def _emit_stream(self, req: RequestMarks, report: RequestReport) -> None:
        """A chunked call's chunk latencies, real-time factors and KV reading, into its report and the series."""
        if self._chunks is None or self._stream is None:
            return
        last_out = (req.vae_spans[0][0] if req.vae_spans else req.end) if req.outcome == "ok" else None
        report.stream = chunks.resolve(self._chunks, req.stream, self.clock.seconds, req.start, last_out,
                                       self.options.stream_fps, len(report.step_seconds))
        if report.stream is not None:
            self._stream.publish(report.stream, req.stream.published)

    @contextlib.contextmanager
    def stream_session(self, opened_at: float | None = None) -> Iterator[SessionMark]:
        """Mark a streaming session around the chunked call(s) that serve it, on this thread.

        ``opened_at`` is the host's ``time.perf_counter()`` when the client opened the session (another process
        of the same host may stamp it: the clock is the system's monotonic one); the first chunk's latency then
        counts from there, as the client sees it, not from the call's start.  The session counts as active
        inside the block; at its end its outcome (``mark.outcome``: done, closed or failed; an exception that
        leaves the block makes it failed, or closed where the exception says ``stepwatch_outcome =
        "cancelled"``) and duration are recorded.  A pipeline that is not chunked records nothing.
        """
        opened = time.perf_counter() if opened_at is None else opened_at
        mark = SessionMark()
        stream = self._stream
        if stream is not None:
            self._guarded("stream.session", stream.session_opened)
        self._local.session_opened = opened
        try:
            yield mark
        except BaseException as exc:
            mark.outcome = "closed" if getattr(exc, "stepwatch_outcome", None) == "cancelled" else "failed"
            self._guarded("stream.session", self._session_oom, exc)
            raise
        finally:
            self._local.session_opened = None
            if stream is not None:
                self._guarded("stream.session", stream.session_ended, mark.outcome, time.perf_counter() - opened)

    def _session_oom(self, exc: BaseException) -> None:
        """An out-of-memory the host raised for a session outside any call (its KV cache did not fit the host's
        KV memory): counted with the stage and shape the exception names (``stepwatch_stage``,
        ``stepwatch_shape``).  One raised inside a call was counted by that call."""
        stage = getattr(exc, "stepwatch_stage", None)
        if stage is None or not is_oom(exc):
            return
        shape = getattr(exc, "stepwatch_shape", None)
        label = self.labeler.label(ShapeKey.parse(shape)) if shape else "other"
        self.metrics.oom_total.labels(shape=label, stage=str(stage)).inc()

    def set_stream_kv_capacity(self, capacity_bytes: int) -> None:
        """The KV memory a host gives its chunked calls (``stepwatch_stream_kv_cache_capacity_bytes``)."""
        if self._stream is not None:
            self._stream.m.stream_kv_cache_capacity_bytes.set(max(0, int(capacity_bytes)))
