"""Context-parallel attention's product layer, wrapped around its recipe from outside.

The recipe (``kraken/fused/context_parallel_attention.py``) holds the kernels, the sequence layout, the pure ``plan``
and tile orders, the kernels' launch seam ``launch_attention`` and a plain host function. What the installed
``kraken.context_parallel_attention`` adds lives here:

* the checks of a call's arguments (``attention_checks``), agreed across ranks on the first call of each signature
  (``agreement.agreed``);
* ``prepare`` (kept per call signature, ``prepared.per_signature``): the plan, the symmetric gather buffer (a slice of
  ``symm.symm_workspace``) and its context, the flags, a ``Launcher``;
* the K/V exchange on the copy engine (``start_kv_gather``, the machinery of ``kraken.runtime.progress``:
  a side stream, one-block barrier kernels, flags written by stream memory operations), which the attention kernels
  overlap, waiting on each piece's flag (the recipe's module docstring);
* the tile orders, lse buffers, flags and (for the Helion twin) span tables, kept per shape (``launch_attention``'s
  ``tables`` is this module): a kept CUDA graph holds their addresses, so a cache that starts over drops every graph;
* ``attention_on_gathered``: the same kernels on K/V that are all here already (no exchange, no flag waits);
* a warm call allocates its output and queues the exchange and the kernels through the launcher: from the second call
  with the same pointers, as one CUDA graph launch (``graphs.graphed``; docs/design.md, "The host fast path").

``context_parallel_attention_with`` / ``attention_on_gathered_with`` build the public functions around an
``attention`` (the recipe's ``launch_attention``, or the Helion twin's: ``kraken.runtime.twins``).
"""

from __future__ import annotations

import importlib
import math
import sys

import torch
import torch.distributed as dist

from kraken.runtime.progress import (
    LANDED, GatherInProgress, barrier, copy_order, copy_stream, fork, on_stream, reset_flags, set_flag,
)
from kraken.runtime import agreement, graphs, groups, prepared, replay, symm
from kraken.runtime.attention_checks import check_gathered, check_inputs, check_sizes
from kraken.runtime.launcher import Launcher, jit_launch

# The recipe's module: its ``plan`` called through it (tests replace it there), its pure orders behind the caches below.
CP = importlib.import_module("kraken.fused.context_parallel_attention")
OP = CP.OP


# ---------------------------------------------------------------------------
# The tables a launch reads, kept per shape (``launch_attention``'s ``tables``: this module)
# ---------------------------------------------------------------------------

_orders: dict = {}
_lse: dict = {}
_spans: dict = {}
_flags: dict[tuple, torch.Tensor] = {}


def _room(cache: dict) -> None:
    """Before a new entry: a full cache starts over, once no kept graph can read what it held."""
    if len(cache) >= prepared.MAX_PREPARED:
        graphs.drop_graphs()  # (a kept graph may read or write the tensors dropped here)
        cache.clear()


def tile_order(query_rows: int, group: int, s_local: int, causal: bool, block_m: int, piece_rows: int,
               device, blocks: int = 0) -> torch.Tensor:
    """The recipe's ``tile_order``, built once per argument set (an int32 [tiles, 5] tensor on ``device``)."""
    key = (query_rows, group, s_local, causal, block_m, piece_rows, device, blocks)
    order = _orders.get(key)
    if order is None:
        _room(_orders)
        order = _orders[key] = CP.tile_order(query_rows, group, s_local, causal, block_m, piece_rows, device, blocks)
    return order


def full_order(batch: int, heads: int, kv_heads: int, s_local: int, causal: bool, block_m: int, piece_rows: int,
               world_size: int, grid: int, device, rank: int = 0, block_n: int = 128) -> torch.Tensor:
    """The recipe's ``full_order`` (the warp-specialized kernel's), built once per argument set."""
    key = ("full", batch, heads, kv_heads, s_local, causal, block_m, piece_rows, world_size, grid, device, rank,
           block_n)
    order = _orders.get(key)
    if order is None:
        _room(_orders)
        order = _orders[key] = CP.full_order(batch, heads, kv_heads, s_local, causal, block_m, piece_rows, world_size,
                                             grid, device, rank, block_n)
    return order


