"""The key layout of a run (DESIGN §3).

Every key of a run carries the run id inside a ``{...}`` hash tag, so a Redis Cluster
keeps a whole run in one slot (a multi-key XREADGROUP over ``ctl:<r>`` and ``ctl:all``
would otherwise be refused with CROSSSLOT).

A run spread over the shards of a Redis Cluster (``bus.cluster``) keeps its run-wide keys
(meta, identity, join, secret, store) under ``{RUN}`` and puts each rank's streams on
shard ``rank % S`` under the shard's own tag ``{RUN:n}``: ``ctl:<r>``, ``up:<r>``, the
shard's broadcast stream ``ctl:all`` and its ``dlq``. A rank's ordered read of its own
control and the broadcast thus stays within one slot, and ``n`` is picked per shard so
that the slots of the S tags lie on different masters (``cluster.choose_shards``). ``:``
never occurs in a run id, so no shard tag is another run's tag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

#: Letters, digits, ``.``, ``_`` and ``-``. Braces would break the hash tag, ``:`` would
#: make keys of two runs ambiguous, glob characters would break SCAN patterns.
_RUN_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
PREFIX: Final = "flodl"
BROADCAST: Final = "all"


class InvalidRunId(ValueError):
    pass


def validate_run_id(run: str) -> str:
    if not isinstance(run, str) or _RUN_ID.fullmatch(run) is None:
        raise InvalidRunId(
            f"invalid run id {run!r}: use 1-64 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit"
        )
    return run


def _rank(rank: int) -> int:
    if type(rank) is not int or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    return rank


@dataclass(frozen=True, slots=True)
class RunKeys:
    """All Redis keys of one run."""

    run: str
    #: the tag suffix ``n`` of each shard (``{RUN:n}``); empty: the whole run on one Redis
    shards: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        validate_run_id(self.run)
        if any(type(n) is not int or n < 0 for n in self.shards):
            raise ValueError(f"shard tags must be non-negative ints, got {self.shards!r}")
        if len(set(self.shards)) != len(self.shards):
            raise ValueError(f"shard tags must differ, got {self.shards!r}")

    @property
    def prefix(self) -> str:
        return f"{PREFIX}:{{{self.run}}}:"

    def shard_of(self, rank: int) -> int | None:
        """The shard index rank ``rank``'s streams live on (None on one Redis)."""
        _rank(rank)
        return rank % len(self.shards) if self.shards else None

    def shard_prefix(self, shard: int | None) -> str:
        """The prefix of shard ``shard``'s keys (the run's prefix for None)."""
        if shard is None:
            return self.prefix
        return f"{PREFIX}:{{{self.run}:{self.shards[shard]}}}:"

    @property
    def shard_prefixes(self) -> list[str]:
        """Every prefix the run's keys start with (the run-wide one first)."""
        return [self.prefix] + [self.shard_prefix(i) for i in range(len(self.shards))]

    def ctl(self, rank: int) -> str:
        return f"{self.shard_prefix(self.shard_of(rank))}ctl:{_rank(rank)}"

    @property
    def ctl_all(self) -> str:
        """The broadcast stream of a run on one Redis (each shard has its own:
        ``ctl_all_of``)."""
        return f"{self.prefix}ctl:{BROADCAST}"

    def ctl_all_of(self, rank: int) -> str:
        """The broadcast stream rank ``rank`` reads."""
        return f"{self.shard_prefix(self.shard_of(rank))}ctl:{BROADCAST}"

    def broadcast_of_shard(self, shard: int | None) -> str:
        return f"{self.shard_prefix(shard)}ctl:{BROADCAST}"

    @property
    def broadcasts(self) -> list[str]:
        """Every broadcast stream of the run (one per shard)."""
        if not self.shards:
            return [self.ctl_all]
        return [self.broadcast_of_shard(i) for i in range(len(self.shards))]

    def up(self, rank: int) -> str:
        return f"{self.shard_prefix(self.shard_of(rank))}up:{_rank(rank)}"

    def dlq_of_shard(self, shard: int | None) -> str:
        """The dlq beside a shard's streams: a reader's dead-letter write and its XACK go
        to one node."""
        return f"{self.shard_prefix(shard)}dlq"

    @property
    def dlqs(self) -> list[str]:
        return [self.dlq] + [self.dlq_of_shard(i) for i in range(len(self.shards))]

    def shard_of_key(self, key: str) -> int | None:
        """The shard a key of the run lives on (None: a run-wide key, or one Redis)."""
        for i in range(len(self.shards)):
            if key.startswith(self.shard_prefix(i)):
                return i
        return None

    def dlq_for(self, stream: str) -> str:
        """The dlq in the slot of ``stream`` (the run's dlq on one Redis)."""
        return self.dlq_of_shard(self.shard_of_key(stream))

    def fence(self, shard: int | None) -> str:
        """A counter the coordinator bumps after a write so that ``WAIT`` (which counts
        the writes of its own connection) covers that write (``cluster.confirm``)."""
        return f"{self.shard_prefix(shard)}fence"

    @property
    def join(self) -> str:
        return f"{self.prefix}join"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}dlq"

    @property
    def meta(self) -> str:
        return f"{self.prefix}meta"

    @property
    def identity(self) -> str:
        """The coordinator's public keys (a hash it alone writes; ranks read it)."""
        return f"{self.prefix}identity"

    @property
    def secret(self) -> str:
        """The run's MAC key. Outside ``flodl:*`` on purpose: the read-only observer ACL
        user (``~flodl:*``) can watch every stream and ``meta`` but never forge entries.
        Same hash tag, so a Redis Cluster still keeps the run in one slot."""
        return f"{PREFIX}-secret:{{{self.run}}}"

    def store(self, name: str) -> str:
        if not name:
            raise ValueError("store key name must not be empty")
        return f"{self.prefix}store:{name}"

    @property
    def ctl_pattern(self) -> str:
        """SCAN pattern of every control stream (braces are literal in Redis globs)."""
        return f"{self.prefix}ctl:*"

    @property
    def up_pattern(self) -> str:
        return f"{self.prefix}up:*"

    def short(self, key: str) -> str:
        """``ctl:3`` for ``flodl:{run}:ctl:3`` (for humans; keys of other runs unchanged).
        A shard's keys keep their shard: ``s1/ctl:all``."""
        if key.startswith(self.prefix):
            return key[len(self.prefix) :]
        for i in range(len(self.shards)):
            head = self.shard_prefix(i)
            if key.startswith(head):
                tail = key[len(head) :]
                return tail if self.rank_of_tail(tail) is not None else f"s{i}/{tail}"
        return key

    def rank_of(self, key: str) -> int | None:
        """The rank a ``ctl:<r>`` or ``up:<r>`` key belongs to (None for ``ctl:all`` etc.)."""
        return self.rank_of_tail(self.short(key))

    @staticmethod
    def rank_of_tail(tail: str) -> int | None:
        for head in ("ctl:", "up:"):
            num = tail[len(head) :]
            if tail.startswith(head) and num.isascii() and num.isdigit():
                return int(num)
        return None
