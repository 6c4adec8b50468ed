"""Every command refuses bad settings before it starts anything: choices, required flags,
the job (importable from its own folder, and a Job), in one line with exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flodl_bus.bus.server import RedisServer

#: how a console script runs: sys.path[0] is the script's folder, not the working directory
SCRIPT = "import sys\nfrom flodl_bus.cli import main\nsys.exit(main())\n"

JOB_FILE = """
from flodl_bus.examples.digits import job
not_a_job = 5
"""


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "myproject"
    folder.mkdir()
    (folder / "myjob.py").write_text(JOB_FILE)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "flodl-bus").write_text(SCRIPT)
    return folder


def flodl_bus(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    script = cwd.parent / "bin" / "flodl-bus"
    env = {k: v for k, v in os.environ.items() if k != "FLODL_RUN_SECRET"}
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def one_line(result: subprocess.CompletedProcess[str], prog: str) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    err = result.stderr
    assert err.count("\n") == 1 and err.startswith(f"{prog}: "), err
    return err


DEAD = "redis://127.0.0.1:1/0"  # a closed loopback port: nothing may get that far


@pytest.mark.parametrize(
    "argv",
    [
        ["up", "--log-level", "LOUD"],
        [
            "coordinator",
            "--run",
            "r",
            "--job",
            "myjob:job",
            "--world-size",
            "1",
            "--log-level",
            "LOUD",
            "--redis-url",
            DEAD,
        ],
        ["worker", "--run", "r", "--log-level", "LOUD", "--redis-url", DEAD],
    ],
    ids=["up", "coordinator", "worker"],
)
def test_a_bad_log_level_is_refused_at_once_by_every_command(
    job_dir: Path, argv: list[str]
) -> None:
    started = time.monotonic()
    err = one_line(flodl_bus(job_dir, *argv), f"flodl-bus {argv[0]}")
    assert "--log-level" in err and "'loud'" in err and "debug" in err
    assert not (job_dir / "runs").exists()  # nothing started, nothing left behind
    assert time.monotonic() - started < 60


def test_up_refuses_a_job_attribute_typo_before_any_process_or_run_dir(job_dir: Path) -> None:
    result = flodl_bus(job_dir, "up", "--job", "myjob:jobb", "--no-progress")
    err = one_line(result, "flodl-bus up")
    assert "has no attribute 'jobb'" in err
    assert not (job_dir / "runs").exists()
    assert "run " not in result.stdout  # the launch line never printed


@pytest.mark.parametrize(
    ("config", "fix"),
    [
        ("seed = 18446744073709551616\n", "seed: must be >= 0"),
        ("anchor = 1e20\n", "anchor: expected an integer"),
        ("callback_rank = 99\n", "--callback-rank 99 is not a rank of 3 worker(s)"),
    ],
)
def test_up_refuses_out_of_range_settings_before_any_process_or_run_dir(
    job_dir: Path, config: str, fix: str
) -> None:
    (job_dir / "run.toml").write_text(config)
    result = flodl_bus(job_dir, "up", "--workers", "3", "--config", "run.toml", "--no-progress")
    assert fix in one_line(result, "flodl-bus up")
    assert not (job_dir / "runs").exists()


def test_up_refuses_a_job_that_is_not_a_job(job_dir: Path) -> None:
    err = one_line(flodl_bus(job_dir, "up", "--job", "myjob:not_a_job"), "flodl-bus up")
    assert "not_a_job is a int, not a flodl_bus Job" in err
    assert not (job_dir / "runs").exists()


def test_the_jobs_own_folder_is_importable_without_pythonpath(job_dir: Path) -> None:
    # The coordinator gets as far as Redis (a closed port): the job was found and loaded.
    result = flodl_bus(
        job_dir, "coordinator", "--run", "r", "--job", "myjob:job", "--world-size", "1",
        "--redis-url", DEAD,
    )  # fmt: skip
    err = one_line(result, "flodl-bus coordinator")
    assert "cannot reach Redis" in err, err
    bad = flodl_bus(job_dir, "coordinator", "--run", "r", "--job", "myjob:jobb",
                    "--world-size", "1", "--redis-url", DEAD)  # fmt: skip
    assert "has no attribute 'jobb'" in one_line(bad, "flodl-bus coordinator")
    worker = flodl_bus(job_dir, "worker", "--run", "r", "--job", "myjob:not_a_job",
                       "--redis-url", DEAD)  # fmt: skip
    assert "not a flodl_bus Job" in one_line(worker, "flodl-bus worker")


@pytest.mark.parametrize(
    ("command", "required"),
    [
        ("coordinator", ["--run", "--job"]),
        ("worker", ["--run"]),
    ],
)
def test_help_shows_required_flags_as_required(
    job_dir: Path, command: str, required: list[str]
) -> None:
    result = flodl_bus(job_dir, command, "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    section = text[text.index("\nrequired:") :]
    section = section[: section.index("\n\n")] if "\n\n" in section else section
    for flag in required:
        assert f"\n  {flag} " in section, text
        assert f"[{flag} " not in text.split("\n\n")[0]  # not bracketed in the usage line
    missing = flodl_bus(job_dir, command)
    assert missing.returncode == 2 and "required" in missing.stderr


def test_coordinator_help_lists_the_mode_choices(job_dir: Path) -> None:
    text = flodl_bus(job_dir, "coordinator", "--help").stdout
    assert "{nccl-sync,nccl-cadence,cpu-sync,cpu-cadence,cpu-async}" in text


def test_worker_help_answers_without_importing_torch(job_dir: Path) -> None:
    code = (
        "import sys\nfrom flodl_bus.cli import main\n"
        "try:\n    main(['worker', '--help'])\nexcept SystemExit as e:\n    rc = e.code\n"
        "print('RC', rc, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "--run RUN" in out.stdout
    assert out.stdout.strip().endswith("RC 0 False"), out.stdout[-300:]


# ------------------------------------------------------------ who Redis refused, and why

ACL = Path(__file__).resolve().parents[1] / "ops" / "users.acl"


@pytest.fixture(scope="module")
def acl_server() -> Iterator[RedisServer]:
    server = RedisServer(extra_args=["--aclfile", str(ACL)]).start()
    try:
        yield server
    finally:
        server.cleanup()


def _run_main(
    command: str, argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> int:
    for key in ("FLODL_REDIS_USERNAME", "FLODL_REDIS_PASSWORD", "FLODL_RUN_SECRET"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if command == "coordinator":
        from flodl_bus.coordinator.cli import main as coordinator_main

        return coordinator_main(argv)
    from flodl_bus.worker.options import main as worker_main

    return worker_main(argv)


@pytest.mark.redis
@pytest.mark.parametrize("command", ["coordinator", "worker"])
def test_a_wrong_password_is_one_line_naming_the_user_and_where_it_came_from(
    acl_server: RedisServer,
    command: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"redis://127.0.0.1:{acl_server.port}/0"
    argv = ["--run", "auth1", "--redis-url", url]
    if command == "coordinator":
        argv += ["--job", "flodl_bus.examples.digits:job", "--world-size", "1"]
    env = {"FLODL_REDIS_USERNAME": command, "FLODL_REDIS_PASSWORD": "not-the-password"}
    assert _run_main(command, argv, env, monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"user {command!r} (FLODL_REDIS_USERNAME; password from FLODL_REDIS_PASSWORD)" in err
    assert "not-the-password" not in err and "Traceback" not in err
    # credentials in the URL are named as coming from there (the password never shown)
    url_creds = f"redis://{command}:wrong-pw@127.0.0.1:{acl_server.port}/0"
    assert _run_main(command, [*argv[:2], "--redis-url", url_creds, *argv[4:]], {},
                     monkeypatch) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert f"user {command!r} (the URL; password from the URL)" in err and "wrong-pw" not in err


@pytest.mark.redis
def test_a_user_whose_acl_lacks_a_command_gets_one_line_not_a_traceback(
    acl_server: RedisServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The read-only observer as a coordinator: PING passes, writing the run's meta is refused.
    url = f"redis://127.0.0.1:{acl_server.port}/0"
    env = {"FLODL_REDIS_USERNAME": "observer", "FLODL_REDIS_PASSWORD": "flodl-observer-dev"}
    argv = ["--run", "auth2", "--job", "flodl_bus.examples.digits:job", "--world-size", "1",
            "--redis-url", url, "--join-timeout", "1"]  # fmt: skip
    assert _run_main("coordinator", argv, env, monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "refused user 'observer' (FLODL_REDIS_USERNAME" in err
    assert "ops/users.acl" in err


@pytest.mark.redis
def test_a_worker_without_a_coordinator_says_what_it_waits_for(
    redis_url: str, job_dir: Path
) -> None:
    result = flodl_bus(job_dir, "worker", "--run", "nobody-here", "--redis-url", redis_url,
                       "--secret-timeout", "1")  # fmt: skip
    assert result.returncode == 2, result.stderr
    first, *rest = result.stderr.splitlines()
    assert first.startswith("flodl-bus worker: waiting up to 1s for the coordinator of run "
                            "'nobody-here'")  # fmt: skip
    assert "FLODL_RUN_SECRET" in first
    assert len(rest) == 1 and "no run secret" in rest[0]


@pytest.mark.slow
def test_up_trains_a_job_from_its_own_folder_without_pythonpath(job_dir: Path) -> None:
    result = flodl_bus(job_dir, "up", "--job", "myjob:job", "--epochs", "1", "--no-plot",
                       "--no-progress", "--run", "own-folder", timeout=240)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (job_dir / "runs" / "own-folder" / "metrics.csv").is_file()


def test_a_worker_refuses_an_unknown_rank_io_from_its_environment_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse checks a flag's choices, not a default read from the environment."""
    argv = ["--run", "r", "--redis-url", DEAD]
    assert _run_main("worker", argv, {"FLODL_RANK_IO": "procss"}, monkeypatch) == 2
    err = capsys.readouterr().err
    assert err == (
        "flodl-bus worker: --rank-io (or FLODL_RANK_IO) must be one of threads, process, "
        "got 'procss'\n"
    )
    with pytest.raises(SystemExit) as exited:
        _run_main("worker", [*argv, "--rank-io", "procss"], {}, monkeypatch)
    assert exited.value.code == 2
    assert "invalid choice: 'procss'" in capsys.readouterr().err
