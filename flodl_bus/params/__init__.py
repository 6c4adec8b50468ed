"""The parameter plane: process groups, collectives, averaging, pinned staging.

``groups`` (sessions formed through ``bus.store``, abort, re-session), ``collective``
(SyncNow: the model in flat buffers, one pipelined weighted all-reduce), ``cpu_avg`` (the
background round on host staging), ``averaging`` (masses, divergence, EASGD, outer
optimizers), ``flat`` (flat buffers per dtype), ``plane`` (``TorchParamPort``, the port a
rank's control core reaches), ``port``.

May import ``protocol`` and ``bus``; the worker imports it, nothing below does.
"""
