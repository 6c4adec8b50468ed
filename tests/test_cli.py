"""The ``flodl-bus`` entry point: help and exit codes."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from flodl_bus import cli


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["help"]])
def test_help_lists_every_command_in_groups_and_benches_under_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: flodl-bus COMMAND")
    grouped = [name for _, names in cli.GROUPS for name in names]
    assert sorted(grouped) == sorted(cli.COMMANDS)  # each command in exactly one group
    for title, _ in cli.GROUPS:
        assert re.search(rf"^{title}:$", out, re.M), title
    # aligned: every description starts in the same column
    entries = [line for line in out.splitlines() if line.startswith("  ") and line[2] != " "]
    columns = {len(line) - len(line[2:].split("  ", 1)[1].lstrip()) for line in entries}
    assert len(columns) == 1, entries
    for name in cli.COMMANDS:
        assert re.search(rf"^  {name} ", out, re.M), name
    assert len(re.findall(r"^  bench", out, re.M)) == 1
    for name in cli.BENCHES:
        assert not re.search(rf"^  bench {name} ", out, re.M), name


def test_bench_help_lists_every_bench(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.BENCHES:
        assert re.search(rf"^  {name} ", out, re.M), name


def test_bare_flodl_bus_exits_2_with_usage_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("usage: flodl-bus COMMAND")


def test_version_prints_the_packages_version() -> None:
    from flodl_bus import __version__

    proc = subprocess.run([sys.executable, "-m", "flodl_bus.cli", "--version"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout == f"flodl-bus {__version__}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", __version__)


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
