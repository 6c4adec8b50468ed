"""The control plane on Redis Streams."""
