"""The replay pytest plugin (``flodl_bus.replay.testing``): where a marked run is found."""

from __future__ import annotations

from pathlib import Path

import pytest


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
