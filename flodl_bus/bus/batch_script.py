"""The coordinator's batch of control entries in one round trip: a server-side script.

``RedisCoordinatorBus.send_batch`` wrote a batch with WATCH, a pipeline of XINFO STREAM
for the streams' tops, and MULTI/EXEC: three round trips. ``SOURCE`` does the same in
one (EVALSHA): Redis runs a script alone, so between its look at the tops and its XADDs
no other client writes.

All of the batch lands or none of it: every check that can refuse comes before the
first XADD (a script is not rolled back). A stream whose top is at or above the first id
the batch puts there refuses the whole batch; the script returns each such stream's top
and the caller lifts its clock or removes a foreign top exactly as after the
transaction's look (``streams._above_tops``), then signs again under new ids. A wrong
key type fails in the checks, before any write. An OOM server refuses the script before
it starts (a script that declares itself, ``#!lua``, without ``allow-oom``).

A lost reply: the retry first asks whether the batch's first entry (id AND mac) is
there (``stream_ops.landed``), as for the transaction. The script asks the same of
itself when that stream refuses, so even a request sent twice writes once.

Where the server has no scripting (fakeredis without Lua, a server with EVALSHA
renamed) or the user may not run scripts, the bus keeps the transaction:
``BatchScript.off`` says why, in one log line. The per-run users of ``bus.acl`` may not:
EVALSHA needs SCRIPT LOAD after every restart, and SCRIPT LOAD takes any Lua, which
could hold the server busy for every run (past ``busy-reply-threshold`` only SCRIPT
KILL or SHUTDOWN stops it), where no command a stolen coordinator credential may issue
today can; what the script's commands may touch would not widen (Redis checks each
against the user's key and command rules). So a client logged in as a named user does
not even ask (``named_user``): a refused EVALSHA on every coordinator start would only
fill the server's ACL LOG.

A server that lost its script cache (a restart, a failover, SCRIPT FLUSH) answers
NOSCRIPT without running anything: the script is loaded again and the call repeated.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Final

import redis

from flodl_bus.bus import entries
from flodl_bus.bus.foreign import writer_limit
from flodl_bus.bus.ids import EntryId, IdClock, format_id, parse_id
from flodl_bus.bus.lane import Lane
from flodl_bus.bus.stream_ops import _now_ms, log
from flodl_bus.protocol.signing import Signer

SOURCE: Final = """#!lua
-- KEYS: the batch's streams, each once. ARGV[1]: MAXLEN ~ of every XADD; then per
-- entry, in send order: key index, id, type, rank, seq, body, mac.
local function newer(a, b)  -- a > b for ids "ms-seq" (exact: decimal strings)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if #am ~= #bm then return #am > #bm end
  if am ~= bm then return am > bm end
  if #as ~= #bs then return #as > #bs end
  return as > bs
end
local first = {}
for i = 2, #ARGV, 7 do
  local k = tonumber(ARGV[i])
  if first[k] == nil then first[k] = ARGV[i + 1] end