def lse_buffer(rows: int, device) -> torch.Tensor:
    """fp32 [rows]: the split's log2-sum-exp2 per query row (cached per size and device, as ``progress_flags``: the
    two kernels use it in stream order)."""
    key = (rows, device)
    if key not in _lse:
        _room(_lse)
        _lse[key] = CP.lse_buffer(rows, device)
    return _lse[key]


def spans(chunk: int, block_n: int, kv_block: int, rank: int, world_size: int, pieces: int, device) -> torch.Tensor:
    """The Helion twin's ``spans`` table (the sizes its key loops meet), built once per argument set."""
    key = (chunk, block_n, kv_block, rank, world_size, pieces, device)
    table = _spans.get(key)
    if table is None:
        twin = importlib.import_module("helion_ports.fused.context_parallel_attention")  # (loaded: it asked)
        _room(_spans)
        table = _spans[key] = twin.spans(chunk, block_n, kv_block, rank, world_size, pieces, device)
    return table


def progress_flags(count: int, device: torch.device) -> torch.Tensor:
    """The flags of one launch, one per (rank, piece), and its count of tiles taken (cached; zeroed by every launch
    before its gather)."""
    key = (device, count)
    if key not in _flags:
        _flags[key] = torch.zeros(count, dtype=torch.int32, device=device)
    return _flags[key]


TABLES = sys.modules[__name__]  # what ``launch_attention`` reads its orders and buffers from here


# ---------------------------------------------------------------------------
# The K/V exchange on the copy engine
# ---------------------------------------------------------------------------

_exchange_plans: dict = {}


def exchange_plan(peers, gathered, rank: int, piece_rows: int, pieces: int) -> tuple:
    """(the order of ranks, my K and V chunks, and per (piece, peer), piece-major and rank + 1 first, its flag's index
    and its two (destination, source) copies: K, then V, each contiguous, for the copy engine rather than a strided
    copy kernel). Views of the prepared call's buffers, kept per (``peers``, ``gathered``, ...) as
    ``kraken._blocks.helion.views`` keeps its views (the objects are kept with them, so their ids stay theirs): each
    view costs about a microsecond, and a call makes four per piece and peer."""
    key = (id(peers), id(gathered), rank, piece_rows, pieces)
    hit = _exchange_plans.get(key)
    if hit is None or hit[0] is not peers or hit[1] is not gathered:
        world_size, kv_rows = len(peers), peers[rank].shape[1]
        order = copy_order(rank, world_size)
        rows = [(p * piece_rows, min((p + 1) * piece_rows, kv_rows)) for p in range(pieces)]
        copies = tuple((src * pieces + p, tuple((gathered[src, kv, begin:end], peers[src][kv, begin:end])
                                                for kv in (0, 1)))
                       for p, (begin, end) in enumerate(rows) for src in order[1:])
        if len(_exchange_plans) >= prepared.MAX_PREPARED:  # as many as the prepared calls it serves (a bound)
            _exchange_plans.clear()
        hit = _exchange_plans[key] = (peers, gathered, (order, peers[rank][0], peers[rank][1], copies))
    return hit[2]


def stage_own(k: torch.Tensor, v: torch.Tensor, my_k: torch.Tensor, my_v: torch.Tensor) -> None:
    """My ``k`` and ``v`` into my chunk of the gather buffer (``my_k``, ``my_v``: its [batch * kv_heads, S_local,
    head_dim] halves), on the current stream: the kernel reads every rank's K/V, mine too, from the buffer."""
    my_k.copy_(k.view(my_k.shape))
    my_v.copy_(v.view(my_v.shape))


