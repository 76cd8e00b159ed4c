"""The old import path of ``stepwatch serve``'s parser, kept for tests/test_sidecar_k8s.py.

The command is ``cli_serve``; the service is ``engine``, its API ``app``.  Delete this
module once nothing imports it.
"""

from stepwatch.service.cli_serve import add_arguments, run

__all__ = ["add_arguments", "run"]
