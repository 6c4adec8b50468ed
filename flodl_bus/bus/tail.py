"""``flodl-bus tail``: print a run's control and upstream entries live, one line each.

An observer, not a consumer: plain XREAD (no consumer group, nothing acked), so tailing
never takes an entry from a rank or the coordinator. It tracks the last id it printed
per stream and asks for entries after exactly that id. A ``XREAD ... $`` loop would drop
everything written between two calls; this does not, however large the burst.

Streams appear as ranks start, so the key space is rescanned about once a second;
a stream found after the tail started is printed from its beginning.

The command ends once the run has: after the coordinator's ``Shutdown`` (and the ranks'
last words, until a read comes back empty), unless ``--follow``. A run id with nothing
in Redis is an error (exit 2), not an empty wait.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

import orjson
import redis

from flodl_bus.bus.connection import (
    MAX_BLOCK_MS,
    REFUSALS,
    RedisUnreachable,
    add_url_argument,
    connect_pinged,
    describe_refusal,
    redact_url,
)
from flodl_bus.bus.entries import F_BODY, F_MAC, F_RANK, F_SEQ, F_TYPE
from flodl_bus.bus.foreign import writer_limit
from flodl_bus.bus.ids import ZERO, EntryId, format_id, parse_id
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.stream_ops import stream_top
from flodl_bus.options import OneLineParser
from flodl_bus.protocol import signing, wire
from flodl_bus.protocol.signing import BadKey, RunIdentity, VerifyKey

RESCAN_S = 1.0
READ_COUNT = 1000
#: after the run's Shutdown, the tail ends at the first empty read this long after it
#: (the ranks' Exiting and last entries come within it)
AFTER_SHUTDOWN_S = 2.0


def _scan(client: redis.Redis, keys: RunKeys, rank: int | None) -> list[str]:
    if rank is not None:
        names = [keys.ctl(rank), keys.ctl_all, keys.up(rank), keys.dlq]
        return [k for k in names if client.exists(k)]
    found: set[str] = set()
    for pattern in (keys.ctl_pattern, keys.up_pattern):
        for k in client.scan_iter(match=pattern, count=1000, _type="stream"):
            found.add(k.decode() if isinstance(k, bytes) else str(k))
    if client.exists(keys.dlq):
        found.add(keys.dlq)
    return sorted(found)


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError


def format_entry(
    keys: RunKeys,
    stream: str,
    eid: EntryId,
    fields: dict[bytes, bytes],
    broadcast_key: VerifyKey | None,
) -> str:
    """``time  stream  id  type  rank=… seq=…  {decoded body fields}``."""
    try:
        when = datetime.fromtimestamp(eid[0] / 1000, UTC).strftime("%H:%M:%S.%f")[:-3]
    except (OverflowError, OSError, ValueError):  # an id no clock writes: a foreign one
        when = "??:??:??.???"
    short = keys.short(stream)
    if stream == keys.dlq:
        reason = fields.get(b"reason", b"").decode(errors="replace")
        origin = keys.short(fields.get(b"stream", b"?").decode(errors="replace"))
        entry = fields.get(b"entry", b"?").decode(errors="replace")
        return f"{when}  {short:<8} {format_id(eid):<16} DEAD  {origin} {entry}: {reason}"
    type_ = fields.get(F_TYPE, b"?").decode(errors="replace")
    rank = fields.get(F_RANK, b"?").decode(errors="replace")
    seq = fields.get(F_SEQ, b"?").decode(errors="replace")
    body = fields.get(F_BODY, b"")
    note = ""
    # An observer can check what the coordinator signed for everyone (its public key is
    # in the run's identity); a rank's streams are MACed with keys only that rank and the
    # coordinator hold, so there tail shows what is there, unchecked.
    mac = fields.get(F_MAC, b"")
    # A per-rank MAC vector (``m...``) needs rank keys: only a signature is checked here.
    if broadcast_key is not None and stream == keys.ctl_all and len(mac) == signing.SIG_HEX:
        signed = signing.signed_bytes(
            stream.encode(), format_id(eid).encode(), fields.get(F_TYPE, b""),
            fields.get(F_RANK, b""), fields.get(F_SEQ, b""), body,
        )  # fmt: skip
        note = "" if broadcast_key.verify(signed, mac) else "  [BAD SIGNATURE]"
    try:
        data = wire.to_map(wire.decode(body))
        data.pop("v", None)
        data.pop("type", None)
        data.pop("rank", None)
        shown = orjson.dumps(data, default=_json_default).decode()
    except (wire.DecodeError, TypeError) as exc:
        shown = f"<undecodable: {exc}>"
    return (
        f"{when}  {short:<8} {format_id(eid):<16} {type_:<18} rank={rank} seq={seq}  {shown}{note}"
    )


def tail(
    client: redis.Redis,
    run: str,
    *,
    rank: int | None = None,
    from_start: bool = False,
    count: int | None = None,
    out: TextIO | None = None,
    broadcast_key: VerifyKey | None = None,
    duration: float | None = None,
    block_ms: int = 500,
    follow: bool = True,
) -> int:
    """Print entries until ``count`` were printed or ``duration`` passed (else forever;
    without ``follow``, until the first empty read ``AFTER_SHUTDOWN_S`` after a
    ``Shutdown`` was printed).

    Returns the number of entries printed.
    """
    keys = RunKeys(run)
    out = sys.stdout if out is None else out
    last: dict[str, EntryId] = {}
    #: foreign entries beyond the run's ids, shown once each
    beyond: set[tuple[str, EntryId]] = set()
    first_scan = True
    next_scan = 0.0
    printed = 0
    stop_at = None if duration is None else time.monotonic() + duration
    block = min(block_ms, MAX_BLOCK_MS)
    shutdown_seen: float | None = None
    while count is None or printed < count:
        now = time.monotonic()
        if stop_at is not None and now >= stop_at:
            break
        if now >= next_scan:
            for stream in _scan(client, keys, rank):
                if stream not in last:
                    # At start, begin at each stream's top unless --from-start; a
                    # stream that appears later is new, so all of it is news.
                    start_at_top = first_scan and not from_start
                    last[stream] = stream_top(client, stream) if start_at_top else ZERO
            first_scan = False
            next_scan = now + RESCAN_S
        if not last:
            time.sleep(block / 1000)
            continue
        reply: Any = client.xread(
            {s: format_id(i) for s, i in last.items()}, count=READ_COUNT, block=block
        )
        if (
            not reply
            and shutdown_seen is not None
            and not follow
            and time.monotonic() - shutdown_seen >= AFTER_SHUTDOWN_S
        ):
            break  # the run is over and its last entries are out
        lines = []
        before = dict(last)
        limit = writer_limit(time.time_ns() // 1_000_000)
        for name, items in reply or ():
            stream = name.decode()
            for raw_id, fields in items:
                eid = parse_id(raw_id)
                if eid[0] > limit:
                    # Beyond any id of the run (a foreign entry): shown once, and the
                    # cursor stays, or nothing the run writes after it would show.
                    if (stream, eid) not in beyond:
                        beyond.add((stream, eid))
                        note = "  [FOREIGN: beyond any id of the run]"
                        line = format_entry(keys, stream, eid, fields, broadcast_key) + note
                        lines.append((eid, stream, line))
                    break
                last[stream] = eid
                if (
                    stream == keys.ctl_all
                    and fields.get(F_TYPE) == b"Shutdown"
                    and shutdown_seen is None
                ):
                    shutdown_seen = time.monotonic()
                lines.append((eid, stream, format_entry(keys, stream, eid, fields, broadcast_key)))
        if reply and last == before:
            time.sleep(block / 1000)  # only a foreign entry the cursor must not pass
        lines.sort()
        if count is not None:
            lines = lines[: count - printed]
        if lines:
            out.write("".join(line + "\n" for _, _, line in lines))
            out.flush()
            printed += len(lines)
    return printed


def _broadcast_key(client: redis.Redis, keys: RunKeys) -> VerifyKey | None:
    """The coordinator's public key from the run's identity (public: any observer)."""
    try:
        raw: Any = client.hgetall(keys.identity)
        return RunIdentity.from_fields({k.decode(): v.decode() for k, v in raw.items()}).sign_pub
    except (redis.exceptions.ResponseError, BadKey, UnicodeDecodeError):
        return None


def run_exists(client: redis.Redis, keys: RunKeys) -> bool:
    """A coordinator wrote the run's meta, or some process wrote one of its streams."""
    if client.exists(keys.meta, keys.join, keys.ctl_all):
        return True
    return any(True for _ in client.scan_iter(match=f"{keys.prefix}*", count=1000))


