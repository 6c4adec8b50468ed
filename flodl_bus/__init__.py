"""flodl_bus: flodl's DDP control plane on Redis Streams."""

__version__ = "0.1.0"
