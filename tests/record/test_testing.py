"""The old module path of the replay pytest plugin (a deprecated alias)."""

from __future__ import annotations

from pathlib import Path

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


def test_a_relative_recorded_run_is_found_from_the_rootdir_wherever_pytest_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30: the README's `GOLDEN = "tests/runs/golden"` resolved against the
    working directory, so running pytest from `tests/` could not find it."""
    from flodl_bus.replay.testing import _resolved

    run = tmp_path / "tests" / "runs" / "golden"
    run.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "tests")
    assert _resolved(Path("tests/runs/golden"), tmp_path) == run
    assert _resolved(Path("runs/golden"), tmp_path).resolve() == run  # cwd-relative still works
    assert _resolved(run, Path("/elsewhere")) == run
