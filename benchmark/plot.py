"""One picture per op: time per call against size for every backend with the floor, and the speedup over
the baseline. Used by ``python -m benchmark --plot DIR`` and ``python -m benchmark.report --plot DIR``.

Needs matplotlib (``pip install -e ".[plot]"``); draws off-screen, so it runs on a machine with no GPU
and no display.
"""

from __future__ import annotations

from benchmark import harness, provenance, registry


def plot_op(op: registry.Op, rows: list[harness.Row], backends: list[str], path: str) -> None:
    """Write ``path`` (PNG): left, microseconds per call (log scale) per backend and the floor (dashed);
    right, speedup over ``op.baseline`` (above 1 is faster). Shapes in the order the rows give them."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit('--plot needs matplotlib: pip install -e ".[plot]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r.shape for r in rows))
    us = {(r.backend, r.shape): r.us for r in rows if r.status == "ok" and r.us is not None}
    floor = {r.shape: r.floor_us for r in rows if r.floor_us is not None}
    x = range(len(shapes))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for backend in backends:
        points = [(i, us[(backend, s)]) for i, s in enumerate(shapes) if (backend, s) in us]
        if points:
            left.plot(*zip(*points), marker="o", label=backend)
        base = [(i, harness.speedup(us[(op.baseline, s)], us[(backend, s)])) for i, s in enumerate(shapes)
                if backend != op.baseline and (backend, s) in us and (op.baseline, s) in us]
        if base:
            right.plot(*zip(*base), marker="o", label=backend)
    if floor:
        left.plot([i for i, s in enumerate(shapes) if s in floor], [floor[s] for s in shapes if s in floor],
                  "k--", label="floor")
    left.set_yscale("log")
    left.set_ylabel("us per call (slowest rank's median)")
    right.axhline(1.0, color="grey", linewidth=1)
    right.set_ylabel(f"speedup over {op.baseline} (>1 is faster)")
    for axis in (left, right):
        axis.set_xticks(list(x), shapes, rotation=45, ha="right", fontsize=8)
        axis.set_xlabel(op.shape_format)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    meta = rows[0].meta
    fig.suptitle(f"{op.name}, world size {rows[0].world_size}, {rows[0].mode}, {rows[0].dtype} "
                 f"({meta.get('gpu', provenance.UNKNOWN)}, commit {meta.get('commit', provenance.UNKNOWN)})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
