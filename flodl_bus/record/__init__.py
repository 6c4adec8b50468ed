"""Recording every dispatch (structlog, JSON lines) and replaying it."""
