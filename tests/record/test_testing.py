"""The old module path of the replay pytest plugin (a deprecated alias)."""

from __future__ import annotations

import pytest


def test_the_old_module_path_still_works_for_one_version_and_says_where_it_went() -> None:
    """Issue 30: a conftest naming ``flodl_bus.record.testing`` (the documented module
    before the layout change) failed to import; public module paths change only with a
    warning alias."""
    import importlib
    import sys

    from flodl_bus.replay import testing

    sys.modules.pop("flodl_bus.record.testing", None)
    with pytest.warns(DeprecationWarning, match="moved to flodl_bus.replay.testing"):
        old = importlib.import_module("flodl_bus.record.testing")
    assert old.assert_identical is testing.assert_identical
    assert old.recorded_run is testing.recorded_run
