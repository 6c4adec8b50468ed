"""The ``flodl-bus`` entry point: help and exit codes."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from flodl_bus import cli


@pytest.mark.parametrize("argv", [[], ["--help"], ["-h"], ["help"]])
def test_help_lists_every_command_and_bench(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: flodl-bus COMMAND")
    for name in cli.COMMANDS:
        assert re.search(rf"^  {name} ", out, re.M), name
    for name in cli.BENCHES:
        assert re.search(rf"^  bench {name} ", out, re.M), name


def test_unknown_command_exits_2_with_usage_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate'" in err and "usage:" in err


@pytest.mark.parametrize("argv", [["bench"], ["bench", "nope"]])
def test_bench_without_a_known_bench_exits_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def test_a_command_whose_module_is_missing_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cli.COMMANDS, "ghost", ("flodl_bus.no_such_plane:main", "absent"))
    with pytest.raises(SystemExit, match=r"flodl_bus\.no_such_plane is not available"):
        cli.main(["ghost"])


def test_console_script_exits_2_on_an_unknown_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "flodl_bus.cli", "frobnicate"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown command" in proc.stderr
