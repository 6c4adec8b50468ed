"""The Redis ACL rules of a run's host agents: the least a host agent needs.

An agent reads its ranks' control (``ctl:*``: XREAD, and XRANGE for a rank that
(re)connects), reads the run's ``meta`` (its shards), writes its host's fold stream
(``up:host:*``: XADD with an explicit id, XINFO STREAM for the top, XRANGE after a lost
reply, XREVRANGE for the seq to continue) and dead letters (``dlq``, write only).
Nothing else: it cannot write control, cannot write a rank's own ``up:<r>``, reads no
secret, joins nothing, touches no rendezvous key, takes no consumer group. It holds no
key either (``flodl_bus.agent``), so even with its password an intruder can only
withhold or delay its ranks' traffic, never forge it: the coordinator dead-letters what
the ranks did not sign and declares silent ranks dead.

``flodl-RUN-agent`` is made apart from the three users of ``flodl-bus acl create``
(``bus.acl``), whose files and counts stay as they are:
``ACL SETUSER flodl-RUN-agent on #<sha256> <agent_rules(RUN)>``.
"""

from __future__ import annotations

from typing import Final

from flodl_bus.bus.acl import CONNECTION, HASH_READ, WORKER_CTL, WORKER_DLQ, _prefixes
from flodl_bus.bus.fold import HOST_PREFIX
from flodl_bus.bus.keys import PREFIX, RunKeys

AGENT_FOLD: Final = ("+xadd", "+xrange", "+xrevrange", "+xinfo|stream")


def agent_user(run: str) -> str:
    return f"{PREFIX}-{RunKeys(run).run}-agent"


def agent_rules(run: str | None, *, client_setinfo: bool = False) -> list[str]:
    """The rules of the run's agent user (``run=None``: over every run)."""
    p, _ = _prefixes(run)
    connection = [*CONNECTION, *(("+client|setinfo",) if client_setinfo else ())]

    def selector(keys: list[str], commands: tuple[str, ...]) -> str:
        return "(" + " ".join([*keys, "resetchannels", "-@all", *commands]) + ")"

    return [
        "resetkeys",
        "resetchannels",
        "-@all",
        *connection,
        selector([f"%R~{p}ctl:*"], WORKER_CTL),
        selector([f"~{p}up:{HOST_PREFIX}*"], AGENT_FOLD),
        selector([f"%W~{p}dlq"], WORKER_DLQ),
        selector([f"%R~{p}meta"], HASH_READ),
    ]
