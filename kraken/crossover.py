"""Moved to ``kraken.runtime.crossover``; kept so that ``from kraken import crossover`` still works. These are the
same objects: patch the tables there (a dict here is the same dict), and functions in ``kraken.runtime.crossover``."""

from kraken.runtime.crossover import (  # noqa: F401
    FAMILY, FORMS, FUSED, FUSED_FROM, ONE, ONE_SHOT_UP_TO, SEQUENTIAL, SHOTS, TWO, checked_plan, choose, choose_form,
    form, fused_from, fused_prepared, one_shot_up_to, plan, size_of, traced_call, traced_shot,
)