def start_kv_gather(k, v, peers, gathered, progress, signal_pad_ptrs: int, rank: int, piece_rows: int,
                    pieces: int, launcher=jit_launch, graphed: bool = False) -> GatherInProgress:
    """Stage my ``k``, ``v`` into my chunk of the symmetric ``gathered`` and copy every peer's K/V into ``gathered`` on
    the copy engine, piece by piece, flagging each (the recipe's module docstring). ``peers[r]``: rank r's own chunk
    [2, batch * kv_heads, S_local, head_dim] of rank r's gather buffer. ``launcher`` launches the barrier kernels.
    ``graphed``: the exchange after my staging (``exchange``, which reads the prepared call's buffers alone) is one
    CUDA graph per prepared call (``graphs.graphed``, keyed by ``launcher``), whatever addresses ``k``, ``v`` have."""
    world_size = len(peers)
    order, my_k, my_v, copies = exchange_plan(peers, gathered, rank, piece_rows, pieces)
    side = copy_stream(k.device)
    reset_flags(progress)  # before the fork: no flag of the previous call survives into this one
    # My K/V into my chunk, on the current stream (after the previous call's closing barrier, which the current
    # stream joined): the attention kernel reads them there in stream order, the peers after the first barrier.
    if world_size > 1:  # (at one rank the kernels read my ``k`` and ``v`` where they are)
        stage_own(k, v, my_k, my_v)
    fork(side)
    with on_stream(side):
        if graphed:
            graphs.graphed((("kv gather", launcher),),
                           lambda: exchange(copies, progress, signal_pad_ptrs, rank, world_size, launcher), k.device)
        else:
            exchange(copies, progress, signal_pad_ptrs, rank, world_size, launcher)
    return GatherInProgress(gathered, progress, side, order)


def exchange(copies: tuple, progress: torch.Tensor, signal_pad_ptrs: int, rank: int, world_size: int,
             launcher) -> None:
    """The exchange once my K/V are staged, on the side stream: a barrier, each piece's ``copies`` (``exchange_plan``)
    and its flag, a barrier. It reads and writes the prepared call's buffers alone."""
    barrier(signal_pad_ptrs, rank, world_size, launcher)  # every rank's K/V is staged
    for flag, piece in copies:  # piece by piece; within a piece rank + 1 first
        for dst, src in piece:
            dst.copy_(src)
        set_flag(progress, flag, LANDED)
    barrier(signal_pad_ptrs, rank, world_size, launcher)  # done reading: peers may stage into their buffers again


def launch(q, k, v, peers, gathered, out, progress, signal_pad_ptrs: int, rank: int, causal: bool, scale,
           block_m: int, block_n: int, num_warps: int, num_stages: int, maxnreg: int | None, piece_rows: int,
           pieces: int, num_blocks: int, split_blocks: int, group_name: str = "", launcher=jit_launch,
           attention=None) -> torch.Tensor:
    """Launch on prepared arguments (no checks): the K/V exchange, then the attention kernels, ``attention`` (the
    recipe's ``launch_attention`` by default; the Helion twin's alike), waiting on the flags; then the join."""
    started = start_kv_gather(k, v, peers, gathered, progress, signal_pad_ptrs, rank, piece_rows, pieces, launcher)
    (attention or CP.launch_attention)(q, k, v, gathered, out, progress, rank, len(peers), causal, scale, True,
                                       block_m, block_n, num_warps, num_stages, maxnreg, piece_rows, pieces,
                                       num_blocks, split_blocks, launcher, TABLES)
    started.wait()
    return out


def in_pieces(q, k, v, out, ctx: symm.SymmContext, cfg: dict, causal: bool, scale, attention=None) -> None:
    """``launch`` in pieces that new addresses do not change: a model's layers call with fresh activations, so a graph
    per address set would be captured for one replay a step. Of the exchange only my K/V's staging reads this call's
    addresses; the rest (``exchange``: the barriers, the peers' pieces and their flags) reads the prepared call's
    buffers alone, so it is one CUDA graph per prepared call, replayed on the side stream (``start_kv_gather``'s
    ``graphed``). The attention kernels are one replayed launch (``replay.replayed``) on (q, k, v, out), with the
    prepared call's buffers and the tables' tensors kept. The order is ``launch``'s: the flags reset, my K/V staged, the
    fork, the exchange, the kernels (waiting on its flags), the join."""
    peers, gathered, progress, launcher = cfg["peers"], cfg["gathered"], cfg["progress"], cfg["launcher"]
    rank, world_size = ctx.rank, len(peers)
    attention = attention or CP.launch_attention
    started = None
    if world_size > 1:
        started = start_kv_gather(k, v, peers, gathered, progress, ctx.signal_pad_ptrs, rank, cfg["piece_rows"],
                                  cfg["pieces"], launcher, graphed=True)
    else:  # the kernels read my ``k`` and ``v`` where they are: nothing to exchange, only the flags to reset
        reset_flags(progress)

    def kernels() -> torch.Tensor:
        return attention(q, k, v, gathered, out, progress, rank, world_size, causal, scale, True, cfg["block_m"],
                         cfg["block_n"], cfg["num_warps"], cfg["num_stages"], cfg["maxnreg"], cfg["piece_rows"],
                         cfg["pieces"], cfg["num_blocks"], cfg["split_blocks"], launcher, TABLES)

    # The first call makes the tables (tile orders, lse buffer), the second records the replay with them kept.
    replay.replayed(launcher, attention, (q, k, v, out), kernels, (cfg, _orders, _lse, _spans), plain_first=True)
    if started is not None:
        started.wait()


