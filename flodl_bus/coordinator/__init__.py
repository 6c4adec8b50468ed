"""The coordinator: a sans-IO scheduling core (``core.Coordinator``) and its helpers.

The runtime (IO loop over the Redis transport) is built on top of ``core``; nothing in
this package reads a clock, opens a socket or imports torch.
"""
