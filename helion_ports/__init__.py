"""Helion twins of the kraken recipes: ``helion_ports.X.y`` computes what ``kraken.X.y`` does."""
