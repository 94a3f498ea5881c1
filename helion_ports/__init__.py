"""Helion twins of the kraken recipes: ``helion_ports.X.y`` computes what ``kraken.X.y`` does.

Every twin's ``helion.Config`` says ``pid_type="flat"``: ``hl.grid(num_blocks)`` then launches
exactly the recipe's ``num_blocks`` programs, and the grid index is the barrier's block id. Left to
itself, Helion 1.5 picks a persistent pid type for kernels with symmetric-memory arguments: one
program per SM, all but ``num_blocks`` of them idle. An explicit ``pid_type`` is honoured.
"""
