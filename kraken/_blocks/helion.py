"""What the Helion twins share: a kernel with one explicit config, the staging copy, views, and ``run``.

A twin (``helion_ports/<family>/<name>.py``) imports from the project only this, ``kraken._ptx_utils`` (the barrier
source for ``hl.inline_triton``) and ``kraken._gemm_core``, so it can be copied out with them.

Every twin's ``helion.Config`` says ``pid_type="flat"``: ``hl.grid(num_blocks)`` then launches
exactly the recipe's ``num_blocks`` programs, and the grid index is the barrier's block id. Left to
itself, Helion 1.5 picks a persistent pid type for kernels with symmetric-memory arguments: one
program per SM, all but ``num_blocks`` of them idle. An explicit ``pid_type`` is honoured.
"""

from __future__ import annotations

import functools
import warnings

import helion
import helion.language as hl
import torch


# Helion 1.5.0 warns on every compile of a kernel with a symmetric-memory argument that the signal pad
# caps its autotuner's ``max_num_sm_multiplier``. The twins never autotune (one explicit config each,
# ``pid_type="flat"``), so that warning, and only that one, is silenced; every other warning stays.
HELION_AUTOTUNER_CAP_WARNING = r"max_num_sm_multipler is reduced from"
warnings.filterwarnings("ignore", message=HELION_AUTOTUNER_CAP_WARNING, category=UserWarning)


@functools.cache
def flat_kernel(body, block_sizes: tuple[int, ...], num_warps: int, num_stages: int = 1, **settings) -> helion.Kernel:
    """``body`` as a Helion kernel with one explicit config: the given block sizes (in loop order),
    warps and stages, ``pid_type="flat"`` (above) and ``static_shapes=False``; ``settings`` are further
    ``helion.Config`` keys (tuples stand for lists, to stay hashable). Cached per config."""
    settings = {key: list(value) if isinstance(value, tuple) else value for key, value in settings.items()}
    config = helion.Config(
        block_sizes=list(block_sizes), num_warps=num_warps, num_stages=num_stages, pid_type="flat", **settings
    )
    return helion.kernel(body, config=config, static_shapes=False)


def copy_body(dst: torch.Tensor, src: torch.Tensor, group_name: hl.ProcessGroupName) -> None:
    """``dst = src[:n]`` for flat tensors of one dtype, ``n = dst.size(0)``. One of them lies in symmetric memory,
    which makes it a distributed kernel to Helion: it takes the group's name, as the twins do.

    The loop runs over ``dst``'s own size: Helion 1.5.0 specialises a size of 1 and treats such a tensor, indexed
    by a tile of another extent, as broadcast, so a one-element ``dst`` under a loop over ``src.size(0)`` got a store
    from every lane of the block with no mask (the masked-off lanes' zeros racing the element: a one-element
    collective on an ordinary tensor returned 0). A broadcast load of a one-element ``src`` is harmless (docs/helion-
    notes.md)."""
    for tile in hl.tile(dst.size(0)):
        dst[tile] = src[tile]


COPY_CONFIG = ((4096,), 4)  # (block sizes, warps) of ``copy_into``'s kernel: one 4096-element tile per program


def copy_into(dst: torch.Tensor, src: torch.Tensor, group_name: str, launcher=None) -> None:
    """``dst``'s first ``src.numel()`` elements = ``src`` (contiguous tensors of one dtype), as a Helion kernel
    launched through ``launcher`` (``run``). The twins stage an ordinary input into their workspace with it, and
    the two-shot twin copies its sum back, so that the installed package can replay a staged twin's whole call
    from the call's addresses: an ATen ``copy_`` there would be an op a replay does not repeat, and such a call
    would run its host code every time."""
    dst = flat_view(dst)
    if dst.size(0) != src.numel():
        dst = dst[:src.numel()]
    run(flat_kernel(copy_body, *COPY_CONFIG), (dst, flat_view(src), group_name), launcher)