end
local refused = {}
for k = 1, #KEYS do
  local top = '0-0'
  if redis.call('EXISTS', KEYS[k]) == 1 then
    local info = redis.call('XINFO', 'STREAM', KEYS[k])
    for j = 1, #info, 2 do
      if info[j] == 'last-generated-id' then top = info[j + 1] break end
    end
  end
  if first[k] ~= nil and not newer(first[k], top) then
    refused[#refused + 1] = k
    refused[#refused + 1] = top
  end
end
if #refused > 0 then
  local key = KEYS[tonumber(ARGV[2])]
  local got = redis.call('XRANGE', key, ARGV[3], ARGV[3])
  if #got == 1 then
    local f = got[1][2]
    for j = 1, #f, 2 do
      if f[j] == 'mac' and f[j + 1] == ARGV[8] then return 'landed' end
    end
  end
  return refused
end
for i = 2, #ARGV, 7 do
  redis.call('XADD', KEYS[tonumber(ARGV[i])], 'MAXLEN', '~', ARGV[1], ARGV[i + 1],
    'type', ARGV[i + 2], 'rank', ARGV[i + 3], 'seq', ARGV[i + 4],
    'body', ARGV[i + 5], 'mac', ARGV[i + 6])
end
return 'ok'
"""

SHA: Final = hashlib.sha1(SOURCE.encode()).hexdigest()


class Refused(tuple[tuple[int, EntryId], ...]):
    """(key index, top) of each stream whose top is at or above the batch's first id
    there: nothing was written."""


def named_user(client: redis.Redis) -> str | None:
    """The ACL user ``client`` logs in as, unless it is the default user."""
    user = client.connection_pool.connection_kwargs.get("username")
    return None if user in (None, "", "default") else str(user)


def _unsupported(exc: redis.exceptions.ResponseError) -> str | None:
    """Why scripts cannot run here, or None (an error of this call only)."""
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return "the user may not run scripts (NOPERM)"
    text = str(exc).lower()
    if "unknown command" in text:
        return "the server has no scripting"
    return None


class BatchScript:
    """``SOURCE`` on one client: EVALSHA, loaded again on NOSCRIPT; switched off for
    good where the server or the user cannot run it."""

    def __init__(self, client: redis.Redis, where: str = "", lane: Lane | None = None) -> None:
        self.client = client
        self.where = where
        #: the connection EVALSHA goes out on (the caller's send lane, or one of its own)
        self.lane = lane if lane is not None else Lane(client)
        #: why the transaction is used instead (None: the script is in use, or untried)
        self.off: str | None = None
        #: SCRIPT LOADs issued (the first NOSCRIPT, and each after the cache was lost)
        self.loads = 0

    def run(self, keys: Sequence[str], argv: Sequence[bytes | str | int]) -> str | Refused | None:
        """One call: ``"ok"`` (every entry written), ``"landed"`` (the batch was there
        already), a ``Refused``, or None: scripts cannot run here (``off`` says why;
        nothing ran). ``argv``: MAXLEN, then per entry its key's index in ``keys``
        (from 1), id, type, rank, seq, body and mac (``entries.sign``'s field order)."""
        if self.off is not None:
            return None
        try:
            try:
                reply: Any = self.lane.call("EVALSHA", SHA, len(keys), *keys, *argv)
            except redis.exceptions.NoScriptError:
                # Nothing ran. The cache is empty after a restart or a failover.
                self.loads += 1
                self.lane.call("SCRIPT", "LOAD", SOURCE)
                reply = self.lane.call("EVALSHA", SHA, len(keys), *keys, *argv)
        except redis.exceptions.ResponseError as exc:
            why = _unsupported(exc)
            if why is None:
                raise
            self.off = why
            log.info("bus_batch_script_off", reason=why, where=self.where)
            return None
        if isinstance(reply, bytes | str):
            return reply.decode() if isinstance(reply, bytes) else reply
        flat = list(reply)
        return Refused((int(flat[i]), parse_id(flat[i + 1])) for i in range(0, len(flat), 2))


#: (stream, rank field, signer, encoded type and body, seq) of one entry of a batch
Planned = tuple[str, str, Signer, tuple[bytes, bytes], int]


def write_batch(
    script: BatchScript,
    clock: IdClock,
    maxlen: int,
    plan: Sequence[Planned],
    streams: Sequence[str],
    repair: Callable[[str], None],
    tried: list[tuple[str, str, bytes]],
    ids: list[str],
    written: list[tuple[str, str, dict[bytes, bytes]]],
) -> bool:
    """The coordinator's batch (``plan``, over ``streams``, each once) in one EVALSHA,
    with the coordinator's lock held; False: nothing was written and scripts cannot run
    here (the caller writes it with the transaction). ``tried`` gets each attempt's first
    entry (the lost-reply check), ``ids`` and ``written`` what was written."""
    index = {st: i for i, st in enumerate(streams, start=1)}
    while True:
        ids.clear()
        written.clear()
        argv: list[bytes | str | int] = [maxlen]
        for st, rf, sg, enc, seq in plan:
            eid = format_id(clock.next(_now_ms()))
            f = entries.sign(sg, st, eid, enc, rf, seq)
            if not ids:
                tried.append((st, eid, f[entries.F_MAC]))
            ids.append(eid)
            written.append((st, eid, f))
            argv += (index[st], eid, f[entries.F_TYPE], f[entries.F_RANK])
            argv += (f[entries.F_SEQ], f[entries.F_BODY], f[entries.F_MAC])
        got = script.run(streams, argv)
        if got is None:
            return False
        if not isinstance(got, Refused):
            return True  # written, or written by the request whose reply was lost
        # As after the transaction's look at the tops (``streams._above_tops``): follow
        # a top a writer of the run may have made, remove one beyond that; then sign
        # again under new ids.
        limit = writer_limit(_now_ms())
        for k, top in got:
            if top[0] <= limit:
                clock.raise_floor(top)
            else:
                repair(streams[k - 1])
