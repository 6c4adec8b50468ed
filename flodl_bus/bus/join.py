"""The ``join`` stream: dial-in membership entries (Hello, Assign, Reject).

One stream per run, written by both sides: workers post ``Hello``, the coordinator
posts ``Assign`` / ``Reject`` addressed by ``worker_id``. Every entry is signed like the
control and upstream streams (rank field ``join``), so a process of another run cannot
claim a rank. No consumer groups: the coordinator reads the whole stream from the
start (a worker may say Hello before the coordinator reads), a worker reads from its
own Hello on (answers always follow the Hello they answer).

A retried XADD (lost reply) may post a second copy of an entry; both sides dedupe by
``worker_id``, so that is harmless. For the same reason join entries are not bound to
their entry id (``XADD *``, many writers): a Hello or an answer put back into the stream
is one more copy of something already deduped.

Keys: a Hello is MACed with the run secret (what makes a worker a member); an Assign or
Reject is signed with the coordinator's Ed25519 key, so a worker holding the run secret
cannot answer for the coordinator (an answer MACed with the secret is refused).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any, Final

import redis
import structlog

from flodl_bus.bus import entries, foreign, stream_ops
from flodl_bus.bus.connection import MAX_BLOCK_MS, BusUnavailable, Link
from flodl_bus.bus.ids import ZERO, parse_id
from flodl_bus.bus.keys import RunKeys
from flodl_bus.protocol import wire
from flodl_bus.protocol.messages import Hello, JoinMsg
from flodl_bus.protocol.signing import SIG_HEX, MacKey, Signer, SigningKey, VerifyKey

log = structlog.get_logger("flodl_bus.bus")

#: The ``rank`` field of every join entry (the sender has no rank yet).
JOIN_RANK: Final = "join"
#: Entries of one XREAD.
READ_COUNT: Final = 256
#: ``MAXLEN ~`` of the join stream: one Hello and one answer per worker.
JOIN_MAXLEN: Final = 10_000
#: how long a post waits for the coordinator to unwedge the stream
WEDGED_WAIT_S: Final = 30.0


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class JoinStream:
    """Post and read signed membership entries of one run."""

    def __init__(
        self,
        client: redis.Redis,
        run: str | RunKeys,
        secret: bytes,
        *,
        signer: SigningKey | None = None,
        answers: VerifyKey | None = None,
        where: str = "",
    ) -> None:
        """``signer``: the coordinator's (it posts answers); ``answers``: the key a worker
        checks answers with (the coordinator's public key)."""
        self.keys = run if isinstance(run, RunKeys) else RunKeys(run)
        self.client = client
        self.member = MacKey(secret)
        self.signer = signer
        self.answers = answers if answers is not None else (signer.public if signer else None)
        self.stream = self.keys.join
        self._seq = itertools.count(1)
        self._link = Link(client, name="join", where=where)
        #: entries refused for authentication (a wrong secret, a forger)
        self.auth_failures = 0
        #: foreign entries beyond the horizon already dead-lettered (left below them)
        self._beyond: set[str] = set()

    def verify(self, data: bytes, mac: bytes) -> bool:
        if len(mac) == SIG_HEX:
            return self.answers is not None and self.answers.verify(data, mac)
        return self.member.verify(data, mac)

    def post(self, msg: JoinMsg) -> str:
        """Append ``msg``; returns its entry id (a reader of answers starts there)."""
        signer: Signer | None = self.member if isinstance(msg, Hello) else self.signer
        if signer is None:
            raise TypeError(f"only the coordinator posts {type(msg).__name__}")
        fields = entries.build(signer, self.stream, "", msg, JOIN_RANK, next(self._seq))

        def op(retry: bool) -> str:
            eid = self.client.xadd(
                self.stream,
                fields,  # type: ignore[arg-type]
                maxlen=JOIN_MAXLEN,
                approximate=True,
            )
            return eid.decode() if isinstance(eid, bytes) else str(eid)

        deadline = time.monotonic() + WEDGED_WAIT_S
        while True:
            try:
                return self._link.call(op)
            except redis.exceptions.ResponseError as exc:
                # A foreign entry at the largest id: XADD * has no id left to give. The
                # coordinator removes it; a worker waits for that, boundedly.
                if not stream_ops.id_refused(exc) or time.monotonic() > deadline:
                    raise
                log.warning("join_stream_blocked", stream=self.stream, error=str(exc)[:120])
                if self.signer is not None:
                    self._repair()
                else:
                    time.sleep(0.2)

    def _repair(self) -> None:
        self._link.call(
            lambda retry: foreign.repair_stream(
                self.client, self.stream, self.keys.dlq, floor=ZERO, now_ms=_now_ms(), by="join"
            )
        )

    def read(self, after: str, block_ms: int | None) -> tuple[list[tuple[str, JoinMsg]], str]:
        """Entries after id ``after`` (``"0"`` = from the start) and the new cursor.

        ``block_ms`` None polls without blocking. Entries that fail to authenticate or
        decode go to the dlq with the reason and are skipped.
        """
        block = None if block_ms is None else max(1, min(block_ms, MAX_BLOCK_MS))

        def op(retry: bool) -> Any:
            return self.client.xread({self.stream: after}, count=READ_COUNT, block=block)

        deadline = time.monotonic() + (block or 0) / 1000 + 0.05
        try:
            raw = self._link.call(op, deadline=deadline)
        except BusUnavailable:
            return [], after
        out: list[tuple[str, JoinMsg]] = []
        rejected: list[tuple[str, dict[bytes, bytes], str]] = []
        cursor = after
        if isinstance(raw, dict):  # a RESP3 client: {stream: [entries]}
            raw = [(k, v[0] if v and isinstance(v[0], list) else v) for k, v in raw.items()]
        limit = foreign.writer_limit(_now_ms())
        beyond = False
        for _name, items in raw or ():
            for eid_raw, fields in items:
                eid = eid_raw.decode() if isinstance(eid_raw, bytes) else str(eid_raw)
                if parse_id(eid)[0] > limit:
                    # No writer of the run makes such an id. The cursor stays below it:
                    # once the coordinator removed it, new entries come below it too.
                    beyond = True
                    if eid not in self._beyond:
                        self._beyond.add(eid)
                        why = "foreign: entry id beyond the horizon"
                        rejected.append((eid, fields, why))
                    continue
                cursor = eid
                parsed = entries.parse(
                    self, self.stream, b"", fields, channel=wire.JOIN, rank=JOIN_RANK
                )
                if not isinstance(parsed, str):
                    signed = len(fields[entries.F_MAC]) == SIG_HEX
                    if signed == isinstance(parsed.msg, Hello):
                        parsed = (
                            "authentication failed: a Hello signed as the coordinator"
                            if signed
                            else "authentication failed: an answer not signed by the coordinator"
                        )
                if isinstance(parsed, str):
                    rejected.append((eid, fields, parsed))
                else:
                    out.append((eid, parsed.msg))  # type: ignore[arg-type]
        if rejected:
            self._dead_letter(rejected)
        if beyond and self.signer is not None:
            self._repair()
        return out, cursor

    def _dead_letter(self, rejected: Sequence[tuple[str, dict[bytes, bytes], str]]) -> None:
        for eid, _fields, reason in rejected:
            log.error("join_dead_letter", stream=self.stream, entry=eid, reason=reason)
            if reason.startswith("authentication failed"):
                self.auth_failures += 1
                if self.auth_failures == 1:
                    # Once: a worker with a wrong secret retries, an attacker floods.
                    log.error(
                        "join_authentication_failed",
                        run=self.keys.run,
                        hint="a worker's run secret is not this run's "
                        "(FLODL_RUN_SECRET), or someone else writes the join stream",
                    )

        def op(retry: bool) -> None:
            pipe = self.client.pipeline(transaction=False)
            for eid, fields, reason in rejected:
                pipe.xadd(
                    self.keys.dlq,
                    entries.dead_letter_fields(  # type: ignore[arg-type]
                        self.stream, eid, reason, fields, "join"
                    ),
                    maxlen=JOIN_MAXLEN,
                    approximate=True,
                )
            pipe.execute()

        self._link.call(op)

    def close(self) -> None:
        self._link.close()
