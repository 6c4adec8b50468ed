"""The control plane on Redis Streams.

``keys`` (every Redis key of a run), ``ids`` and ``entries`` (one signed entry),
``connection`` (URLs, clients and ``Link``, the one retry policy), ``streams`` (the rank's
and the coordinator's buses; their parts in ``stream_ops``, ``reader``, ``publisher`` and
``foreign``), ``cursor``, ``join``, ``trim``, ``store`` (torch's rendezvous store on
Redis), ``server`` (a local redis-server), ``tail``, ``acl``, ``run_secret``, ``memory``
(an in-process bus for tests and replay).

May import ``protocol`` and ``options`` only; ``params``, the cores' runtimes and the
commands above import it.
"""