def stage(peers: tuple[torch.Tensor, ...], rank: int, x: torch.Tensor, group_name: str, launcher=None
          ) -> None:
    """A twin's staging: ``x`` copied into this rank's workspace (``peers[rank]``) by a copy launch before the
    twin's kernel, whose first barrier needs no release then (the copy finished before it started, as any input
    written earlier on the stream)."""
    copy_into(peers[rank], x, group_name, launcher)


def own_storage(local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's symmetric buffer) as a tensor with a storage object of its own: the
    same memory, wrapped through DLPack once and kept on ``local`` (freed with it).

    Twins that stage into their own buffer (``workspace``), meet the peers at the barrier, then read
    every rank's buffer (``peers[r]``), or push into every rank's buffer and then read their own, pass
    ``workspace`` through this. Helion 1.5.0 inserts a CTA
    barrier before a load from storage that the same kernel stored to earlier, and it cannot see the
    ``bar.sync`` inside the ``hl.inline_triton`` barrier between them; so it put one before the
    ``peers[rank]`` load, on every iteration. ptxas then waits for the loads from ranks before
    ``rank`` before issuing those after it: a second NVLink round trip at world size 3 and up (the
    twins were 5-14% slower than their recipes at 4 GPUs). The cross-GPU barrier orders those
    accesses already (it has a ``bar.sync`` on each side), so nothing is lost.
    """
    alias = getattr(local, "_own_storage", None)
    if alias is None:
        alias = local._own_storage = torch.from_dlpack(local)
    return alias


_views: dict = {}


def flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.view(-1)``, or ``tensor`` itself when it is 1-D already: a view of a fresh output costs about a
    microsecond per call on the host, and a 1-D tensor is already what the flat kernel reads."""
    return tensor if tensor.dim() == 1 else tensor.view(-1)


def views(tensors: tuple[torch.Tensor, ...], shape, row: int | None = None) -> tuple[torch.Tensor, ...]:
    """``tuple(t.view(shape) for t in tensors)`` (with ``row``: ``t.view(shape)[row]``), kept per (tuple, shape,
    row): a twin views the same peer buffers (its prepared call's ``peers`` tuple) on every call, and each view
    costs about half a microsecond.

    A twin that pushes into one region of every peer's buffer takes that region as views of their own
    (``row``), not ``peers[r][row, ...]``: each tensor of a tuple gets its own stride parameters, so the
    latter adds ``peers[r].stride(0)`` per peer to a thread's offset, a register per peer live through the
    loop, and ptxas then held back a peer's load (see docs/helion-notes.md). A view's own base pointer
    costs no register, as the recipe's ``peers[r] + numel``."""
    key = (id(tensors), shape, row)
    hit = _views.get(key)
    if hit is None or hit[0] is not tensors:  # the tuple object is kept with its views, so its id stays its own
        viewed = (t.view(shape) for t in tensors)
        hit = _views[key] = (tensors, tuple(viewed if row is None else (v[row] for v in viewed)))
    return hit[1]




def run(kernel: helion.Kernel, args: tuple, launcher=None, kernel_args=None):
    """Call a twin's Helion kernel: ``kernel(*args)``, or ``kernel(*kernel_args(args))`` (then None: the twin holds
    its outputs). ``launcher`` is the seam the installed package's fast path uses: an object with a ``helion``
    method (a prepared call's ``Launcher``) runs the kernel through it (``kraken.runtime.helion_run``: its host
    code replayed); None, or a plain Triton launcher, calls the kernel as above.

    ``kernel_args``: for a kernel that takes views of what the twin holds (a flat view of a [tokens, hidden]
    tensor, a buffer shaped as regions), a function of ``args`` returning the kernel's arguments; a replay makes
    no view, it reads each address from ``args`` themselves."""
    through = getattr(launcher, "helion", None)
    if through is not None:
        return through(kernel, args, kernel_args)
    result = kernel(*(args if kernel_args is None else kernel_args(args)))
    return result if kernel_args is None else None
