"""What compose.yaml asks of a fresh clone and of a shared machine (issue 30): the user's
job mounted and importable, ./runs handed to the services' user before anything writes,
each service holding only its run's own Redis user, and the health check as it behaves.

The shell steps (services/init-dirs.sh, services/entrypoint-credentials.sh) and the
health check run as they are, against a redis-server that loads ops/compose.acl."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from flodl_bus.bus import acl
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.server import RedisServer
from tests.deploy.compose import ROOT, host_argv, in_container, load, mounts, read_only, service_env

SERVICES = ROOT / "services"
COMPOSE_ACL = ROOT / "ops" / "compose.acl"
FLODL = ("coordinator", "worker", "worker-gpu")


# ------------------------------------------------------------------------- the job


@pytest.mark.parametrize("gpu", [False, True])
def test_every_flodl_service_mounts_the_jobs_directory_read_only_on_its_pythonpath(
    gpu: bool,
) -> None:
    services = load({}, gpu=gpu)["services"]
    for name in FLODL:
        svc = services[name]
        where = mounts(svc, ROOT, Path("/volumes"))
        assert where["/app/jobs"] == ROOT / "jobs", name
        assert "/app/jobs" in read_only(svc), name
        assert "/app/jobs" in service_env(svc)["PYTHONPATH"].split(":"), name
        assert where["/app/runs"] == ROOT / "runs", name
    # another directory, and the job chosen, without editing the file
    chosen = load({"FLODL_JOBS": "/srv/my-jobs", "FLODL_JOB": "mypkg.train:job"})["services"]
    for name in FLODL:
        assert mounts(chosen[name], ROOT, Path("/v"))["/app/jobs"] == Path("/srv/my-jobs")
        assert service_env(chosen[name])["FLODL_JOB"] == "mypkg.train:job"
    # a derived image with the job installed: one tag for every service, no file edited
    tagged = load({"FLODL_IMAGE_TAG": "mine"}, gpu=True)["services"]
    assert {tagged[n]["image"] for n in ("init", "credentials", "coordinator", "worker")} == {
        "flodl-bus:mine"
    }
    assert tagged["worker-gpu"]["image"] == "flodl-bus:mine-gpu"
    # a fresh clone has the directory, so Docker makes nothing root-owned for it
    assert (ROOT / "jobs" / "requirements.txt").is_file()


def test_the_image_carries_the_jobs_with_their_requirements_on_the_pythonpath() -> None:
    lines = (ROOT / "services" / "Dockerfile").read_text().splitlines()

    def at(prefix: str) -> int:
        return next(i for i, line in enumerate(lines) if line.startswith(prefix))

    text = "\n".join(lines)
    assert "PYTHONPATH=/app/jobs" in text
    # requirements after the package, the code last: a job edit rebuilds one layer
    assert (
        at("RUN pip install --no-deps .")
        < at("COPY jobs/requirements.txt")
        < at("COPY jobs ./jobs")
    )
    ignore = (ROOT / "services" / "Dockerfile.dockerignore").read_text().splitlines()
    assert "!jobs/**" in ignore


def test_the_dockerfile_installs_job_requirements_only_when_there_are_some(tmp_path: Path) -> None:
    lines = (ROOT / "services" / "Dockerfile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("RUN if grep"))
    cond = lines[start][len("RUN if ") :].split("; then")[0]
    req = tmp_path / "jobs" / "requirements.txt"
    req.parent.mkdir()

    def wants_install(text: str) -> bool:
        req.write_text(text)
        done = subprocess.run(["sh", "-c", cond], cwd=tmp_path, timeout=30)
        return done.returncode == 0

    assert not wants_install((ROOT / "jobs" / "requirements.txt").read_text())
    assert not wants_install("\n   \n# only a comment\n")
    assert wants_install("# a comment\nscipy>=1.10\n")
    assert wants_install("  numpy\n")


# ------------------------------------------------------------------------ ./runs


def _after_init(services: dict[str, Any], name: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether ``name`` starts only once init completed, directly or through a dependency."""
    deps = services[name].get("depends_on") or {}
    if deps.get("init", {}).get("condition") == "service_completed_successfully":
        return True
    return any(_after_init(services, d, seen | {name}) for d in deps if d not in seen)


