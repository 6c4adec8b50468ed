"""Benches: one module per ``flodl-bus bench NAME``, plus the baselines they run against.

Every bench prints its figures beside a reference measured in the same run. This package
sits above every plane (it drives them all) and below only ``cli``; nothing in the runtime
imports it.
"""
