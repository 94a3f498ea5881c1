"""Symmetric memory on the host: what a kernel needs to reach a buffer on every rank, and kraken's cached
symmetric and local buffers.

* ``symm_empty`` allocates a symmetric tensor and rendezvouses it; ``symm_context`` turns a symmetric
  tensor into a ``SymmContext`` (rank, world size, the peer-buffer tuple, the signal-pad pointer array),
  cached so the per-call cost is a dictionary lookup; ``is_symmetric`` tells one apart from an ordinary
  tensor without a collective. The first time a buffer is seen, the ranks exchange its shape and dtype once.
* ``symm_workspace``: one shared symmetric scratch buffer per (device, dtype, group), where ordinary
  tensors are staged; ``block_workspace``: the block-owned, double-buffered workspace of kernels with no
  trailing barrier (``BlockWorkspace``).
* local buffers: ``local_barrier_pads`` (a barrier between blocks of one GPU) and ``local_scratch``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
import math

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from kraken.runtime import agreement, groups
from kraken.runtime.timeout import arm_barrier_timeout


@dataclass(frozen=True)
class SymmContext:
    """What a kernel needs to reach a symmetric tensor on every rank."""

    rank: int
    world_size: int
    group_name: str
    peers: tuple[torch.Tensor, ...]  # peers[r]: rank r's copy, same shape and dtype (peers[rank] is local)
    signal_pad_ptrs: int  # device address of uint64[world_size]: every rank's signal pad


_contexts: dict[tuple, SymmContext] = {}


def symm_context(
    tensor: torch.Tensor, group: dist.ProcessGroup | str | None, op: str, name: str = "tensor"
) -> SymmContext:
    """Validate the group and rendezvous ``tensor`` (a view into a symmetric allocation)."""
    arm_barrier_timeout()
    pg = groups.resolve_group(group, op)
    world_size = dist.get_world_size(pg)
    groups.check_world_size(world_size, op)
    key = (
        tensor.data_ptr(),
        tensor.untyped_storage()._cdata,
        tuple(tensor.shape),
        tensor.dtype,
        pg.group_name,
    )
    ctx = _contexts.get(key)
    if ctx is not None:
        return ctx
    agreement._agree((name, tuple(tensor.shape), str(tensor.dtype)), pg, op)
    try:
        handle = symm_mem.rendezvous(tensor, pg.group_name)
    except RuntimeError:
        handle = None  # older torch raises; torch 2.11 warns and returns None
    if handle is None:
        raise ValueError(
            f"{op}: {name} is not in symmetric memory; allocate it with kraken.symm_empty(...) "
            "(or torch.distributed._symmetric_memory.empty)"
        )
    rank = handle.rank
    offset_bytes = tensor.data_ptr() - handle.buffer_ptrs[rank]
    offset = offset_bytes // tensor.element_size()
    if offset_bytes < 0 or tensor.data_ptr() + tensor.numel() * tensor.element_size() > (
        handle.buffer_ptrs[rank] + handle.buffer_size
    ):
        raise ValueError(f"{op}: {name} does not lie inside its symmetric allocation")
    peers = tuple(
        tensor if r == rank else handle.get_buffer(r, tuple(tensor.shape), tensor.dtype, offset)
        for r in range(world_size)
    )
    ctx = SymmContext(rank, world_size, pg.group_name, peers, handle.signal_pad_ptrs_dev)
    _contexts[key] = ctx
    return ctx


def symm_empty(
    shape: int | tuple[int, ...],
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | int | None = None,
    group: dist.ProcessGroup | str | None = None,
) -> torch.Tensor:
    """A tensor in symmetric memory, already rendezvoused with ``group`` (collective)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    tensor = symm_mem.empty(shape, dtype=dtype, device=device)
    symm_context(tensor, group, "symm_empty")
    return tensor


_workspaces: dict[tuple, torch.Tensor] = {}


def symm_workspace(
    numel: int, dtype: torch.dtype, device: torch.device, group: dist.ProcessGroup | str | None, op: str
) -> torch.Tensor:
    """A cached symmetric scratch buffer of at least ``numel`` elements (collective on first use).

    Kernels that take ordinary tensors stage them here. One workspace per
    (device, dtype, group); it grows by powers of two and is shared by all ops.
    The first request of each size is checked across ranks *before* the buffer
    may grow: growing is a collective, and a rank that grows alone would hang.
    """
    pg = groups.resolve_group(group, op)
    agreement.agree_once(("workspace elements", numel, str(dtype)), pg, op)
    key = (device, dtype, pg.group_name)
    buf = _workspaces.get(key)
    if buf is None or buf.numel() < numel:
        size = 1 << max(12, math.ceil(math.log2(max(numel, 1))))
        buf = symm_empty(size, dtype, device, pg)
        _workspaces[key] = buf
    return buf[:numel]


_symmetric_storages: tuple[int, frozenset] = (0, frozenset())  # (len(_contexts) when built, their storages)


def is_symmetric(tensor: object) -> bool:
    """Whether ``tensor`` lies in a symmetric allocation that ``symm_context`` has rendezvoused (every
    ``symm_empty`` tensor, and any view of one a recipe took before): a storage lookup, about 0.3 us, no
    collective. A symmetric tensor that torch allocated and no recipe has seen yet reads False; a recipe
    then stages it as it stages an ordinary tensor (correct, one copy more). The storages stay alive
    (``_contexts`` holds them), so their ids are never reused by an ordinary tensor's."""
    global _symmetric_storages
    built, storages = _symmetric_storages
    if built != len(_contexts):
        storages = frozenset(key[1] for key in _contexts)
        _symmetric_storages = (len(_contexts), storages)
    return isinstance(tensor, torch.Tensor) and tensor.untyped_storage()._cdata in storages


