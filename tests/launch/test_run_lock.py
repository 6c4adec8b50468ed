"""``launch.run_lock``: one launcher per run directory while it runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flodl_bus.launch import run_lock


def test_a_held_directory_is_refused_naming_its_holder_and_free_again_once_released(
    tmp_path: Path,
) -> None:
    held = run_lock.take(tmp_path / "run")
    assert (tmp_path / "run" / run_lock.LOCK_NAME).read_text().strip() == str(os.getpid())
    with pytest.raises(
        run_lock.RunDirBusy, match=rf"in use by another flodl-bus up \(pid {os.getpid()}\)"
    ):
        run_lock.take(tmp_path / "run")
    held.release()
    run_lock.take(tmp_path / "run").release()


def test_a_filesystem_without_locks_lets_the_run_go_on_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import errno
    import fcntl

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    held = run_lock.take(tmp_path / "nfs")
    held.release()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be locked" in err
