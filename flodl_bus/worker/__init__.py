"""A rank: the control core, the training loop and the threads around them."""
