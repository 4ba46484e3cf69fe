"""Ray cluster placement, the state store, configuration and the `specserve` CLI."""
