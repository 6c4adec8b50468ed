"""compose.yaml: its shape, and its coordinator and worker services run as processes.

There is no Docker engine here, so the services start exactly as compose would start
them (the same command, the same environment, interpolated the same way) against a
redis-server that loads the ACL file compose gives Redis (ops/compose.acl), so each
service talks as its own ACL user: the run's own, made by the credentials service. Only
the Redis address differs: ``redis:6379`` is the compose network's name for it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.server import RedisServer, free_port
from flodl_bus.record.log import read_records
from tests.deploy.compose import (
    COMPOSE,
    ROOT,
    host_argv,
    in_container,
    interpolate,
    load,
    mounts,
    service_env,
)

ACL = ROOT / "ops" / "users.acl"
COMPOSE_ACL = ROOT / "ops" / "compose.acl"
CONF = ROOT / "ops" / "redis.conf"


def test_interpolation_follows_compose_rules() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${MISSING:-d}", env) == "x d d"
    assert interpolate("${EMPTY-d} ${MISSING-d} $${SET}", env) == " d ${SET}"
    with pytest.raises(KeyError):
        interpolate("${MISSING:?set it}", env)


def test_the_services_have_health_checks_and_the_worker_scales() -> None:
    services = load()["services"]
    assert set(services) >= {"redis", "coordinator", "worker", "worker-gpu"}
    for name in ("redis", "coordinator", "worker", "worker-gpu"):
        assert services[name]["healthcheck"]["test"], name
    worker = services["worker"]
    # --scale needs replicas that differ in nothing: no fixed name, port or rank.
    assert "container_name" not in worker and "ports" not in worker
    entry = (ROOT / "services" / "entrypoint-worker.sh").read_text()
    assert "--rank" not in entry
    assert worker["depends_on"]["coordinator"]["condition"] == "service_healthy"
    assert services["coordinator"]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_redis_runs_the_ops_config_with_the_acl_file_where_the_config_expects_it() -> None:
    redis_svc = load()["services"]["redis"]
    assert redis_svc["image"].startswith("redis:7")
    mounts = {m.split(":")[1]: m.split(":")[0] for m in redis_svc["volumes"]}
    conf_path = redis_svc["command"][1]
    assert Path(mounts[conf_path]).name == "redis.conf"
    aclfile = next(line.split()[1] for line in CONF.read_text().splitlines()
                   if line.startswith("aclfile "))  # fmt: skip
    # compose's own: the static observer and the admin, no static coordinator or worker
    assert Path(mounts[aclfile]) == Path("./ops/compose.acl")


def test_the_gpu_profile_reserves_gpus_and_enlarges_shared_memory() -> None:
    gpu = load()["services"]["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["shm_size"] == "2gb"
    [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


def test_the_dockerfile_installs_cpu_torch_first_then_the_package() -> None:
    text = (ROOT / "services" / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in text
    assert "ARG TORCH_VERSION=2.13.0" in text
    assert "whl/cpu" in text
    assert text.index('"torch==${TORCH_VERSION}"') < text.index("RUN pip install --no-deps .")


def test_the_dockerfile_installs_the_dependencies_in_a_layer_before_the_code() -> None:
    lines = (ROOT / "services" / "Dockerfile").read_text().splitlines()

    def at(prefix: str) -> int:
        return next(i for i, line in enumerate(lines) if line.startswith(prefix))

    deps = at('RUN python -c "import tomllib')
    # only the project file is in the image when the dependencies install...
    assert at("COPY pyproject.toml") < deps < at("COPY flodl_bus")
    # ...and the package goes in after the code, without touching them
    assert at("COPY flodl_bus") < at("RUN pip install --no-deps .")
    # what that layer installs is the project's dependency list (run its command here)
    cmd = " ".join(line.rstrip("\\") for line in lines[deps : deps + 3])
    listed = subprocess.run(
        ["sh", "-c", cmd[len("RUN ") :].split(" > ")[0]], cwd=ROOT, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert listed.stdout.split() == [*project["dependencies"],
                                     *project["optional-dependencies"]["plot"]]  # fmt: skip


def test_the_image_and_the_services_run_as_a_non_root_user() -> None:
    lines = (ROOT / "services" / "Dockerfile").read_text().splitlines()
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    for name, svc in load({})["services"].items():
        if name not in ("redis", "init"):  # init: the one root step (test_compose_ops.py)
            uid = svc["user"].split(":")[0]
            assert uid.isdigit() and int(uid) != 0, (name, svc["user"])
    assert load({"FLODL_UID": "1234"})["services"]["worker"]["user"].startswith("1234:")


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    for unit in sorted(units, key=len, reverse=True):
        if duration.endswith(unit) and duration[: -len(unit)].replace(".", "").isdigit():
            return float(duration[: -len(unit)]) * units[unit]
    raise ValueError(duration)


def test_stop_grace_period_outlasts_the_coordinators_exit_grace() -> None:
    from flodl_bus.coordinator.runtime import LoopOptions

    grace = LoopOptions().exit_grace
    for gpu in (False, True):
        for name, svc in load({}, gpu=gpu)["services"].items():
            if name != "redis":
                assert _seconds(svc["stop_grace_period"]) > grace + 5, name


def test_the_gpu_profile_defaults_the_run_to_an_nccl_mode_and_leaves_cpu_workers_out() -> None:
    plain = load({})["services"]
    assert plain["coordinator"]["environment"]["FLODL_MODE"] == "cpu-cadence"
    gpu = load({}, gpu=True)["services"]
    # the coordinator picks the run's mode: the default must reach it, and the GPU
    # workers pin the same one (a mismatch is refused at join)
    assert gpu["coordinator"]["environment"]["FLODL_MODE"] == "nccl-cadence"
    assert gpu["worker-gpu"]["environment"]["FLODL_MODE"] == "nccl-cadence"
    assert gpu["worker-gpu"]["profiles"] == ["gpu"]
    assert "gpu" not in gpu["worker"].get("profiles", []) and gpu["worker"].get("profiles")
    # FLODL_MODE still wins
    chosen = load({"FLODL_MODE": "cpu-sync"}, gpu=True)["services"]
    assert chosen["coordinator"]["environment"]["FLODL_MODE"] == "cpu-sync"
    # the rest of the coordinator's environment survives the override
    assert gpu["coordinator"]["environment"]["FLODL_ROLE"] == "coordinator"


def test_the_readme_advises_exit_code_from_the_coordinator() -> None:
    readme = (ROOT / "README.md").read_text()
    compose_lines = [line for line in readme.splitlines() if "docker compose" in line
                     and " up" in line]  # fmt: skip
    assert compose_lines and all("--exit-code-from coordinator" in line
                                 for line in compose_lines)  # fmt: skip


def test_redis_conf_binds_loopback_and_compose_widens_it_on_its_own_network() -> None:
    binds = [line.split()[1:] for line in CONF.read_text().splitlines()
             if line.startswith("bind ")]  # fmt: skip
    assert binds == [["127.0.0.1", "-::1"]]
    command = load({})["services"]["redis"]["command"]
    assert command[command.index("--bind") + 1] == "0.0.0.0"
    ports = load({})["services"]["redis"]["ports"]
    assert all(p.startswith("127.0.0.1:") for p in ports)


@pytest.mark.redis
def test_the_ops_readme_redis_command_works_as_written(tmp_path: Path) -> None:
    text = (ROOT / "ops" / "README.md").read_text()
    [command] = [line for line in text.splitlines() if "redis-server ops/redis.conf" in line]
    (tmp_path / "ops").symlink_to(ROOT / "ops")
    port = free_port()
    proc = subprocess.Popen(
        ["bash", "-c", f"{command} --port {port}"], cwd=tmp_path, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        client = redis.Redis(port=port, username="observer", password="flodl-observer-dev",
                             socket_timeout=5)  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                assert client.ping()
                break
            except redis.exceptions.ConnectionError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline
                time.sleep(0.1)
        client.close()
        assert (tmp_path / "runs" / "redis").is_dir()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="no docker-compose binary")
@pytest.mark.parametrize("profile", [[], ["--profile", "gpu"]])
def test_docker_compose_accepts_the_file(profile: list[str]) -> None:
    result = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), *profile, "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------- processes


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[RedisServer]:
    # One per module: with the default user off, the start-up probe's failed AUTH costs
    # redis-py seconds. The tests use runs of their own names.
    server = RedisServer(extra_args=["--aclfile", str(ACL)]).start()
    try:
        yield server
    finally:
        server.cleanup()


def _start(argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _healthy(env: dict[str, str], test: list[str], timeout: float) -> bool:
    argv = host_argv([a for a in test if a != "CMD"])
    argv = [sys.executable if a == "python" else a for a in argv]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode == 0:
            return True
        time.sleep(0.5)
    return False


@pytest.fixture(scope="module")
def compose_redis() -> Iterator[RedisServer]:
    """Redis as compose starts it: ops/compose.acl, no static coordinator or worker."""
    server = RedisServer(extra_args=["--aclfile", str(COMPOSE_ACL)]).start()
    try:
        yield server
    finally:
        server.cleanup()


MOUNTED_JOB = """\
import dataclasses

