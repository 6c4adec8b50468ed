"""Read a run's streams as an observer: plain XREAD from the last id seen, nothing acked.

The coordinator and the ranks read through consumer groups; a watcher must not take an
entry from them, so it keeps its own cursor per stream and asks for entries strictly
after it. Every entry is authenticated and decoded with ``entries.parse`` (the same
checks the runtimes apply); an entry that fails is counted and skipped, not shown, and
the cursor never passes one whose id is beyond any id the run's writers use (a foreign
largest id would otherwise hide everything written after it).

The watcher holds the coordinator's identity (``flodl-bus up`` made it): it checks the
broadcast stream with its public key, and a rank's streams with the rank key it derives,
as the coordinator does, from the rank's Hello and the Assign on the join stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from flodl_bus.bus import entries
from flodl_bus.bus.connection import MAX_BLOCK_MS
from flodl_bus.bus.foreign import writer_limit
from flodl_bus.bus.ids import ZERO, EntryId, format_id, parse_id
from flodl_bus.bus.keys import BROADCAST, RunKeys
from flodl_bus.protocol import wire
from flodl_bus.protocol.messages import Assign, Hello
from flodl_bus.protocol.signing import (
    SIG_HEX,
    BroadcastVerifier,
    CoordinatorIdentity,
    MacKey,
    Verifier,
)

READ_COUNT = 1000
#: rejected entries remembered to count each once (a bound, not a budget)
REFUSED_KEPT = 10_000


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class _Unchecked:
    def verify(self, data: bytes, mac: bytes) -> bool:
        return True


_ANY = _Unchecked()


@dataclass(frozen=True, slots=True)
class Seen:
    """One authenticated entry: which stream family, whose, and the decoded message."""

    upstream: bool
    #: the rank of ``up:<r>``/``ctl:<r>``; None for ``ctl:all``
    rank: int | None
    entry_id: EntryId
    msg: object


class StreamWatcher:
    """Cursor over ``ctl:all``, ``ctl:<r>`` and ``up:<r>`` of ranks ``0..world_size-1``."""

    def __init__(
        self, client: redis.Redis, keys: RunKeys, world_size: int, identity: CoordinatorIdentity
    ) -> None:
        self.client = client
        self.keys = keys
        self.identity = identity
        self._rank_keys: dict[int, MacKey] = {}
        self.rejected = 0
        #: entries already counted as rejected (one beyond the run's ids is read again)
        self._refused: set[tuple[str, EntryId]] = set()
        self._last: dict[str, EntryId] = {keys.ctl_all: ZERO}
        self._who: dict[str, tuple[bool, int | None]] = {keys.ctl_all: (False, None)}
        for r in range(world_size):
            self._last[keys.ctl(r)] = ZERO
            self._last[keys.up(r)] = ZERO
            self._who[keys.ctl(r)] = (False, r)
            self._who[keys.up(r)] = (True, r)

    def poll(self, block_ms: int | None = 200) -> list[Seen]:
        """Entries written since the last poll, oldest first per stream.

        ``block_ms=None`` returns at once (XREAD without BLOCK; ``BLOCK 0`` would wait
        forever).
        """
        block = None if block_ms is None else min(block_ms, MAX_BLOCK_MS)
        reply: Any = self.client.xread(
            {s: format_id(i) for s, i in self._last.items()}, count=READ_COUNT, block=block
        )
        out: list[Seen] = []
        before = dict(self._last)
        for name, items in reply or ():
            stream = name.decode() if isinstance(name, bytes) else str(name)
            upstream, rank = self._who[stream]
            channel = wire.UPSTREAM if upstream else wire.CONTROL
            owner = BROADCAST if rank is None else str(rank)
            limit = writer_limit(_now_ms())
            for raw_id, fields in items:
                eid = parse_id(raw_id)
                verifier = self._verifier(rank)
                if verifier is None:
                    # Not judged yet: a rank given its --rank writes (heartbeats while it
                    # sets up) before the world forms and the coordinator's Assign names
                    # its key; the cursor stays and the entry is read again once it does.
                    break
                parsed = entries.parse(
                    verifier,
                    stream,
                    format_id(eid).encode(),
                    fields,
                    channel=channel,
                    rank=owner,
                )
                if isinstance(parsed, str):
                    if (stream, eid) not in self._refused:
                        self.rejected += 1
                        self._refused.add((stream, eid))
                    if eid[0] > limit:
                        # A foreign entry beyond any id of the run: passing it would
                        # skip every entry the run writes until the coordinator removes
                        # it (writers wait meanwhile), so the cursor stays and the same
                        # entry comes back on the next read, counted once.
                        break
                    self._last[stream] = eid
                    continue
                self._last[stream] = eid
                out.append(Seen(upstream, rank, eid, parsed.msg))
            if len(self._refused) > REFUSED_KEPT:
                self._refused.clear()
        if reply and block is not None and self._last == before:
            # Only an entry the cursor must not pass came back (it does at once on
            # every read): wait as a read would, not spin.
            time.sleep(block / 1000)
        # Ids are millisecond clocks (the coordinator's from one counter), so sorting
        # approximates the order things happened across streams; within a stream the
        # order is exact either way.
        out.sort(key=lambda seen: seen.entry_id)
        return out

    def _verifier(self, rank: int | None) -> Verifier | None:
        if rank is None:
            # A broadcast carries a MAC per rank (or a signature, in large worlds): the
            # slot of any rank whose key the watcher derived checks it.
            if not self._rank_keys:
                self._learn_keys()
            if not self._rank_keys:
                return None
            first = min(self._rank_keys)
            return BroadcastVerifier(first, self._rank_keys[first], self.identity.signing.public)
        if rank not in self._rank_keys:
            self._learn_keys()
        return self._rank_keys.get(rank)

    def _learn_keys(self) -> None:
        """Rank keys from the join stream: each Assign the coordinator signed, and the
        Hello of the worker it names."""
        found: Any = self.client.xrange(self.keys.join, "-", "+")
        pubs: dict[str, str] = {}
        answers = self.identity.signing.public
        for _id, fields in found or ():
            mac = fields.get(entries.F_MAC, b"")
            # Hellos need the run secret, which the watcher does not keep: a forged Hello
            # can only name a worker the coordinator never assigns.
            verifier: Verifier = answers if len(mac) == SIG_HEX else _ANY
            p = entries.parse(verifier, self.keys.join, b"", fields, channel=wire.JOIN, rank="join")
            if isinstance(p, str):
                continue
            if isinstance(p.msg, Hello):
                pubs.setdefault(p.msg.worker_id, p.msg.kx_pub)
            elif isinstance(p.msg, Assign) and len(mac) == SIG_HEX:
                pub = pubs.get(p.msg.worker_id)
                if pub:
                    try:
                        self._rank_keys[p.msg.rank] = self.identity.rank_key(
                            self.keys.run, p.msg.rank, pub
                        )
                    except ValueError:
                        continue

    def drain(self, handle: Callable[[Seen], None], rounds: int = 50) -> None:
        """Hand over what is left without blocking (after the writers stopped)."""
        for _ in range(rounds):
            batch = self.poll(block_ms=None)
            if not batch:
                return
            for seen in batch:
                handle(seen)
