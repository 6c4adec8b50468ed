"""The key layout of a run (DESIGN §3).

Every key of a run carries the run id inside a ``{...}`` hash tag, so a Redis Cluster
keeps a whole run in one slot (a multi-key XREADGROUP over ``ctl:<r>`` and ``ctl:all``
would otherwise be refused with CROSSSLOT).
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

    def __post_init__(self) -> None:
        validate_run_id(self.run)

    @property
    def prefix(self) -> str:
        return f"{PREFIX}:{{{self.run}}}:"

    def ctl(self, rank: int) -> str:
        return f"{self.prefix}ctl:{_rank(rank)}"

    @property
    def ctl_all(self) -> str:
        return f"{self.prefix}ctl:{BROADCAST}"

    def up(self, rank: int) -> str:
        return f"{self.prefix}up:{_rank(rank)}"

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
        """``ctl:3`` for ``flodl:{run}:ctl:3`` (for humans; keys of other runs unchanged)."""
        return key[len(self.prefix) :] if key.startswith(self.prefix) else key

    def rank_of(self, key: str) -> int | None:
        """The rank a ``ctl:<r>`` or ``up:<r>`` key belongs to (None for ``ctl:all`` etc.)."""
        tail = self.short(key)
        for head in ("ctl:", "up:"):
            num = tail[len(head) :]
            if tail.startswith(head) and num.isascii() and num.isdigit():
                return int(num)
        return None
