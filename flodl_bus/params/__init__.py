"""The parameter plane: rendezvous store, collectives, averaging, pinned staging."""
