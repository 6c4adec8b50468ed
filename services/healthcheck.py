"""Container health check of a flodl_bus service (compose.yaml, services/Dockerfile).

    FLODL_ROLE=coordinator|worker python services/healthcheck.py

Credentials: FLODL_REDIS_URL plus FLODL_REDIS_USERNAME / FLODL_REDIS_PASSWORD, and, when
FLODL_CREDENTIALS names a file (compose: the run's own user, from the credentials
service), the KEY=VALUE lines of that file over them, as the service's entrypoint reads
it; a named file that cannot be read is unhealthy.

- worker: healthy when Redis answers PING as that user. No run state is checked: a
  worker may wait to be admitted, or sit in a formed world, and be fine.
- coordinator: healthy once *this* coordinator started its run: the run's ``meta``
  says ``status`` ``joining`` or ``running`` and the run's ``identity`` (the
  coordinator's public keys, which it publishes after its secret is in place) exists.
  Workers can only join after that, which is what ``depends_on: condition:
  service_healthy`` waits for. A run that finished (``status`` ``finished``) is
  unhealthy again, which nothing waits on by then.

The run is FLODL_RUN (from the file or the environment), else ``runs/.compose-run``.
Exit status 0 healthy, 1 not (with one line on stderr).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from flodl_bus.bus.connection import DEFAULT_URL, ENV_URL, connect, redact_url
from flodl_bus.bus.keys import RunKeys

#: a file of KEY=VALUE lines whose values win over the environment (compose.yaml)
ENV_CREDENTIALS = "FLODL_CREDENTIALS"


def check(role: str, url: str, run: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """None when healthy, else why not (credentials from ``env``, default the process's)."""
    try:
        client = connect(
            url, socket_timeout=3.0, connect_timeout=3.0, client_name="flodl-health", env=env
        )
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    try:
        if not client.ping():
            return f"no PONG from {redact_url(url)}"
        if role == "coordinator":
            if not run:
                return "FLODL_RUN is not set"
            keys = RunKeys(run)
            # A volume-persisted Redis may still hold the previous compose run's identity
            # and meta: healthy only once *this* coordinator has started the run.
            status = client.hget(keys.meta, "status")
            if status not in (b"joining", b"running") or not client.exists(keys.identity):
                return f"run {run!r} is not started by this coordinator yet"
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        client.close()


def read_env_file(path: str) -> dict[str, str]:
    """KEY=VALUE lines (``flodl-bus acl create --env-dir``); blank lines and ``#`` skipped."""
    out: dict[str, str] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                key, value = line.split("=", 1)
                out[key] = value
    return out


def service_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment the service runs with: FLODL_CREDENTIALS's file over ``environ``."""
    path = environ.get(ENV_CREDENTIALS)
    if not path:
        return dict(environ)
    return {**environ, **read_env_file(path)}


def run_id(environ: Mapping[str, str] | None = None) -> str | None:
    """FLODL_RUN, else the id the coordinator's entrypoint picked (runs/.compose-run)."""
    run = (os.environ if environ is None else environ).get("FLODL_RUN")
    if run:
        return run
    try:
        with open(os.path.join("runs", ".compose-run")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def main() -> int:
    role = os.environ.get("FLODL_ROLE", "worker")
    try:
        env = service_env(os.environ)
    except OSError as exc:
        print(f"unhealthy ({role}): credentials: {exc}", file=sys.stderr)
        return 1
    why = check(role, env.get(ENV_URL, DEFAULT_URL), run_id(env), env)
    if why is not None:
        print(f"unhealthy ({role}): {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
