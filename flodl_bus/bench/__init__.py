"""Benches: one module per ``flodl-bus bench NAME``, plus the baselines they run against.

Every bench prints its figures beside a reference measured in the same run. This package
sits above every plane (it may import any of them, ``examples`` and ``replay`` included)
and below only ``cli``, which names its modules as strings; nothing in the runtime imports
it.
"""
