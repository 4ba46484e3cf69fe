"""The `specserve` commands, on top of everything: nothing imports them."""
