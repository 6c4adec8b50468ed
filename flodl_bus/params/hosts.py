"""Where a world's process groups listen and dial (no torch here: the launcher imports it).

``FLODL_BIND_HOST`` is the address rank 0 hosts the NCCL bootstrap store on and tells its
peers to dial (``groups``); unset, the host name's address. ``pin_one_host`` keeps a
world that lives on one host on loopback.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Final

#: Where rank 0 hosts the NCCL bootstrap store; other ranks must reach it.
ENV_BIND_HOST: Final = "FLODL_BIND_HOST"

#: A world on one host needs no address but loopback: the bootstrap store, gloo's pairs
#: and NCCL's bootstrap sockets all stay on ``lo`` (NCCL's data path, NVLink or PCIe
#: peer copies, does not use sockets). Without these, gloo and NCCL pick the address
#: the host name resolves to, or the first non-loopback interface.
ONE_HOST_ENV: Final = {
    ENV_BIND_HOST: "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
}


def pin_one_host(env: MutableMapping[str, str]) -> None:
    """Keep a single-host world's process groups on loopback (``up``, the benches, the
    tests); a variable already set wins, so an operator can still choose."""
    for key, value in ONE_HOST_ENV.items():
        env.setdefault(key, value)