from flodl_bus.examples.digits import job as digits

job = dataclasses.replace(digits, name="mounted-job")
"""


@pytest.mark.slow
@pytest.mark.redis
def test_a_job_of_the_jobs_directory_trains_with_per_run_users_as_compose_starts_it(
    compose_redis: RedisServer, tmp_path: Path
) -> None:
    """Every compose step in order, each with its own command, environment and mounts
    (tmp_path stands for the project directory and the image's /app): init, credentials,
    the coordinator, two ranked-less workers, training a job that lives in a jobs
    directory the image does not have, each service talking as its run's own user."""
    jobs = tmp_path / "my-jobs"
    jobs.mkdir()
    (jobs / "mountedjob.py").write_text(MOUNTED_JOB)
    host_env = {
        "FLODL_WORLD_SIZE": "2", "FLODL_EPOCHS": "2", "FLODL_JOBS": str(jobs),
        "FLODL_JOB": "mountedjob:job",
        # the services' user is whoever runs this test (init's chown is then a no-op)
        "FLODL_UID": str(os.geteuid()), "FLODL_GID": str(os.getegid()),
    }  # fmt: skip
    services = load(host_env)["services"]
    url = f"redis://127.0.0.1:{compose_redis.port}/0"
    volumes = tmp_path / "volumes"

    def env_of(name: str) -> tuple[dict[str, str], list[str]]:
        svc = services[name]
        where = mounts(svc, tmp_path, volumes)
        env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "VIRTUAL_ENV") if k in os.environ}
        env.update({k: in_container(v, where) for k, v in service_env(svc).items()})
        env["FLODL_REDIS_URL"] = url  # compose's redis:6379 is this server
        env["PYTHONPATH"] = f"{env.get('PYTHONPATH', '')}:{ROOT}"
        env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"
        return env, host_argv([in_container(a, where) for a in svc["command"]])

    # `flodl-bus` as the image has it, running this checkout
    (tmp_path / "bin").mkdir()
    bus = tmp_path / "bin" / "flodl-bus"
    bus.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m flodl_bus.cli "$@"\n')
    bus.chmod(0o755)

    # The redis service's own health check, run against this server.
    probe = [a for a in services["redis"]["healthcheck"]["test"] if a != "CMD"]
    pong = subprocess.run([*probe[:1], "-p", str(compose_redis.port), *probe[1:]],
                          capture_output=True, text=True, timeout=10)  # fmt: skip
    assert pong.stdout.strip() == "PONG", pong
    # The default user is off: a client without credentials gets nothing.
    anonymous = redis.Redis(port=compose_redis.port, socket_timeout=5)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.ping()
    anonymous.close()

    for one_shot in ("init", "credentials"):
        env, argv = env_of(one_shot)
        done = subprocess.run(["sh", *argv], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, (one_shot, done.stdout, done.stderr)
    assert (tmp_path / "runs").is_dir()

    procs: list[subprocess.Popen[bytes]] = []
    try:
        coord_env, coord_argv = env_of("coordinator")
        procs.append(_start(coord_argv, coord_env, tmp_path, tmp_path / "coordinator.log"))
        health = services["coordinator"]["healthcheck"]["test"]
        assert _healthy(coord_env, health, 60), (tmp_path / "coordinator.log").read_text()
        worker_env, worker_argv = env_of("worker")
        for i in range(2):
            procs.append(_start(worker_argv, worker_env, tmp_path, tmp_path / f"worker{i}.log"))
        assert _healthy(worker_env, services["worker"]["healthcheck"]["test"], 30)
        deadline = time.monotonic() + 180
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        logs = "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log"))
        )
        assert [p.returncode for p in procs] == [0, 0, 0], logs
        assert "NOPERM" not in logs and "no permissions" not in logs, logs
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)

    coord_file = volumes / "coordinator-credentials" / "coordinator.env"
    run = next(line.split("=", 1)[1] for line in coord_file.read_text().splitlines()
               if line.startswith("FLODL_RUN="))  # fmt: skip
    assert run.startswith("compose-")  # FLODL_RUN unset: a fresh one for this up
    run_dir = tmp_path / "runs" / run
    header = read_records(run_dir / "coordinator.jsonl")[0]
    members = header["members"]
    assert sorted(m["rank"] for m in members) == [0, 1]
    assert not any(m["requested"] for m in members)  # ranks were assigned, not asked for
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + 2  # header + one row per epoch
    # the ranks trained the mounted job, not the image's default
    ranks = [read_records(run_dir / f"rank{r}.jsonl")[0] for r in (0, 1)]
    assert [h["job"] for h in ranks] == ["mountedjob:job"] * 2
    # each process logged in as its run's own user: there is no static one to log in as
    admin = redis.Redis(port=compose_redis.port, username="flodl-admin",
                        password="flodl-admin-dev", socket_timeout=5)  # fmt: skip
    for role in ("coordinator", "worker", "observer"):
        assert admin.execute_command("ACL", "GETUSER", f"flodl-{run}-{role}") is not None
    for static in ("coordinator", "worker"):
        assert admin.execute_command("ACL", "GETUSER", static) is None
    admin.close()