class RunUnavailable(Exception):
    """The run id is malformed, its Redis refused or unreachable, or no such run is
    there; the message is one line naming what to check."""


def open_run(run: str, url: str, client_name: str) -> tuple[redis.Redis, RunKeys]:
    """A client on an existing run, for the read-only commands (``tail``, ``status``):
    every way of not getting one is a ``RunUnavailable`` with its one-line reason."""
    try:
        keys = RunKeys(run)
    except ValueError as exc:
        raise RunUnavailable(f"--run: {exc}") from None
    try:
        client = connect_pinged(url, client_name=client_name)
    except RedisUnreachable as exc:
        raise RunUnavailable(str(exc)) from None
    try:
        exists = run_exists(client, keys)
    except REFUSALS as exc:
        client.close()
        raise RunUnavailable(describe_refusal(exc, url)) from None
    if not exists:
        client.close()
        raise RunUnavailable(
            f"no run {run!r} at {redact_url(url)} (no meta, no streams): "
            "check --run and --redis-url"
        )
    return client, keys


def main(argv: Sequence[str] | None = None) -> int:
    ap = OneLineParser(
        prog="flodl-bus tail",
        description="Print a run's control and upstream entries live, one line each; "
        "ends after the run's Shutdown unless --follow.",
        epilog="Credentials: in the URL, or FLODL_REDIS_USERNAME / FLODL_REDIS_PASSWORD "
        "(the read-only observer user is enough).",
    )
    required = ap.add_argument_group("required")
    required.add_argument("--run", required=True, help="run id")
    add_url_argument(ap)
    ap.add_argument("--rank", type=int, help="only ctl:<rank>, ctl:all and up:<rank>")
    ap.add_argument("--from-start", action="store_true", help="print what is already there")
    ap.add_argument("--count", type=int, help="exit after printing this many entries")
    ap.add_argument("--duration", type=float, help="exit after this many seconds")
    ap.add_argument(
        "--follow",
        action="store_true",
        help="keep printing after the run's Shutdown (a run id reused with --reset-run)",
    )
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        client, keys = open_run(args.run, args.redis_url, "flodl-tail")
    except RunUnavailable as exc:
        print(f"flodl-bus tail: {exc}", file=sys.stderr)
        return 2
    try:
        tail(
            client,
            args.run,
            rank=args.rank,
            from_start=args.from_start,
            count=args.count,
            duration=args.duration,
            broadcast_key=_broadcast_key(client, keys),
            follow=args.follow,
        )
    except REFUSALS as exc:
        print(f"flodl-bus tail: {describe_refusal(exc, args.redis_url)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        pass
    finally:
        client.close()
    return 0
