from __future__ import annotations

pytest_plugins = ["flodl_bus.record.testing"]
