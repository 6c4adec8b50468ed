"""``flodl-bus up``: a whole run on one machine, watched through its control plane."""
