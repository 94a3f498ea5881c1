"""Recipes: collectives over symmetric memory, one file each (``kraken.<name>`` is the installed one)."""
