"""Helion twins of ``kraken/comm``, one file each (``helion_ports.<name>`` is the installed one)."""
