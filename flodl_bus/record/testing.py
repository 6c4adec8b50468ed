"""Deprecated: the pytest plugin and replay helpers live in ``flodl_bus.replay.testing``
since ``replay/`` became the read side of records. This alias re-exports them, with a
``DeprecationWarning``, for one minor version, so a ``conftest.py`` or a test that still
names this module keeps working meanwhile.

The target is loaded by name: ``record`` sits below ``replay`` in the planes, and only
this alias, which goes away, reaches up.
"""

from __future__ import annotations

import importlib
import warnings

warnings.warn(
    "flodl_bus.record.testing moved to flodl_bus.replay.testing: import that (this "
    "alias goes away in the next minor version)",
    DeprecationWarning,
    stacklevel=2,
)

_target = importlib.import_module("flodl_bus.replay.testing")
globals().update({k: v for k, v in vars(_target).items() if not k.startswith("__")})
