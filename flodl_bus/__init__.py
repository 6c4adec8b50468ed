"""flodl_bus: flodl's DDP control plane on Redis Streams."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["Rank", "__version__", "process_group"]

#: Public names loaded on first use, by module name, as ``cli`` loads commands: the
#: package's own ``__init__`` sits below every layer (it imports none of them), and
#: ``import flodl_bus`` must not cost a torch import. Type checkers see ``Rank`` where
#: it lives, ``flodl_bus.worker.script`` (``process_group``: ``flodl_bus.job``).
_LAZY = {"Rank": "flodl_bus.worker.script", "process_group": "flodl_bus.job"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'flodl_bus' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
