"""One picture per op: time per call against size for every backend with the floor, and the speedup over
the baseline, world sizes side by side. Used by ``python -m benchmark --plot DIR`` and
``python -m benchmark.report --plot DIR``.

Every backend has one color in every panel of every figure (``color``): library baselines in black, blue and
purple, Triton recipes in reds and oranges, Helion twins in greens, the compute alone (an op's
``reference_free`` backends: the matmul or copy without the exchange) in greys, drawn dashed as the ceiling of
the speedup panel rather than as one more backend. Shapes go from the least work per call to the most
(``harness.by_work``).

Needs matplotlib (``pip install -e ".[plot]"``); draws off-screen, so it runs on a machine with no GPU
and no display.
"""

from __future__ import annotations

import zlib

from benchmark import harness, provenance, registry

# Distinct within every registered op's backends (a CPU test checks it); a name shared by several ops (triton,
# nccl, matmul) has its one color in all of them.
COLORS = {
    # library baselines
    "nccl": "#000000", "nccl_cudnn": "#000000", "nccl_flash": "#393b79",
    "torch_fused": "#1f77b4", "torch_cp": "#1f77b4", "chain": "#1f77b4", "torch_async_tp": "#17becf",
    "symm_mem": "#9467bd", "symm_mem_1shot": "#9467bd", "symm_mem_2shot": "#c5b0d5",
    # Triton recipes and their variants
    "triton": "#d62728", "triton_1shot": "#ff7f0e", "triton_2shot": "#8c564b", "triton_auto": "#e377c2",
    "triton_fused": "#ff9896", "triton_seq": "#ffbb78", "triton_local": "#ff9896", "triton_progress": "#ff7f0e",
    "triton_compiled": "#ff7f0e",
    # Helion twins
    "helion": "#2ca02c", "helion_1shot": "#98df8a", "helion_2shot": "#bcbd22", "helion_auto": "#dbdb8d",
    "helion_progress": "#98df8a", "helion_compiled": "#98df8a",
    # the compute alone, without the exchange
    "matmul": "#7f7f7f", "scaled_mm": "#7f7f7f", "copy": "#7f7f7f", "sdpa_cudnn": "#7f7f7f", "sdpa_flash": "#b0b0b0",
}
# A backend not named above: one of these, chosen by a checksum of its name (the same in every run).
SPARE_COLORS = ("#17becf", "#bcbd22", "#e377c2", "#8c564b", "#aec7e8", "#ffbb78", "#c49c94", "#f7b6d2")


def color(backend: str) -> str:
    """The backend's color, the same in every panel, figure and run."""
    return COLORS.get(backend) or SPARE_COLORS[zlib.crc32(backend.encode()) % len(SPARE_COLORS)]


def plot_op(op: registry.Op, rows: list[harness.Row], backends: list[str], path: str) -> None:
    """Write ``path`` (PNG): per world size in ``rows``, side by side, microseconds per call (log scale) per
    backend with the floor (dotted), and the speedup over ``op.baseline`` (above 1 is faster) with the compute
    alone as its ceiling (dashed). Shapes from the least work per call to the most."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit('--plot needs matplotlib: pip install -e ".[plot]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r.world_size for r in rows})
    # One world size: its two panels side by side; several: a column each, time above speedup.
    grid = (1, 2) if len(sizes) == 1 else (2, len(sizes))
    fig, axes = plt.subplots(*grid, figsize=(6.5 * grid[1], 4.8 * grid[0]), squeeze=False)
    columns = [(axes[0][0], axes[0][1])] if len(sizes) == 1 else [(axes[0][i], axes[1][i]) for i in range(len(sizes))]
    for world_size, (left, right) in zip(sizes, columns):
        _panels(op, [r for r in rows if r.world_size == world_size], backends, left, right)
    meta = rows[0].meta
    commits = ", ".join(dict.fromkeys(str(r.meta.get("commit", provenance.UNKNOWN)) for r in rows))
    fig.suptitle(f"{op.name}, world size {', '.join(map(str, sizes))}, {rows[0].mode}, {rows[0].dtype} "
                 f"({meta.get('gpu', provenance.UNKNOWN)}, commit {commits})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _panels(op: registry.Op, rows: list[harness.Row], backends: list[str], left, right) -> None:
    """One world size's two panels: time per call, and speedup over the baseline with its ceiling."""
    shapes = harness.texts_by_work(op, list(dict.fromkeys(r.shape for r in rows)), rows[0].dtype)
    us = {(r.backend, r.shape): r.us for r in rows if r.status == "ok" and r.us is not None}
    floor = {r.shape: r.floor_us for r in rows if r.floor_us is not None}
    for backend in backends:
        alone = backend in op.reference_free
        style = {"color": color(backend), "marker": None if alone else "o", "linestyle": "--" if alone else "-"}
        points = [(i, us[(backend, s)]) for i, s in enumerate(shapes) if (backend, s) in us]
        if points:
            left.plot(*zip(*points), label=f"{backend} (compute alone)" if alone else backend, **style)
        faster = [(i, harness.speedup(us[(op.baseline, s)], us[(backend, s)])) for i, s in enumerate(shapes)
                  if backend != op.baseline and (backend, s) in us and (op.baseline, s) in us]
        if faster:
            right.plot(*zip(*faster), label=f"ceiling: {backend} alone" if alone else backend, **style)
    if floor:
        left.plot([i for i, s in enumerate(shapes) if s in floor], [floor[s] for s in shapes if s in floor],
                  color="0.4", linestyle=":", label="floor")
    left.set_yscale("log")
    left.set_ylabel("us per call (slowest rank's median)")
    left.set_title(f"world size {rows[0].world_size}: time per call", fontsize=10)
    right.axhline(1.0, color="grey", linewidth=1)
    right.set_ylabel(f"speedup over {op.baseline} (>1 is faster)")
    right.set_title(f"world size {rows[0].world_size}: speedup over {op.baseline}", fontsize=10)
    for axis in (left, right):
        axis.set_xticks(range(len(shapes)), shapes, rotation=45, ha="right", fontsize=8)
        axis.set_xlabel(f"{op.shape_format} (by work per call)")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
