"""Runnable jobs: ``flodl_bus.examples.digits:job`` is the default of ``flodl-bus up``."""