# ---------------------------------------------------------------------------
# Prepared calls and the public functions
# ---------------------------------------------------------------------------


@prepared.per_signature(lambda q, k, v, group, op, causal, scale, config: (
    op, group, prepared.tensor_key(q), prepared.tensor_key(k), prepared.tensor_key(v), prepared.scalar_key(causal),
    prepared.scalar_key(scale), prepared.config_key(config)))
def prepare(q, k, v, group, op: str, causal: bool, scale, config: dict) -> tuple[symm.SymmContext, dict]:
    """Validate, plan, and find the buffers: the context of the symmetric gather buffer (a slice of
    ``symm.symm_workspace``) and the launch arguments but the output (every rank's own chunk of the buffer as
    ``peers``, ``gathered``, ``progress``, the plan, the ``launcher``); kept per signature."""
    # Local checks; the first call of each signature also agrees on them (and on the shapes) across ranks.
    with agreement.agreed(op, group, q=q, k=k, v=v, causal=causal, scale=scale, config=config):
        check_inputs(q, k, v, causal, scale, op)  # (the device last: a CUDA tensor from here on)
        world_size = groups.world_size_of(group, op)
        check_sizes(q, k, world_size, op)
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        batch, heads, s_local, head_dim = q.shape
        cfg = CP.plan(batch, heads, k.shape[1], s_local, head_dim, world_size, causal, config, num_sms)
    pg = groups.resolve_group(group, op)
    shape = (world_size, 2, k.shape[0] * k.shape[1], k.shape[2], k.shape[3])
    gathered = symm.symm_workspace(math.prod(shape), k.dtype, k.device, pg, op).view(shape)
    ctx = symm.symm_context(gathered, pg, op, name="K/V gather buffer")
    progress = progress_flags(CP.progress_size(world_size, cfg["pieces"]), q.device)
    peers = tuple(p[r] for r, p in enumerate(ctx.peers))  # rank r's own chunk of rank r's buffer
    return ctx, {"peers": peers, "gathered": gathered, "progress": progress, **cfg, "launcher": Launcher(op)}


def attend_to_sequence(q, k, v, group, causal: bool, scale, config: dict, op: str = OP,
                       attention=None) -> torch.Tensor:
    """The installed ``context_parallel_attention`` of the recipe (``attention`` None) or of the Helion twin (its op
    name and its ``launch_attention``): the prepared call, a new output, the launch: the flags' reset, the fork, the
    exchange, the attention kernels and the join, replayed from one CUDA graph per pointer set (``graphs.graphed``)."""
    ctx, cfg = prepare(q, k, v, group, op, causal, scale, config)
    out = torch.empty_like(q)
    graphs.graphed((cfg["launcher"], q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()),
                   lambda: in_pieces(q, k, v, out, ctx, cfg, causal, scale, attention), q.device)
    return out


@prepared.per_signature(lambda q, k, v, gathered, rank, op, causal, scale, config: (
    op, prepared.tensor_key(q), prepared.tensor_key(k), prepared.tensor_key(v), prepared.tensor_key(gathered), rank,
    prepared.scalar_key(causal), prepared.scalar_key(scale), prepared.config_key(config)))
