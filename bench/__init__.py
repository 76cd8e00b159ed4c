"""Benchmarks and checks that run the other packages (the overhead, the service, the fleet, exposition, a GPU).

Nothing in the package imports them: ``stepwatch bench`` and ``stepwatch gpu-check`` load them by name.
"""
