"""In-process instrumentation of diffusers pipelines (and, in ``sidecar``, the GPU/quality side).

Importing this package does not import torch; instrument() does, lazily.
"""

from stepwatch.exporter.instrument import Instrumentation, InstrumentOptions, instrument, uninstrument
from stepwatch.exporter.report import RequestReport
from stepwatch.exporter.shapes import OTHER, ShapeKey, ShapeLabeler

__all__ = [
    "OTHER",
    "InstrumentOptions",
    "Instrumentation",
    "RequestReport",
    "ShapeKey",
    "ShapeLabeler",
    "instrument",
    "uninstrument",
]