def prepare_on_gathered(q, k, v, gathered, rank: int, op: str, causal: bool, scale,
                        config: dict) -> tuple[dict, torch.Tensor, Launcher]:
    """``attention_on_gathered``'s checks and plan, its (never read) flags and its launcher; kept per signature."""
    check_inputs(q, k, v, causal, scale, op)
    check_gathered(gathered, k, rank, op)
    world_size = gathered.shape[0]
    check_sizes(q, k, world_size, op)
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    batch, heads, s_local, head_dim = q.shape
    cfg = CP.plan(batch, heads, k.shape[1], s_local, head_dim, world_size, causal, config, num_sms)
    return cfg, progress_flags(CP.progress_size(world_size, cfg["pieces"]), q.device), Launcher(op)


def on_gathered(q, k, v, gathered, rank: int, causal: bool, scale, config: dict, op: str = OP,
                attention=None) -> torch.Tensor:
    """``attention_on_gathered`` of the recipe (``attention`` None) or of the Helion twin: the flags' reset, my K/V
    staged, the attention kernels, replayed from one CUDA graph per pointer set (``graphs.graphed``)."""
    cfg, progress, launcher = prepare_on_gathered(q, k, v, gathered, rank, op, causal, scale, config)
    out = torch.empty_like(q)

    def run() -> None:
        reset_flags(progress)  # no flag is read here, but the causal kernels' count of tiles taken starts at 0
        if gathered.shape[0] > 1:  # the warp-specialized kernels read my K/V there (at one rank from ``k`` and ``v``)
            stage_own(k, v, gathered[rank, 0], gathered[rank, 1])
        (attention or CP.launch_attention)(q, k, v, gathered, out, progress, rank, gathered.shape[0], causal, scale,
                                           False, **cfg, launcher=launcher, tables=TABLES)

    graphs.graphed((launcher, q.data_ptr(), k.data_ptr(), v.data_ptr(), gathered.data_ptr(), out.data_ptr()), run,
                   q.device)
    return out


def context_parallel_attention_with(attention, op: str):
    """The installed context-parallel attention, driving ``attention``: None for the recipe's ``launch_attention``
    (``kraken.context_parallel_attention``), or the Helion twin's (``helion_ports.context_parallel_attention``)."""

    def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   group: dist.ProcessGroup | str | None = None, causal: bool = False,
                                   scale: float | None = None, **config) -> torch.Tensor:
        """This rank's [batch, heads, S_local, head_dim] output of attention over the whole sequence.

        ``q`` [batch, heads, S_local, head_dim], ``k``, ``v`` [batch, kv_heads, S_local, head_dim]: this rank's
        shard of the sequence (``shard_sequence``; with ``causal``, the load-balanced layout), contiguous CUDA
        tensors, bf16 or fp16, head_dim 64 or 128, kv_heads dividing heads, the same shapes on every rank.
        ``scale`` defaults to 1 / sqrt(head_dim). ``config`` overrides ``block_m``, ``block_n``, ``num_warps``,
        ``num_stages``, ``blocks_per_sm``, ``pieces`` and ``max_blocks`` (see the recipe's ``plan``; without
        ``causal`` the tiles are limited to ``FULL_CHOICES``).
        """
        return attend_to_sequence(q, k, v, group, causal, scale, config, op, attention)

    return context_parallel_attention


def attention_on_gathered_with(attention, op: str):
    """``attention_on_gathered`` driving ``attention`` (as ``context_parallel_attention_with``)."""

    def attention_on_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gathered: torch.Tensor, rank: int,
                              causal: bool = False, scale: float | None = None, **config) -> torch.Tensor:
        """The same attention kernels with every rank's K/V here already: no communication, no flag waits.

        ``gathered`` [world_size, 2, batch * kv_heads, S_local, head_dim]: rank r's k and v at ``[r, 0]`` and
        ``[r, 1]`` (any memory; with two or more ranks ``[rank]`` is overwritten with ``k`` and ``v``, which the
        warp-specialized kernel reads there; the causal kernel reads them from ``k`` and ``v``). Also attention on
        one GPU (world size 1: ``gathered`` [1, ...], the whole sequence in order, causal or not; not read: the
        kernels read ``k`` and ``v`` in place). No process group.
        """
        return on_gathered(q, k, v, gathered, rank, causal, scale, config, op, attention)

    return attention_on_gathered


context_parallel_attention = context_parallel_attention_with(None, OP)
attention_on_gathered = attention_on_gathered_with(None, OP)
