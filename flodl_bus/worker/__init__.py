"""A rank: the control core, the training loop, the threads around them, its recording.

``control`` holds every rule of the rank's protocol (sans-IO: no torch, no transport, no
clock); ``ports`` the narrow interfaces it reaches the model through; ``loop`` the training
thread; ``runtime`` the reader, heartbeat and session threads; ``recording`` the rank's
record (observing the core, wrapping its ports); ``rank`` assembles one; ``cli`` starts it.

May import ``protocol``, ``bus``, ``params``, ``record`` (the write side), ``job``,
``partition``, ``exits`` and ``stop_signals``; never ``coordinator``, ``replay``,
``launch`` or ``examples`` (a job is loaded by name).
"""
