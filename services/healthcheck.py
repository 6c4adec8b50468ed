"""Container health check of a flodl_bus service (compose.yaml, services/Dockerfile).

    FLODL_ROLE=coordinator|worker python services/healthcheck.py

Healthy when Redis answers with this service's own ACL user (FLODL_REDIS_URL plus
FLODL_REDIS_USERNAME / FLODL_REDIS_PASSWORD), and, for the coordinator, once the run's
identity is published (``flodl:{RUN}:identity``, its public keys, written after the secret
whether that came from FLODL_RUN_SECRET or was created in Redis): workers can only join
after that, which is what ``depends_on: condition: service_healthy`` waits for. Exit status 0 healthy, 1 not.
"""

from __future__ import annotations

import os
import sys

from flodl_bus.bus.connection import DEFAULT_URL, ENV_URL, connect, redact_url
from flodl_bus.bus.keys import RunKeys


def check(role: str, url: str, run: str | None) -> str | None:
    """None when healthy, else why not."""
    client = connect(url, socket_timeout=3.0, connect_timeout=3.0, client_name="flodl-health")
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


def run_id() -> str | None:
    """FLODL_RUN, else the id the coordinator's entrypoint picked (runs/.compose-run)."""
    run = os.environ.get("FLODL_RUN")
    if run:
        return run
    try:
        with open(os.path.join("runs", ".compose-run")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def main() -> int:
    role = os.environ.get("FLODL_ROLE", "worker")
    why = check(role, os.environ.get(ENV_URL, DEFAULT_URL), run_id())
    if why is not None:
        print(f"unhealthy ({role}): {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
