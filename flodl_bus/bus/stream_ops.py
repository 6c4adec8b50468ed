"""What every writer and reader of the run's streams shares (DESIGN §3): the bus
settings, a stream's top, consumer groups, and how a writer finds its place again.

Rule 3 (no duplicates, no loss) rests on explicit ids: Redis refuses an id at or below a
stream's top (``id_refused``), so a retried XADD is harmless; after a lost reply
``landed`` asks whether our entry (same id AND same MAC) is there. A writer that starts
again continues its seq above its last verified entry (``last_seq``).

Rule 5 (bounded memory): every XADD caps with ``MAXLEN ~ maxlen`` (``StreamsConfig``),
the bound when a reader falls far behind: a reader must stay less than ``maxlen`` entries
(default 100,000) behind on a stream. The coordinator also trims to what all readers
consumed (``bus.trim``).

Rule 6 (bounded waits): BLOCK is capped at ``MAX_BLOCK_MS`` (1 s) under a 10 s socket
timeout; ``Link`` reconnects with exponential backoff and logs one line per reconnect.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any, Final

import redis
import structlog

from flodl_bus.bus import entries
from flodl_bus.bus.connection import MAX_BLOCK_MS, Backoff
from flodl_bus.bus.ids import ZERO, EntryId, parse_id
from flodl_bus.bus.trim import DEFAULT_STALE_S, DEFAULT_TRIM_INTERVAL_S
from flodl_bus.protocol.signing import Verifier

log = structlog.get_logger("flodl_bus.bus")

DEFAULT_MAXLEN: Final = 100_000


class BusError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class StreamsConfig:
    #: ``MAXLEN ~`` of every stream (see rule 5 above for the bound it implies).
    maxlen: int = DEFAULT_MAXLEN
    #: COUNT of one XREADGROUP, per stream.
    read_count: int = 512
    #: The most entries one read asks for over all its streams: the COUNT per stream
    #: falls as streams are added (never below 1). A coordinator reading 4,096 ranks'
    #: streams at 512 each got 110,000 entries in one read and dispatched them for 30 s
    #: without a tick, so every rank whose entries came early in that pass looked silent
    #: for the heartbeat timeout and was declared dead while its next entries waited
    #: unread. Bounded, each pass reaches every stream with entries, and ticks keep
    #: coming (``GroupCursor`` reads that COUNT).
    read_total: int = 8192
    #: Most upstream entries the publisher writes in one pipeline.
    publish_batch: int = 512
    #: How long the publisher lets a message without news for the coordinator's next
    #: decision (``Batch``, ``LrUpdate``, ``Heartbeat``) wait for company before it
    #: writes: one transaction then carries a run of steps. Every other message (a plan's
    #: ``MetricsMsg``, a ``SyncAck``...) is written at once with all queued before it. A
    #: transaction holds the GIL for some 150 us of redis-py work; written per step, that
    #: doubled a digits step on the training thread (``bench worker``). 0 writes at once.
    publish_linger_s: float = 0.005
    #: Whether the first ``Batch`` after a message the coordinator acts on is written at
    #: once too (``bus.publisher``): a world of one's, which its next plan is sent on. Not
    #: elsewhere: it is one more wake of the publisher a plan or a round (two cpu-cadence
    #: ranks on two cores: 5% slower), and in the sync modes a round that waits for it
    #: fires sooner, so a run makes more of them (cpu-sync x2 on two cores: 100-120 rounds
    #: in 1.36-1.53 s against 84-86 in 1.19-1.23 s).
    publish_first_step: bool = False
    #: Whether a plan's ``MetricsMsg`` and an ``EvalResult`` wait for the next ``Batch``
    #: (written at once as the first after them) rather than going at once (a world of
    #: one, which holds its next plan: ``bus.publisher``). The rank must then call the
    #: publisher's ``hurry`` before it blocks on its control.
    publish_epoch_end_lazy: bool = False
    max_block_ms: int = MAX_BLOCK_MS
    backoff: Backoff = field(default_factory=Backoff)
    #: The coordinator trims every stream to what its readers consumed this often
    #: (``bus.trim``); 0 leaves only the ``MAXLEN`` cap.
    trim_interval_s: float = DEFAULT_TRIM_INTERVAL_S
    #: A reader that holds trimming back without moving this long is taken as gone.
    trim_stale_s: float = DEFAULT_STALE_S


#: A world of one's ``publish_linger_s``: it has no round, no gate and no bridge to time
#: by its steps, and the one step report its coordinator acts on (a plan's first, which
#: sends the next plan ahead) is written at once anyway (``bus.publisher``). Every write
#: wakes the publisher thread, and every wake of another thread costs the training thread
#: (the GIL, and the core it is woken on): at 5 ms, some 200 writes a second took about
#: 8% of a world of one's digits time on two cores (BENCHMARKS.md, 2026-12-06).
SOLO_PUBLISH_LINGER_S: Final = 0.05


def rank_streams_config(world_size: int) -> StreamsConfig | None:
    """A rank's publisher settings where they differ from the defaults (None): a world of
    one lingers ``SOLO_PUBLISH_LINGER_S``, writes a plan's first step report at once
    (``publish_first_step``) and lets its epoch's end wait for it
    (``publish_epoch_end_lazy``)."""
    if world_size == 1:
        return StreamsConfig(
            publish_linger_s=SOLO_PUBLISH_LINGER_S,
            publish_first_step=True,
            publish_epoch_end_lazy=True,
        )
    return None


def rank_group(rank: int) -> str:
    return f"rank{rank}"


def read_count_for(config: StreamsConfig, streams: int) -> int:
    """The COUNT per stream of a read over ``streams`` streams (``read_total``)."""
    return max(1, min(config.read_count, config.read_total // max(1, streams)))


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def settle_heap() -> None:
    """Move every object made so far out of the cyclic collector's view (``gc.freeze``).

    A full collection walks every tracked object: with a process's imports alone (some
    40,000 objects, more with torch) that is a 5-10 ms stall of every thread, and on an
    H200 host it took the control dispatch p99 from 0.6 ms to 10-28 ms (one stall holds
    up the ~20 messages behind it). What a bus process keeps from its start is never
    garbage; after a freeze a full collection walks only what was made since. Closing a
    bus unfreezes: a frozen object is never collected, not even at exit, and a process
    group left to the interpreter's teardown ends the process in std::terminate.
    """
    gc.freeze()


def id_refused(exc: redis.exceptions.ResponseError) -> bool:
    # "equal or smaller than the target stream top item", or, past the largest id,
    # "The stream has exhausted the last possible ID"
    text = str(exc)
    return "equal or smaller" in text or "exhausted the last possible ID" in text


def _as_map(fields: Any) -> dict[bytes, bytes]:
    """An entry's fields as XRANGE gives them: a dict, or a flat [k, v, ...] list."""
    if not fields:
        return {}
    if isinstance(fields, dict):
        return fields
    it = iter(fields)
    return dict(zip(it, it))