# ---------------------------------------------------------------------------
# Block-owned, double-buffered symmetric workspace (kernels with no trailing barrier)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockWorkspace:
    """A symmetric buffer cut into two halves of ``num_chunks`` chunks of ``chunk_bytes`` each.

    Block ``b`` of a kernel only ever writes chunk ``b`` of half ``parity[b]`` (its
    own, or every rank's when it pushes) and flips ``parity[b]`` when it finishes;
    a chunk is read only by block ``b`` of a rank. A launch therefore writes the half
    that the previous launch of block ``b`` did not, and the launch before that is
    finished on every rank: each launch passes at least one barrier with every peer,
    and a peer's kernel starts only after its previous one ended. No "done reading"
    barrier at the end of a kernel, whatever the shapes and grids of the launches in
    between.

    The buffer's signal pad belongs to ``epoch_sync`` alone: block ``b``'s barrier
    rounds are numbered ``epochs[b] + 1, + 2, ...`` and the block adds its rounds to
    ``epochs[b]`` when it finishes (every rank runs block ``b`` the same rounds).
    """

    flat: SymmContext  # peers: every rank's whole buffer, uint8
    parity: torch.Tensor  # int32[>= num_chunks: a block id of the pad each], local; which half block b writes next
    epochs: torch.Tensor  # int32[>= num_chunks], local; barrier rounds block b has completed
    num_chunks: int
    chunk_bytes: int

    _contexts: dict = field(default_factory=dict, compare=False, repr=False)

    def context(self, dtype: torch.dtype, tile: tuple[int, ...]) -> SymmContext:
        """The workspace as a kernel takes it: ``peers[r]`` is rank r's buffer viewed as
        [2, num_chunks, tiles per chunk, *tile] of ``dtype`` (strided: chunks keep their byte size)."""
        key = (dtype, tile)
        if key not in self._contexts:
            tile_elems = math.prod(tile)
            chunk_elems = self.chunk_bytes // dtype.itemsize
            shape = (2, self.num_chunks, chunk_elems // tile_elems, *tile)
            tile_strides = tuple(math.prod(tile[i + 1:]) for i in range(len(tile)))
            strides = (self.num_chunks * chunk_elems, chunk_elems, tile_elems, *tile_strides)
            peers = tuple(p.view(dtype).as_strided(shape, strides) for p in self.flat.peers)
            self._contexts[key] = replace(self.flat, peers=peers)
        return self._contexts[key]


_block_workspaces: dict[tuple, BlockWorkspace] = {}
_retired: list[BlockWorkspace] = []  # outgrown buffers: a peer may still be reading one, so never freed


def block_workspace(
    chunk_bytes: int, device: torch.device, group: dist.ProcessGroup | str | None, op: str
) -> BlockWorkspace:
    """The cached ``BlockWorkspace`` of (device, group), with chunks of at least ``chunk_bytes`` (collective
    when it grows; each new request size is first checked across ranks, as in ``symm_workspace``)."""
    pg = groups.resolve_group(group, op)
    key = (device, pg.group_name)
    ws = _block_workspaces.get(key)
    if ws is not None and ws.chunk_bytes >= chunk_bytes:
        return ws
    agreement.agree_once(("block workspace bytes", chunk_bytes), pg, op)
    num_chunks = torch.cuda.get_device_properties(device).multi_processor_count
    # Parity and epoch for every block id the pad has (more than chunks in a group of one, where a kernel may run
    # more blocks than SMs, each touching no chunk: gemm_one_shot_all_reduce's one tile per block).
    num_ids = max(num_chunks, groups.max_barrier_blocks(pg.size()))
    size = 1 << max(16, math.ceil(math.log2(chunk_bytes)))
    if ws is not None:
        _retired.append(ws)
        size = max(size, 2 * ws.chunk_bytes)
    buf = symm_mem.empty(2 * num_chunks * size, dtype=torch.uint8, device=device)
    parity = torch.zeros(num_ids, dtype=torch.int32, device=device)
    epochs = torch.zeros(num_ids, dtype=torch.int32, device=device)  # the new pad's slots are all 0
    ws = BlockWorkspace(symm_context(buf, pg, op, name="block workspace"), parity, epochs, num_chunks, size)
    _block_workspaces[key] = ws
    return ws


_local_pads: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def local_barrier_pads(device: torch.device) -> int:
    """Signal pads for a barrier between blocks of one GPU, as ``symm_mem_sync`` takes them.

    ``symm_mem_sync(pads, group, party, parties)`` then synchronises ``parties``
    (<= 8) blocks of the same launch on this GPU, ``group`` < the SM count: the
    same CAS slots and self-resetting protocol as the cross-GPU barrier, with
    "party" in the role of rank. Returns the device address of the pointer array.
    """
    if device not in _local_pads:
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        pads = torch.zeros(groups.MAX_WORLD_SIZE, num_sms * groups.MAX_WORLD_SIZE, dtype=torch.int32, device=device)
        ptrs = torch.tensor([row.data_ptr() for row in pads], dtype=torch.int64, device=device)
        _local_pads[device] = (pads, ptrs)
    return _local_pads[device][1].data_ptr()


_scratch: dict[tuple, torch.Tensor] = {}


def local_scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached uninitialised local tensor of ``shape`` (one per device and dtype; grows, never shrinks)."""
    numel = math.prod(shape)
    buf = _scratch.get((device, dtype))
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _scratch[(device, dtype)] = buf
    return buf[:numel].view(shape)
