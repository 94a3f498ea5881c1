"""Helion twins of ``kraken/fused``, one file each (``helion_ports.<name>`` is the installed one)."""