def test_init_is_the_only_root_service_and_runs_before_anything_that_writes() -> None:
    for gpu in (False, True):
        services = load({}, gpu=gpu)["services"]
        init = services["init"]
        assert init["user"] == "0:0"
        assert [n for n, s in services.items() if str(s.get("user", "")).split(":")[0] == "0"] == [
            "init"
        ]
        argv = init["command"]
        where = mounts(init, ROOT, Path("/volumes"))
        # it hands over exactly what the others write: ./runs and both credential volumes
        assert [where[a] for a in argv[1:]] == [
            ROOT / "runs",
            Path("/volumes/coordinator-credentials"),
            Path("/volumes/worker-credentials"),
        ]
        env = service_env(init)
        assert (env["FLODL_UID"], env["FLODL_GID"]) == ("1000", "1000")
        assert services["credentials"]["depends_on"]["init"]["condition"] == (
            "service_completed_successfully"
        )

        for name, svc in services.items():
            if any(spec.split(":")[1] == "/app/runs" for spec in svc.get("volumes") or []):
                assert name == "init" or _after_init(services, name), name
    uid = load({"FLODL_UID": "1234", "FLODL_GID": "99"})["services"]["init"]
    assert service_env(uid)["FLODL_UID"] == "1234" and service_env(uid)["FLODL_GID"] == "99"


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory another uid may enter (pytest's own is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="flodl-init-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _echo_bus(bindir: Path) -> None:
    bindir.mkdir(exist_ok=True)
    bindir.chmod(0o755)
    echo = bindir / "flodl-bus"
    echo.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    echo.chmod(0o755)


def _as_uid(
    uid: int, argv: list[str], cwd: Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to act as Docker and as the services' user",
)
def test_a_root_owned_runs_is_refused_loudly_until_init_hands_it_to_the_services_user(
    shared_tmp: Path,
) -> None:
    services = load({})["services"]
    uid = int(services["coordinator"]["user"].split(":")[0])
    app = shared_tmp / "app"
    (app / "runs").mkdir(parents=True)  # what Docker does with a missing ./runs: root's
    app.chmod(0o755)
    bindir = shared_tmp / "bin"
    _echo_bus(bindir)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "FLODL_RUN": "", "HOME": "/tmp"}
    # The entrypoints as the image holds them, readable by the services' user wherever
    # this checkout lies (a clone under a root-only directory is unreadable to uid 1000).
    scripts = shared_tmp / "services"
    shutil.copytree(SERVICES, scripts)
    for path in (scripts, *scripts.iterdir()):
        path.chmod(0o755)
    entry = ["sh", str(scripts / "entrypoint-coordinator.sh")]

    refused = _as_uid(uid, entry, app, env)
    assert refused.returncode == 2, refused
    assert "runs is not writable by uid 1000" in refused.stderr and "owner 0:0" in refused.stderr
    assert not (app / "runs" / ".compose-run").exists()
    worker = _as_uid(uid, ["sh", str(scripts / "entrypoint-worker.sh")], app,
                     {**env, "FLODL_RUN": "r"})  # fmt: skip
    assert worker.returncode == 2 and "not writable" in worker.stderr, worker

    # the init service, with compose's command and environment, paths as mounted here
    init = services["init"]
    where = mounts(init, app, shared_tmp / "volumes")
    argv = host_argv([in_container(a, where) for a in init["command"]])
    done = subprocess.run(["sh", *argv], env={**env, **service_env(init)}, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "was 0:0, now 1000:1000" in done.stdout
    for path, mode in [(app / "runs", None), *((Path(a), 0o700) for a in argv[2:])]:
        st = path.stat()
        assert (st.st_uid, st.st_gid) == (1000, 1000), path
        if mode is not None:
            assert stat.S_IMODE(st.st_mode) == mode, path

    started = _as_uid(uid, entry, app, env)
    assert started.returncode == 0, started.stderr
    assert (app / "runs" / ".compose-run").stat().st_uid == 1000
    # a second init changes nothing and says nothing
    again = subprocess.run(["sh", *argv], env={**env, **service_env(init)}, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert again.returncode == 0 and again.stdout == "", again


def test_init_refuses_a_uid_that_is_not_a_number(tmp_path: Path) -> None:
    for uid, gid in (("flodl", "1000"), ("1000", ""), ("1000", "1x")):
        done = subprocess.run(
            ["sh", str(SERVICES / "init-dirs.sh"), str(tmp_path / "runs")],
            env={"PATH": os.environ["PATH"], "FLODL_UID": uid, "FLODL_GID": gid},
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert done.returncode == 2, (uid, gid, done)
        assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------- credentials


def test_no_service_but_credentials_holds_a_redis_password_and_each_mounts_its_own_file() -> None:
    for gpu in (False, True):
        services = load({}, gpu=gpu)["services"]
        for name, svc in services.items():
            env = service_env(svc)
            if name != "credentials":
                assert "FLODL_REDIS_PASSWORD" not in env and "FLODL_REDIS_USERNAME" not in env
        admin = service_env(services["credentials"])
        assert admin["FLODL_REDIS_USERNAME"] == acl.ADMIN_USER
        assert admin["FLODL_REDIS_PASSWORD"] == "flodl-admin-dev"
        volumes = Path("/volumes")
        where = {n: mounts(s, ROOT, volumes) for n, s in services.items()}
        coordinator_vol = volumes / "coordinator-credentials"
        worker_vol = volumes / "worker-credentials"
        holders = {n for n, w in where.items() if coordinator_vol in w.values()}
        assert holders == {"init", "credentials", "coordinator"}
        holders = {n for n, w in where.items() if worker_vol in w.values()}
        assert holders == {"init", "credentials", "worker", "worker-gpu"}
        for name in FLODL:
            env = service_env(services[name])
            role = "coordinator" if name == "coordinator" else "worker"
            file = Path(in_container(env["FLODL_CREDENTIALS"], where[name]))
            assert file == volumes / f"{role}-credentials" / f"{role}.env", name
            # read-only: a worker cannot rewrite what the next worker reads
            assert str(Path(env["FLODL_CREDENTIALS"]).parent) in read_only(services[name])
            assert services[name]["depends_on"]  # after credentials, through the coordinator
        deps = services["coordinator"]["depends_on"]
        assert deps["credentials"]["condition"] == "service_completed_successfully"
        assert services["credentials"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert (
        load({"FLODL_ADMIN_PASSWORD": "s3"})["services"]["credentials"]["environment"][
            "FLODL_REDIS_PASSWORD"
        ]
        == "s3"
    )


def test_compose_redis_knows_no_static_coordinator_or_worker() -> None:
    redis_svc = load({})["services"]["redis"]
    where = mounts(redis_svc, ROOT, Path("/volumes"))
    assert where["/etc/redis/users.acl"] == COMPOSE_ACL
    lines = COMPOSE_ACL.read_text().splitlines()
    assert lines[0] == "user default off"
    users = {}
    for line in lines[1:]:
        _, name, on, hashed, rules = line.split(" ", 4)
        assert on == "on" and hashed.startswith("#")
        users[name] = (hashed[1:], rules)
    assert set(users) == {"observer", acl.ADMIN_USER}
    assert users["observer"][1] == " ".join(acl.role_rules(None, "observer"))
    assert users[acl.ADMIN_USER][1] == " ".join(acl.admin_rules())
    assert users[acl.ADMIN_USER][0] == acl.password_hash("flodl-admin-dev")
    # the redis health check's observer password is the one this file holds
    probe = redis_svc["healthcheck"]["test"]
    assert acl.password_hash(probe[probe.index("--pass") + 1]) == users["observer"][0]


@pytest.fixture(scope="module")
def compose_redis() -> Iterator[RedisServer]:
    server = RedisServer(extra_args=["--aclfile", str(COMPOSE_ACL)]).start()
    try:
        yield server
    finally:
        server.cleanup()


def _real_bus(bindir: Path) -> None:
    """``flodl-bus`` on PATH as the image has it, running this checkout."""
    bindir.mkdir(exist_ok=True)
    bus = bindir / "flodl-bus"
    cmd = f'PYTHONPATH="{ROOT}" exec "{sys.executable}" -m flodl_bus.cli "$@"'
    bus.write_text(f"#!/bin/sh\n{cmd}\n")
    bus.chmod(0o755)


def _credentials(server: RedisServer, tmp: Path, host: dict[str, str]) -> dict[str, Path]:
    """Run compose's credentials service here; its mounts, as they are on this machine."""
    svc = load(host)["services"]["credentials"]
    where = mounts(svc, tmp, tmp / "volumes")
    for path in where.values():
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    env = {k: in_container(v, where) for k, v in service_env(svc).items()}
    env["FLODL_REDIS_URL"] = f"redis://127.0.0.1:{server.port}/0"  # compose's redis:6379
    _real_bus(tmp / "bin")
    env["PATH"] = f"{tmp / 'bin'}:{os.environ['PATH']}"
    done = subprocess.run([*host_argv(svc["command"])], env=env, cwd=tmp, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FLODL_REDIS_PASSWORD" not in done.stdout + done.stderr
    return where


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line)


def _admin(server: RedisServer) -> redis.Redis:
    return redis.Redis(port=server.port, username=acl.ADMIN_USER, password="flodl-admin-dev",
                       socket_timeout=5)  # fmt: skip


def _client(server: RedisServer, env: dict[str, str]) -> redis.Redis:
    return redis.Redis(port=server.port, username=env["FLODL_REDIS_USERNAME"],
                       password=env["FLODL_REDIS_PASSWORD"], socket_timeout=5)  # fmt: skip


@pytest.mark.redis
def test_credentials_give_each_role_its_own_run_user_and_nothing_else(
    compose_redis: RedisServer, tmp_path: Path
) -> None:
    where = _credentials(compose_redis, tmp_path, {"FLODL_RUN": "ops-a"})
    coord_dir = where["/app/credentials/coordinator"]
    worker_dir = where["/app/credentials/worker"]
    assert sorted(p.name for p in coord_dir.iterdir()) == ["coordinator.env", "observer.env"]
    assert sorted(p.name for p in worker_dir.iterdir()) == ["worker.env"]
    for path in (*coord_dir.iterdir(), *worker_dir.iterdir()):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    coord = _env_file(coord_dir / "coordinator.env")
    work = _env_file(worker_dir / "worker.env")
    assert coord["FLODL_RUN"] == work["FLODL_RUN"] == "ops-a"
    assert coord["FLODL_REDIS_USERNAME"] == "flodl-ops-a-coordinator"
    assert work["FLODL_REDIS_USERNAME"] == "flodl-ops-a-worker"
    assert coord["FLODL_RUN_SECRET"] == work["FLODL_RUN_SECRET"]
    assert coord["FLODL_REDIS_PASSWORD"] not in (worker_dir / "worker.env").read_text()

    keys, other = RunKeys("ops-a"), RunKeys("ops-other")
    c = _client(compose_redis, coord)
    c.set(keys.secret, "ab" * 16)
    c.hset(keys.meta, "status", "running")
    w = _client(compose_redis, work)
    try:
        assert w.hget(keys.meta, "status") == b"running"
        # what the static worker could and this one cannot: the secret, another run
        with pytest.raises(redis.exceptions.NoPermissionError):
            w.get(keys.secret)
        with pytest.raises(redis.exceptions.NoPermissionError):
            w.xadd(other.up(0), {"type": "x"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            w.xadd(keys.ctl_all, {"type": "x"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            c.get(other.secret)
    finally:
        c.close()
        w.close()
    # the static users of ops/users.acl do not exist on compose's Redis
    static_users = (("worker", "flodl-worker-dev"), ("coordinator", "flodl-coordinator-dev"))
    for user, password in static_users:
        static = redis.Redis(port=compose_redis.port, username=user, password=password,
                             socket_timeout=5)  # fmt: skip
        with pytest.raises(redis.exceptions.AuthenticationError):
            static.ping()
        static.close()


@pytest.mark.redis
def test_each_up_gets_a_fresh_run_the_services_follow_and_the_last_runs_users_go(
    compose_redis: RedisServer, tmp_path: Path
) -> None:
    admin = _admin(compose_redis)
    _echo_bus(tmp_path / "echo")
    runs = []
    try:
        for _ in range(2):
            where = _credentials(compose_redis, tmp_path, {})
            run = _env_file(where["/app/credentials/coordinator"] / "coordinator.env")["FLODL_RUN"]
            assert run.startswith("compose-")
            runs.append(run)
            for name, script in (("coordinator", "entrypoint-coordinator.sh"),
                                 ("worker", "entrypoint-worker.sh")):  # fmt: skip
                svc = load({})["services"][name]
                svc_where = mounts(svc, tmp_path, tmp_path / "volumes")
                env = {k: in_container(v, svc_where) for k, v in service_env(svc).items()}
                env["PATH"] = f"{tmp_path / 'echo'}:{os.environ['PATH']}"
                done = subprocess.run(["sh", str(SERVICES / script)], cwd=tmp_path, env=env,
                                      capture_output=True, text=True, timeout=30)  # fmt: skip
                assert done.returncode == 0, done.stderr
                argv = done.stdout.splitlines()
                assert argv[argv.index("--run") + 1] == run, name
        assert runs[0] != runs[1]
        assert admin.execute_command("ACL", "GETUSER", f"flodl-{runs[0]}-worker") is None
        assert admin.execute_command("ACL", "GETUSER", f"flodl-{runs[1]}-worker") is not None
        # the same FLODL_RUN again: same users, new passwords (old clients are cut)
        first = _credentials(compose_redis, tmp_path, {"FLODL_RUN": "ops-same"})
        old = _env_file(first["/app/credentials/worker"] / "worker.env")
        _credentials(compose_redis, tmp_path, {"FLODL_RUN": "ops-same"})
        new = _env_file(first["/app/credentials/worker"] / "worker.env")
        assert old["FLODL_REDIS_USERNAME"] == new["FLODL_REDIS_USERNAME"]
        assert old["FLODL_REDIS_PASSWORD"] != new["FLODL_REDIS_PASSWORD"]
        stale = _client(compose_redis, old)
        with pytest.raises(redis.exceptions.AuthenticationError):
            stale.ping()
        stale.close()
    finally:
        admin.close()


def test_a_service_told_of_a_credentials_file_that_is_not_there_stops(tmp_path: Path) -> None:
    _echo_bus(tmp_path / "bin")
    for name, script in (("coordinator", "entrypoint-coordinator.sh"),
                         ("worker", "entrypoint-worker.sh")):  # fmt: skip
        env = service_env(load({})["services"][name])
        env["PATH"] = f"{tmp_path / 'bin'}:{os.environ['PATH']}"
        env["FLODL_CREDENTIALS"] = str(tmp_path / "missing.env")
        done = subprocess.run(["sh", str(SERVICES / script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        assert done.returncode == 2 and "no credentials at" in done.stderr, (name, done)
        assert done.stdout == ""  # flodl-bus never ran, not even with other credentials


# ------------------------------------------------------------------- health check


def _health(role: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    full = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "FLODL_ROLE": role, **env}
    return subprocess.run([sys.executable, str(SERVICES / "healthcheck.py")], env=full, cwd=cwd,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


@pytest.mark.redis
def test_the_health_check_waits_for_this_runs_meta_status_and_identity(
    compose_redis: RedisServer, tmp_path: Path
) -> None:
    where = _credentials(compose_redis, tmp_path, {"FLODL_RUN": "ops-health"})
    url = f"redis://127.0.0.1:{compose_redis.port}/0"
    files = {"coordinator": where["/app/credentials/coordinator"] / "coordinator.env",
             "worker": where["/app/credentials/worker"] / "worker.env"}  # fmt: skip
    creds = {role: {"FLODL_REDIS_URL": url, "FLODL_CREDENTIALS": str(path)}
             for role, path in files.items()}  # fmt: skip
    keys = RunKeys("ops-health")
    writer = _client(compose_redis, _env_file(files["coordinator"]))

    def coordinator() -> subprocess.CompletedProcess[str]:
        return _health("coordinator", creds["coordinator"], tmp_path)

    try:
        # nothing yet: unhealthy, and the secret alone does not make it healthy
        assert coordinator().returncode == 1
        writer.set(keys.secret, "cd" * 16)
        out = coordinator()
        assert out.returncode == 1 and "not started by this coordinator" in out.stderr
        writer.hset(keys.meta, "status", "running")
        assert coordinator().returncode == 1  # no identity yet
        writer.hset(keys.identity, mapping={"sign": "00" * 32})
        assert coordinator().returncode == 0, coordinator().stderr
        writer.hset(keys.meta, "status", "joining")
        assert coordinator().returncode == 0
        writer.hset(keys.meta, "status", "finished")  # a previous up's run left in Redis
        assert coordinator().returncode == 1
        writer.hset(keys.meta, "status", "running")
        # the worker: PING as its own user is enough, whatever the run's state
        assert _health("worker", creds["worker"], tmp_path).returncode == 0
        writer.delete(keys.meta)
        assert _health("worker", creds["worker"], tmp_path).returncode == 0
        # credentials are what the file says: a wrong or missing file is unhealthy
        bad = tmp_path / "bad.env"
        bad.write_text("FLODL_REDIS_USERNAME=flodl-ops-health-worker\nFLODL_REDIS_PASSWORD=no\n")
        out = _health("worker", {**creds["worker"], "FLODL_CREDENTIALS": str(bad)}, tmp_path)
        assert out.returncode == 1 and "unhealthy (worker)" in out.stderr
        out = _health("worker", {**creds["worker"], "FLODL_CREDENTIALS": str(tmp_path / "x")},
                      tmp_path)  # fmt: skip
        assert out.returncode == 1 and "credentials" in out.stderr
    finally:
        writer.close()
