"""The coordinator: one scheduling core and the runtime that feeds it.

Cores (sans-IO: no clock, socket, log or torch; they take a message and ``now`` and
return ``effects``): ``core`` (routes each upstream message and tick to its rule),
``dispatch`` (progressive pools | fixed partition), ``reduce`` (NCCL acks | CPU cycle),
``liveness``, ``checkpoint``, ``elche``, ``guard``, ``chunk_pool``, ``roles``,
``metrics``, ``membership`` (who joins at which rank), ``config``, ``effects``.

Runtime (IO): ``runtime`` (the loop over the Redis bus: clock, reads, sends, record),
``supervisor`` (the launcher's pipe, on a thread), ``cli`` (arguments, logging,
signals), ``bench`` (a timed drive of the core).

May import: ``exits``, ``protocol``, ``stop_signals``, ``partition``, ``bus``,
``record`` (the write side).
"""
