"""Helion twins of kraken.fused (same module names and signatures)."""
