"""Recipes: communication fused with compute, one file each (``kraken.<name>`` is the installed one)."""
