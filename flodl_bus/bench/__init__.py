"""Bench commands (``flodl-bus bench NAME``), one module each."""