def landed(client: redis.Redis, stream: str, eid: str, mac: bytes) -> bool:
    """Whether our entry (same id AND same mac) is in ``stream``: after a lost reply a
    refused id only proves *someone's* entry is there."""
    found: Any = client.xrange(stream, min=eid, max=eid, count=1)
    return bool(found) and _as_map(found[0][1]).get(entries.F_MAC) == mac


def last_seq(client: redis.Redis, stream: str, verifier: Verifier, rank: str, channel: str) -> int:
    """The seq of the newest entry in ``stream`` that verifies with our key (0 if none):
    a writer that starts again on a stream continues above it, so readers that already
    passed the old entries keep accepting. Foreign entries cannot move it."""
    found: Any = client.xrevrange(stream, "+", "-", count=64)
    for raw_id, fields in found or ():
        p = entries.parse(verifier, stream, raw_id, _as_map(fields), channel=channel, rank=rank)
        if isinstance(p, entries.Parsed):
            return p.seq
    return 0


def stream_top(client: redis.Redis, stream: str) -> EntryId:
    """The last id ever generated in ``stream`` (survives trimming), ZERO if absent."""
    try:
        info = client.xinfo_stream(stream)
    except redis.exceptions.ResponseError as exc:
        if "no such key" in str(exc).lower():
            return ZERO
        raise
    return parse_id(info["last-generated-id"])


def ensure_group(client: redis.Redis, stream: str, group: str, start: str = "0") -> None:
    """Create ``group`` on ``stream`` from ``start`` (from the beginning by default:
    entries sent before a reader started must reach it), creating the stream if needed;
    an existing group is kept."""
    try:
        client.xgroup_create(stream, group, id=start, mkstream=True)
    except redis.exceptions.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
