"""compose.yaml: its shape, and its coordinator and worker services run as processes.

There is no Docker engine here, so the services start exactly as compose would start
them (the same command, the same environment, interpolated the same way) against a
redis-server that loads ops/users.acl, so each service talks as its own ACL user. Only
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
from typing import Any

import pytest
import redis

from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.server import RedisServer
from flodl_bus.record.log import read_records
from tests.deploy.compose import COMPOSE, ROOT, host_argv, interpolate, load, service_env

ACL = ROOT / "ops" / "users.acl"
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
    assert Path(mounts[aclfile]).name == "users.acl"


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
    assert text.index('"torch==${TORCH_VERSION}"') < text.index("RUN pip install .")


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


def _start(
    service: dict[str, Any], env: dict[str, str], cwd: Path, log: Path
) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            host_argv(service["command"]),
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _env_of(service: dict[str, Any], redis_url: str) -> dict[str, str]:
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "VIRTUAL_ENV") if k in os.environ}
    env.update(service_env(service))
    env["FLODL_REDIS_URL"] = redis_url  # compose's redis:6379 is this server
    env["PYTHONPATH"] = str(ROOT)
    return env


def _healthy(env: dict[str, str], service: dict[str, Any], timeout: float) -> bool:
    argv = host_argv([a for a in service["healthcheck"]["test"] if a != "CMD"])
    argv = [sys.executable if a == "python" else a for a in argv]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode == 0:
            return True
        time.sleep(0.5)
    return False


@pytest.mark.slow
@pytest.mark.redis
def test_three_ranked_less_workers_join_train_and_stop_as_compose_starts_them(
    acl_redis: RedisServer, tmp_path: Path
) -> None:
    host_env = {"FLODL_RUN": "compose-test", "FLODL_WORLD_SIZE": "3", "FLODL_EPOCHS": "2"}
    services = load(host_env)["services"]
    url = f"redis://127.0.0.1:{acl_redis.port}/0"

    # The redis service's own health check, run against this server.
    probe = [a for a in services["redis"]["healthcheck"]["test"] if a != "CMD"]
    pong = subprocess.run([*probe[:1], "-p", str(acl_redis.port), *probe[1:]],
                          capture_output=True, text=True, timeout=10)  # fmt: skip
    assert pong.stdout.strip() == "PONG", pong
    # The default user is off: a client without credentials gets nothing.
    anonymous = redis.Redis(port=acl_redis.port, socket_timeout=5)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.ping()
    anonymous.close()

    procs: list[subprocess.Popen[bytes]] = []
    try:
        coord_env = _env_of(services["coordinator"], url)
        procs.append(
            _start(services["coordinator"], coord_env, tmp_path, tmp_path / "coordinator.log")
        )
        assert _healthy(coord_env, services["coordinator"], 60), (
            tmp_path / "coordinator.log"
        ).read_text()
        worker_env = _env_of(services["worker"], url)
        for i in range(3):
            procs.append(
                _start(services["worker"], worker_env, tmp_path, tmp_path / f"worker{i}.log")
            )
        assert _healthy(worker_env, services["worker"], 30)
        deadline = time.monotonic() + 120
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        logs = "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log"))
        )
        assert [p.returncode for p in procs] == [0, 0, 0, 0], logs
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)

    run_dir = tmp_path / "runs" / "compose-test"
    header = read_records(run_dir / "coordinator.jsonl")[0]
    members = header["members"]
    assert sorted(m["rank"] for m in members) == [0, 1, 2]
    assert not any(m["requested"] for m in members)  # ranks were assigned, not asked for
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + 2  # header + one row per epoch


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
    with pytest.raises(redis.exceptions.ResponseError):
        observer.eval_ro("return redis.call('DEL', KEYS[1])", 1, "flodl:{obs}:ctl:all")
    assert observer.xlen("flodl:{obs}:ctl:all") == 3
    # The observer watches everything but can never learn the MAC key to forge entries.
    with pytest.raises(redis.exceptions.NoPermissionError):
        observer.get(RunKeys("obs").secret)
    observer.close()
