"""Per-run Redis ACL users (DESIGN §3 rule 8): ``flodl-bus acl create|drop|rules``.

    flodl-bus acl create RUN --redis-url ADMIN_URL [--env-dir DIR] [--replace] [--save]
    flodl-bus acl create RUN --print-only [--env-dir DIR]     # ACL file lines, no server
    flodl-bus acl drop RUN --redis-url ADMIN_URL [--save]
    flodl-bus acl rules [RUN]                                 # the rules, no passwords

``create`` makes three users of one run with random passwords (stored as SHA-256
hashes), and prints (or writes to ``DIR/{coordinator,worker,observer}.env``, mode 0600)
the environment each process needs: ``FLODL_RUN``, ``FLODL_REDIS_USERNAME``,
``FLODL_REDIS_PASSWORD`` and, for the coordinator and the workers, a fresh
``FLODL_RUN_SECRET`` (a worker may not read ``flodl-secret:{RUN}`` from Redis under
these rules, so every process of the run is handed the same secret).

The rules (Redis 7 key permissions ``~`` / ``%R~`` / ``%W~`` and selectors ``(...)``; a
command runs when the root permissions or one selector allow the command AND all its
keys, so each selector below pins a command set to a key set):

``flodl-RUN-coordinator``
    every data command (stream, string, hash, list, set, keyspace, transaction
    categories, minus ``@dangerous``) on ``flodl:{RUN}:*`` and ``flodl-secret:{RUN}``,
    and INFO (memory figures in the OOM line); nothing on another run; no CONFIG,
    FLUSH*, KEYS, DEBUG, MIGRATE, RESTORE, SORT, SCRIPT, FUNCTION, EVAL, PUBLISH, ACL,
    CLIENT KILL/LIST, MONITOR, SHUTDOWN, ...

``flodl-RUN-worker`` (shared by every rank of the run: ranks are assigned at join time)
    root: PING, SELECT, CLIENT SETNAME/GETNAME/ID, MULTI/EXEC/DISCARD/UNWATCH, no keys;
    ``up:*``: XADD XRANGE XREVRANGE XINFO|STREAM WATCH;
    ``join``: XADD XREAD XRANGE XREVRANGE XINFO|STREAM;
    ``dlq`` (write only): XADD;
    ``ctl:*`` (read only): XREAD XRANGE XREVRANGE XINFO STREAM (no consumer group: a
    group is a queue anyone on the stream may take from, issue 28; never XADD);
    ``meta``, ``identity`` (read only): HGETALL HGET HMGET HEXISTS HLEN EXISTS TYPE;
    ``store:*``: GET MGET SET INCRBY APPEND DEL EXISTS RPUSH BLMOVE SADD SREM SCARD
    SMEMBERS WATCH (the torch rendezvous store, ``bus/store.py``; DEL only here).

``flodl-RUN-observer``
    read only (``%R~flodl:{RUN}:*``): XREAD XRANGE XREVRANGE XLEN XINFO XPENDING, HGETALL
    HGET HMGET HEXISTS HLEN, EXISTS TYPE SCAN, PING, SELECT, CLIENT SETNAME/GETNAME/ID.
    No XREADGROUP (it writes the group), no secret, no script (a busy one stops the
    server for every run; ``ops/tail.sh`` formats with ``redis-cli --csv``).

Every Redis command each role issues, from the code (``git grep`` over ``bus/``,
``coordinator/``, ``worker/``, ``params/``, ``launch/``, ``record/``,
``services/healthcheck.py``), through redis-py:

- connection set-up (all): AUTH, CLIENT SETNAME (``connect(client_name=...)``), SELECT
  (a URL with a database other than 0), CLIENT SETINFO (redis-py; a refusal is
  ignored by redis-py, and Redis 7.0 does not know it), PING (``connect_pinged``,
  ``Link`` after a lost connection, the health check).
- worker: ``publisher._Publisher``: XINFO STREAM up:<r> (``stream_top``), XADD up:<r> with
  an explicit id and MAXLEN ~, XRANGE up:<r> (``landed``: a retried batch), XREVRANGE
  up:<r> (``last_seq``: the seq to continue above), WATCH/MULTI/EXEC/UNWATCH on up:<r>
  (the batch transaction); ``reader._CursorReader``: XREAD over ctl:<r> and ctl:all
  from its own cursor, XADD dlq (dead letters);
  ``join.JoinStream``: XADD join, XREAD join, XADD dlq; ``worker/cli.py``: HGETALL meta,
  GET flodl-secret:{RUN} only without FLODL_RUN_SECRET (refused here: give the secret);
  ``identity`` is read with HGETALL/HGET (the coordinator's public keys);
  ``bus/store.py`` on store:*: SET GET MGET INCRBY APPEND DEL RPUSH SADD SREM SCARD
  SMEMBERS EXISTS BLMOVE, WATCH MULTI EXEC (compare_set), UNWATCH (redis-py's reset).
- coordinator: XADD ctl:<r>/ctl:all (explicit ids), XRANGE, XREVRANGE, XINFO STREAM
  and GROUPS, XDEL + XSETID + XGROUP SETID (``repair_stream``), XINFO GROUPS + XPENDING
  + XTRIM MINID on ctl:* and up:* (``bus.trim``: what every reader consumed, the ranks
  as their heartbeats say), XGROUP CREATE on up:* (its own), XREADGROUP/XACK up:*,
  XADD dlq, XADD/XREAD
  join; ``coordinator/cli.py``: EXISTS meta, HSET meta, SCAN + EXPIRE at the end
  (``--expire-after``), SCAN + UNLINK (``--reset-run``,
  its secret too), SET NX + GET flodl-secret:{RUN}; DEL + HSET identity in MULTI/EXEC
  (``publish_identity``); INFO memory (``connection.describe_transient``, optional);
  health check: HGET meta, EXISTS identity. Workers also try INFO memory on an
  OOM episode; refused, the line says "maxmemory reached" without figures. As the
  default user only (an embedded or unsecured server), never under these rules:
  EVALSHA + SCRIPT LOAD for ``send_batch`` (``bus.batch_script`` says why not here).
- observer: ``bus/tail.py``: EXISTS, SCAN ... TYPE stream, XINFO STREAM, XREAD, GET
  flodl-secret:{RUN} (a refusal is expected and handled); ``launch/watch.py``: XREAD;
  ``launch/status.py``: HGETALL meta, XREVRANGE up:*, XLEN dlq, EXISTS, SCAN;
  ``ops/tail.sh`` and ``ops/README.md``: SCAN, TYPE, XREVRANGE, XRANGE, XINFO GROUPS,
  XPENDING, XLEN, HGETALL meta.
- admin (``flodl-bus acl create|drop``, compose's ``credentials`` service): PING, CLIENT
  SETNAME, INFO server (the version), ACL GETUSER, ACL SETUSER, ACL DELUSER, ACL SAVE
  (``--save``); ``admin_rules()`` is that set and nothing else, the user of
  ``ops/compose.acl``. Whoever may ACL SETUSER may make himself any user: hand it to
  one process and no other.
- ``flodl-bus up`` and ``replay`` use an embedded server's default user / fakeredis.

What ACL rules cannot express (see RELIABILITY.md, "Threat model"): which rank a worker
is (one user per run), and the arguments of a command (``XADD ... MAXLEN 0`` trims the
streams a worker may write; an explicit entry id far ahead moves a stream's top). The
bus's signatures, sequences and dead-lettering handle those.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import redis

from flodl_bus.bus.connection import (
    DEFAULT_URL,
    ENV_PASSWORD,
    ENV_URL,
    ENV_USERNAME,
    RedisUnreachable,
    connect_pinged,
    redact_url,
)
from flodl_bus.bus.keys import PREFIX, InvalidRunId, RunKeys
from flodl_bus.bus.run_secret import ENV_SECRET
from flodl_bus.protocol.signing import new_secret

ROLES: Final = ("coordinator", "worker", "observer")
ENV_RUN: Final = "FLODL_RUN"
#: 32 random bytes, hex: far beyond any brute force over the network.
PASSWORD_BYTES: Final = 32

#: Commands with no key that every role needs to connect and stay connected.
CONNECTION: Final = ("+ping", "+select", "+client|setname", "+client|getname", "+client|id")
#: Key-less transaction commands (WATCH takes keys: it is granted per selector).
TRANSACTION: Final = ("+multi", "+exec", "+discard", "+unwatch")

#: Per key family of a run, the worker's commands (see the module docstring).
WORKER_UP: Final = ("+xadd", "+xrange", "+xrevrange", "+xinfo|stream", "+watch")
WORKER_JOIN: Final = ("+xadd", "+xread", "+xrange", "+xrevrange", "+xinfo|stream")
WORKER_DLQ: Final = ("+xadd",)
WORKER_CTL: Final = ("+xread", "+xrange", "+xrevrange", "+xinfo|stream")
HASH_READ: Final = ("+hgetall", "+hget", "+hmget", "+hexists", "+hlen", "+exists", "+type")
WORKER_STORE: Final = (
    "+get", "+mget", "+set", "+incrby", "+append", "+del", "+exists",
    "+rpush", "+blmove", "+sadd", "+srem", "+scard", "+smembers", "+watch",
)  # fmt: skip

COORDINATOR: Final = (
    "+@stream", "+@string", "+@hash", "+@list", "+@set", "+@keyspace", "+@transaction",
    "-@dangerous",
    # After -@dangerous, which holds INFO: the OOM line of ``connection.describe_transient``
    # gives the memory figures (INFO shows no credentials; it does show server-wide counts).
    "+info",
)  # fmt: skip

OBSERVER: Final = (
    "+xread", "+xrange", "+xrevrange", "+xlen", "+xinfo", "+xpending",
    "+hgetall", "+hget", "+hmget", "+hexists", "+hlen",
    "+exists", "+type", "+scan",
)  # fmt: skip

#: What ``flodl-bus acl create|drop`` issues as the admin (no key, no data command).
ADMIN: Final = ("+info", "+acl|getuser", "+acl|setuser", "+acl|deluser", "+acl|save")
#: The admin user of compose's Redis (``ops/compose.acl``).
ADMIN_USER: Final = "flodl-admin"


class AclError(RuntimeError):
    """What ``flodl-bus acl`` prints as its one line before exiting non-zero."""


def user_name(run: str, role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    return f"{PREFIX}-{RunKeys(run).run}-{role}"


def _prefixes(run: str | None) -> tuple[str, str]:
    """(``flodl:{RUN}:``, ``flodl-secret:{RUN}``); ``{*}`` for every run (the static
    users of ``ops/users.acl``). Run ids hold no glob characters (``keys``), and the
    closing brace keeps run ``a`` from matching the keys of run ``ab``."""
    if run is None:
        return f"{PREFIX}:{{*}}:", f"{PREFIX}-secret:{{*}}"
    keys = RunKeys(run)
    return keys.prefix, keys.secret


def _selector(keys: Sequence[str], commands: Sequence[str]) -> str:
    return "(" + " ".join([*keys, "resetchannels", "-@all", *commands]) + ")"


def role_rules(
    run: str | None, role: str, *, client_setinfo: bool = False, worker_reads_secret: bool = False
) -> list[str]:
    """The ACL rules of ``role`` (everything after ``user NAME on #HASH``).

    ``run=None`` gives the rules over every run (``ops/users.acl``).
    ``client_setinfo`` grants CLIENT SETINFO (redis-py sends it on connect; Redis 7.0
    does not know the command, so it is only granted to servers of 7.2 on).
    ``worker_reads_secret`` lets a worker GET ``flodl-secret:*`` (only the static
    development user of ``ops/users.acl``, for processes started without
    FLODL_RUN_SECRET).
    """
    p, secret = _prefixes(run)
    connection = [*CONNECTION, *(("+client|setinfo",) if client_setinfo else ())]
    if role == "coordinator":
        # @keyspace holds two key-less commands, SCAN and RANDOMKEY (key names only).
        keys = [f"~{p}*", f"~{secret}"]
        return ["resetkeys", *keys, "resetchannels", "-@all", *COORDINATOR, *connection]
    if role == "observer":
        return ["resetkeys", f"%R~{p}*", "resetchannels", "-@all", *OBSERVER, *connection]
    if role != "worker":
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    rules = [
        "resetkeys",
        "resetchannels",
        "-@all",
        *connection,
        *TRANSACTION,
        _selector([f"~{p}up:*"], WORKER_UP),
        _selector([f"~{p}join"], WORKER_JOIN),
        _selector([f"%W~{p}dlq"], WORKER_DLQ),
        _selector([f"%R~{p}ctl:*"], WORKER_CTL),
        _selector([f"%R~{p}meta", f"%R~{p}identity"], HASH_READ),
        _selector([f"~{p}store:*"], WORKER_STORE),
    ]
    if worker_reads_secret:
        rules.append(_selector([f"%R~{secret}"], ("+get",)))
    return rules


def admin_rules(*, client_setinfo: bool = False) -> list[str]:
    """The rules of a user that may make and drop the per-run users and do nothing else:
    no key, no channel, no data command."""
    connection = [*CONNECTION, *(("+client|setinfo",) if client_setinfo else ())]
    return ["resetkeys", "resetchannels", "-@all", *ADMIN, *connection]


def password_hash(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


def acl_line(name: str, password: str, rules: Sequence[str]) -> str:
    """One line of an ACL file (the password only as its SHA-256 hash)."""
    return " ".join(["user", name, "on", f"#{password_hash(password)}", *rules])


@dataclass(frozen=True, slots=True)
class RoleCredentials:
    role: str
    username: str
    password: str
    rules: tuple[str, ...]

    def env(self, run: str, run_secret: str) -> dict[str, str]:
        out = {ENV_RUN: run, ENV_USERNAME: self.username, ENV_PASSWORD: self.password}
        if self.role != "observer":
            out[ENV_SECRET] = run_secret
        return out


@dataclass(frozen=True, slots=True)
class RunCredentials:
    run: str
    run_secret: str
    roles: tuple[RoleCredentials, ...]

    def role(self, role: str) -> RoleCredentials:
        return next(r for r in self.roles if r.role == role)

    def env(self, role: str) -> dict[str, str]:
        return self.role(role).env(self.run, self.run_secret)

    def acl_lines(self) -> list[str]:
        return [acl_line(r.username, r.password, r.rules) for r in self.roles]


def new_credentials(run: str, *, client_setinfo: bool = False) -> RunCredentials:
    RunKeys(run)  # validates
    roles = tuple(
        RoleCredentials(
            role,
            user_name(run, role),
            secrets.token_hex(PASSWORD_BYTES),
            tuple(role_rules(run, role, client_setinfo=client_setinfo)),
        )
        for role in ROLES
    )
    return RunCredentials(run, new_secret().hex(), roles)


# ---------------------------------------------------------------------------- server


def _explain(exc: redis.exceptions.RedisError, url: str, what: str) -> AclError:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, redis.exceptions.NoPermissionError) or "NOPERM" in text:
        return AclError(
            f"the user of {redact_url(url)} may not {what} ({text}): use an admin user "
            "(one allowed +acl, e.g. default)"
        )
    return AclError(f"{what} failed on {redact_url(url)}: {text}")


def _server_version(admin: redis.Redis) -> tuple[int, ...]:
    try:
        info = admin.info("server")
    except redis.exceptions.RedisError:
        return ()
    text = str(info.get("redis_version", ""))
    try:
        return tuple(int(x) for x in text.split("."))
    except ValueError:
        return ()


def _acl(admin: redis.Redis, *args: str) -> Any:
    """One ``ACL <args>`` command (redis-py's own ACL helpers do not take selectors)."""
    return admin.execute_command("ACL", *args)  # type: ignore[no-untyped-call]


def _exists(admin: redis.Redis, name: str) -> bool:
    return _acl(admin, "GETUSER", name) is not None


def create(admin: redis.Redis, run: str, *, replace: bool = False, url: str = "") -> RunCredentials:
    """Create the run's three users on the server of ``admin`` (an ACL-capable user).

    Refuses when one exists already, unless ``replace``: then the old users are deleted
    first (Redis disconnects their clients) and made again with new passwords.
    """
    RunKeys(run)
    names = [user_name(run, role) for role in ROLES]
    try:
        present = [n for n in names if _exists(admin, n)]
    except redis.exceptions.RedisError as exc:
        raise _explain(exc, url, "read ACL users") from None
    if present and not replace:
        raise AclError(
            f"ACL user {present[0]} exists already: `flodl-bus acl drop {run}` first, or "
            "pass --replace (new passwords; its connected clients are dropped)"
        )
    creds = new_credentials(run, client_setinfo=_server_version(admin) >= (7, 2))
    made: list[str] = []
    try:
        if present:
            _acl(admin, "DELUSER", *present)
        for r in creds.roles:
            hashed = f"#{password_hash(r.password)}"
            _acl(admin, "SETUSER", r.username, "reset", "on", hashed, *r.rules)
            made.append(r.username)
    except redis.exceptions.RedisError as exc:
        if made:
            with contextlib.suppress(redis.exceptions.RedisError):
                _acl(admin, "DELUSER", *made)
        raise _explain(exc, url, "create ACL users") from None
    return creds


def drop(admin: redis.Redis, run: str, *, url: str = "") -> int:
    """Delete the run's users (Redis disconnects their clients); how many existed."""
    names = [user_name(run, role) for role in ROLES]
    try:
        return int(_acl(admin, "DELUSER", *names))
    except redis.exceptions.RedisError as exc:
        raise _explain(exc, url, "delete ACL users") from None


def save(admin: redis.Redis, *, url: str = "") -> None:
    """ACL SAVE: keep the users across a restart of a server that has an aclfile."""
    try:
        _acl(admin, "SAVE")
    except redis.exceptions.RedisError as exc:
        if "not configured to use an ACL file" in str(exc):
            raise AclError(
                f"{redact_url(url)} has no aclfile, so ACL SAVE cannot keep the users: "
                "they last until the server restarts (or add them to its config)"
            ) from None
        raise _explain(exc, url, "ACL SAVE") from None


# ------------------------------------------------------------------------------- cli


def env_text(env: Mapping[str, str]) -> str:
    return "".join(f"{k}={v}\n" for k, v in env.items())


def write_env_files(creds: RunCredentials, directory: Path) -> list[Path]:
    """``DIR/<role>.env`` (mode 0600), one per role, for ``env_file:`` or ``set -a; .``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for role in ROLES:
        path = directory / f"{role}.env"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(env_text(creds.env(role)))
        os.chmod(path, 0o600)
        paths.append(path)
    return paths


def _env_blocks(creds: RunCredentials) -> str:
    return "\n".join(f"# {role}\n{env_text(creds.env(role))}" for role in ROLES)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="flodl-bus acl",
        description="per-run Redis ACL users: a coordinator, a worker and an observer user "
        "that can touch only their run's keys (ops/README.md)",
    )
    sub = ap.add_subparsers(dest="action", required=True)
    url_help = f"an admin URL (default ${ENV_URL} or {DEFAULT_URL})"

    c = sub.add_parser("create", help="create the three users of RUN, print their env")
    c.add_argument("run", metavar="RUN")
    c.add_argument("--redis-url", default=os.environ.get(ENV_URL, DEFAULT_URL), help=url_help)
    c.add_argument(
        "--print-only",
        action="store_true",
        help="do not touch a server: print ACL file lines (passwords as SHA-256 hashes) "
        "to append to an aclfile, then the env (or write it with --env-dir)",
    )
    c.add_argument(
        "--env-dir",
        type=Path,
        help="write DIR/coordinator.env, worker.env, observer.env (mode 0600) instead of "
        "printing the passwords and the run secret",
    )
    c.add_argument(
        "--replace", action="store_true", help="delete and recreate users that exist already"
    )
    c.add_argument("--save", action="store_true", help="ACL SAVE afterwards (aclfile servers)")

    d = sub.add_parser("drop", help="delete the users of RUN (their clients are disconnected)")
    d.add_argument("run", metavar="RUN")
    d.add_argument("--redis-url", default=os.environ.get(ENV_URL, DEFAULT_URL), help=url_help)
    d.add_argument("--save", action="store_true", help="ACL SAVE afterwards (aclfile servers)")

    r = sub.add_parser("rules", help="print the ACL rules of RUN's users (no passwords)")
    r.add_argument("run", metavar="RUN", nargs="?", help="without RUN: the rules over every run")
    return ap


def _run(args: argparse.Namespace) -> int:
    if args.action == "rules":
        if args.run is not None:
            RunKeys(args.run)
        for role in ROLES:
            name = role if args.run is None else user_name(args.run, role)
            rules = role_rules(args.run, role, worker_reads_secret=args.run is None)
            print(" ".join(["user", name, "on", "#<sha256 of the password>", *rules]))
        return 0
    RunKeys(args.run)
    if args.action == "create" and args.print_only:
        creds = new_credentials(args.run)
        print("\n".join(creds.acl_lines()))
        if args.env_dir is not None:
            paths = write_env_files(creds, args.env_dir)
            print(f"env of each role written to {', '.join(map(str, paths))}", file=sys.stderr)
        else:
            print()
            print(_env_blocks(creds), end="")
        return 0
    url: str = args.redis_url
    try:
        admin = connect_pinged(url, client_name="flodl-acl")
    except RedisUnreachable as exc:
        raise AclError(str(exc)) from None
    try:
        if args.action == "drop":
            n = drop(admin, args.run, url=url)
            if args.save:
                save(admin, url=url)
            print(f"run {args.run}: dropped {n} ACL user(s) on {redact_url(url)}")
            return 0
        creds = create(admin, args.run, replace=args.replace, url=url)
        names = ", ".join(r.username for r in creds.roles)
        print(f"# run {args.run}: created ACL users {names} on {redact_url(url)}")
        if args.env_dir is not None:
            paths = write_env_files(creds, args.env_dir)
            print(f"# env of each role written to {', '.join(map(str, paths))}")
        else:
            print(_env_blocks(creds), end="")
        if args.save:
            save(admin, url=url)
        return 0
    finally:
        admin.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return _run(args)
    except (AclError, InvalidRunId) as exc:
        print(f"flodl-bus acl: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"flodl-bus acl: {exc}", file=sys.stderr)
        return 2
