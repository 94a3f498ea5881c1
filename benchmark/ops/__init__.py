"""One module per op family; each calls ``benchmark.registry.register`` at import."""