@pytest.mark.redis
def test_the_observer_user_tails_with_ops_tail_sh_and_cannot_write(acl_redis: RedisServer) -> None:
    writer = redis.Redis(port=acl_redis.port, username="coordinator",
                         password="flodl-coordinator-dev", socket_timeout=5)  # fmt: skip
    for i in range(3):
        writer.xadd("flodl:{obs}:ctl:all", {"type": "Shutdown", "rank": "all", "seq": str(i),
                                            "body": b"\x80", "mac": "00"})  # fmt: skip
    writer.close()
    url = f"redis://observer:flodl-observer-dev@127.0.0.1:{acl_redis.port}/0"
    env = {**os.environ, "REDIS_URL": url, "TAIL_ROUNDS": "1", "TAIL_FROM_START": "1"}
    out = subprocess.run(["bash", str(ROOT / "ops" / "tail.sh"), "obs"], env=env,
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if "type=Shutdown" in line]
    assert len(lines) == 3, out.stdout + out.stderr
    observer = redis.Redis.from_url(url, socket_timeout=5)
    with pytest.raises(redis.exceptions.NoPermissionError):
        observer.xadd("flodl:{obs}:ctl:all", {"type": "x"})
    # no script at all: a busy one would stop the server for every run (issue 28)
    with pytest.raises(redis.exceptions.NoPermissionError):
        observer.eval_ro("return redis.call('DEL', KEYS[1])", 1, "flodl:{obs}:ctl:all")
    with pytest.raises(redis.exceptions.NoPermissionError):
        observer.eval_ro("while true do end", 0)
    assert observer.xlen("flodl:{obs}:ctl:all") == 3
    # The observer watches everything but can never learn the MAC key to forge entries.
    with pytest.raises(redis.exceptions.NoPermissionError):
        observer.get(RunKeys("obs").secret)
    observer.close()
