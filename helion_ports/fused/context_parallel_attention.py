"""Helion twin of ``kraken.fused.context_parallel_attention``: same function, same arguments.

The K/V exchange is the recipe's (``start_kv_gather``: copy-engine copies, stream memory operations and
two one-block barrier kernels, all host code), and so are ``plan``, ``prepare`` (kept per signature, with
its ``host.Launcher``), the sequence layout helpers and the host side of ``launch`` (the recipe's, with this
kernel; it launches through ``helion_ports.run``). The attention kernel mirrors the recipe's one to one:

* ``hl.grid(num_blocks)`` is the persistent grid; block ``b`` takes query tiles ``b, b + num_blocks, ...``
  (``hl.grid(rounds)``; a round past the last tile does nothing), (batch, head)-major, under ``causal``
  the later half of the shard first. Not yet the recipe's dynamic schedule (a count of tiles taken, and
  ``tile_order``'s table): a tile index read from memory makes every tile loop's bounds device values, and
  Helion 1.5 then masks every key loop (docs/helion-notes.md);
* each query tile is a one-step ``hl.tile`` of ``block_m`` rows; the online-softmax state (row max, row
  sum, fp32 accumulator) lives across every key loop: ``hl.tile`` loops of ``block_n`` keys over my own
  K/V (from ``k``, ``v``), then, for ``rank + 1``, ``rank + 2``, ... (``hl.grid(world_size - 1)``), over the
  gather buffer; an unmasked loop over the full key tiles and a masked one for a chunk's last tile and
  the causal diagonal, as the recipe (the unmasked loops' extents are ``chunk_blocks * block_n``, which
  ``symbolic_multiples`` lets Helion see as whole tiles: no bounds mask on their row max and sum);
* before a peer's keys, a block's first tile of each piece waits on the piece's flag with the recipe's
  PTX (``GMEM_WAIT_ASYNC``: acquire spin by one thread, thread barrier, every thread's async-proxy
  fence), pasted in with ``hl.inline_triton``;
* q, k, v and the gather buffer load through host-built tensor descriptors (TMA), the output is stored
  through pointers, masked to the chunk's rows. The gather buffer comes in twice, the second view
  starting at its first V block, so that a K row and its V row have the same index (one tile, two
  loads: Helion loads a tile at an offset index through pointers, not TMA).

The config is explicit (``flat_kernel``): every tile loop names its block size (``block_m``, ``block_n``
from the recipe's ``plan``). Set ``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.
"""

from __future__ import annotations

import contextlib
import functools

import helion
from helion._compiler.compile_environment import CompileEnvironment
import helion.language as hl
import sympy
import torch
import torch.distributed as dist

from helion_ports import flat_kernel, run
from kraken import host
from kraken._ptx_utils.inline_source import GMEM_WAIT_ASYNC
from kraken.fused.context_parallel_attention import (  # noqa: F401 (shared with the recipe)
    OP,
    attend_to_sequence,
    launch as recipe_launch,
    on_gathered,
    plan,
    prepare,
    shard_sequence,
    softmax_scale,
    unshard_sequence,
)

# A masked key's score is the recipe's ``MASKED_SCORE`` (-1e30), written as a literal in the body: Helion reads a
# module constant used in device code as ``_source_module.NAME`` after ``import helion_ports.fused.
# context_parallel_attention as _source_module``, which finds the package's re-exported function of that name,
# not this module (docs/helion-notes.md).
# The flag (a pointer expression in the snippet): progress + index.
WAIT_FLAG = GMEM_WAIT_ASYNC.replace("{flag}", "{progress} + {index}")


def indexing(causal: bool) -> tuple[str, ...]:
    """Per load/store, in program order: q, then k and v of every key loop (own K/V: an unmasked and a masked
    loop per half; the peers' the same) through TMA, then the store to out through pointers."""
    halves = 2 if causal else 1
    return ("tensor_descriptor",) * (1 + 2 * 4 * halves) + ("pointer",)


def context_parallel_attention_body(
    q2: torch.Tensor,  # q as [batch * heads * S_local, head_dim]
    k2: torch.Tensor,  # my k as [batch * kv_heads * S_local, head_dim]
    v2: torch.Tensor,  # my v, the same
    kv_k: torch.Tensor,  # the gather buffer as rows [world_size * 2 * batch * kv_heads * S_local, head_dim]
    kv_v: torch.Tensor,  # the same buffer from its first V block: row i here is the V row of K row i of kv_k
    out2: torch.Tensor,  # [batch * heads * S_local, head_dim]
    progress: torch.Tensor,  # int32[world_size * pieces]
    group: int,  # heads // kv_heads
    kv_rows: int,  # batch * kv_heads
    s_local: int,
    chunk: int,  # s_local, or half of it under causal
    chunk_blocks: int,  # chunk // block_n: the key tiles of the unmasked loop of a visible chunk
    tiles_per_chunk: int,
    tiles_per_piece: int,
    pieces: int,
    qk_scale: float,
    num_blocks: int,
    rank: int,
    world_size: hl.constexpr,
    causal: hl.constexpr,
    wait: hl.constexpr,
    block_m: hl.constexpr,
    block_n: hl.constexpr,
) -> torch.Tensor:
    head_dim = hl.specialize(q2.size(1))
    # Sizes derived on the host arrive as arguments: Helion would otherwise spell each one out at every use.
    halves = 2 if causal else 1
    tiles_per_head = halves * tiles_per_chunk
    num_tiles = kv_rows * group * tiles_per_head
    rounds = (num_tiles + num_blocks - 1) // num_blocks
    c = 1 if causal else 0  # the masks' formulas, linear in the halves (Helion drops comparisons in int expressions)
    for block in hl.grid(num_blocks):
        for rnd in hl.grid(rounds):
            tile = block + rnd * num_blocks
            if tile < num_tiles:
                bh = tile // tiles_per_head  # (batch, head)-major: the first tiles need only the first pieces
                within = tile % tiles_per_head
                half = halves - 1 - within // tiles_per_chunk  # the later (costlier, under causal) half first
                m0 = within % tiles_per_chunk * block_m
                kv_row = bh // group
                q_row0 = bh * s_local + half * chunk + m0
                piece = tile // tiles_per_piece
                # The piece of this block's previous tile (negative before its first), as the recipe.
                prev_piece = (tile - num_blocks + tiles_per_piece * num_blocks) // tiles_per_piece - num_blocks
                for tile_m, tile_d in hl.tile([q_row0, 0], [q_row0 + block_m, head_dim], block_size=[block_m, head_dim]):
                    q = q2[tile_m, tile_d]
                    offs_m = tile_m.index - (q_row0 - m0)  # query rows within the chunk
                    m_i = hl.full([tile_m], -1.0e30, dtype=torch.float32)
                    l_i = hl.zeros([tile_m], dtype=torch.float32)
                    acc = hl.zeros([tile_m, tile_d], dtype=torch.float32)
                    # My own K/V first, read where the caller keeps them.
                    # Under causal: key half 0 is the diagonal of query half 0 and all visible to query half 1; key
                    # half 1 is invisible to query half 0 and the diagonal of query half 1 (c = 0: all visible).
                    for kh in hl.static_range(halves):
                        before = c * (1 - kh) * half + (1 - c)
                        diag = c * ((1 - kh) * (1 - half) + kh * half)
                        full = before * chunk_blocks * block_n + diag * m0
                        hi = before * chunk + diag * min(m0 + block_m, chunk)
                        row0 = kv_row * s_local + kh * chunk
                        for tile_n in hl.tile(row0, row0 + full, block_size=block_n):
                            qk = hl.dot(q, k2[tile_n, tile_d].T, out_dtype=torch.float32)
                            m_ij = torch.maximum(m_i, torch.amax(qk, -1) * qk_scale)
                            p = torch.exp2(qk * qk_scale - m_ij[:, None])
                            alpha = torch.exp2(m_i - m_ij)
                            l_i = l_i * alpha + torch.sum(p, -1)
                            v = v2[tile_n, tile_d]
                            acc = hl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None])
                            m_i = m_ij
                        limit = offs_m + (1 - diag) * chunk  # the last key each query row sees
                        for tile_n in hl.tile(row0 + full, row0 + hi, block_size=block_n):
                            qk = hl.dot(q, k2[tile_n, tile_d].T, out_dtype=torch.float32)
                            cols = tile_n.index - row0
                            keep = (cols[None, :] <= limit[:, None]) & (cols[None, :] < hi)
                            qk = torch.where(keep, qk * qk_scale, -1.0e30)
                            m_ij = torch.maximum(m_i, torch.amax(qk, -1))
                            p = torch.exp2(qk - m_ij[:, None])
                            alpha = torch.exp2(m_i - m_ij)
                            l_i = l_i * alpha + torch.sum(p, -1)
                            # Rows past the chunk: another head's values, or a piece still in flight.
                            v = torch.where((cols < hi)[:, None], v2[tile_n, tile_d], 0.0)
                            acc = hl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None])
                            m_i = m_ij
                    # Then rank + 1's, rank + 2's, ... from the gather buffer, each once its piece has landed.
                    for step in hl.grid(world_size - 1):
                        src = (rank + 1 + step) % world_size
                        if wait:
                            if piece > prev_piece:  # this block's first tile of the piece: wait once per peer
                                hl.inline_triton(WAIT_FLAG, args={"progress": progress, "index": src * pieces + piece,
                                                                  "value": 1}, output_like=None)
                        # A peer's chunks are never my diagonal. Key half 0 is visible to my query half 1, and to
                        # half 0 if src < rank (the step wrapped around); key half 1 to query half 1 if src > rank.
                        wrapped = (rank + 1 + step) // world_size
                        for kh in hl.static_range(halves):
                            peer_before = c * ((1 - kh) * (half + (1 - half) * wrapped) + kh * half * (1 - wrapped)) + (1 - c)
                            peer_full = peer_before * chunk_blocks * block_n
                            peer_hi = peer_before * chunk
                            peer_row0 = (src * 2 * kv_rows + kv_row) * s_local + kh * chunk  # K rows; V: kv_v, same rows
                            for tile_n in hl.tile(peer_row0, peer_row0 + peer_full, block_size=block_n):
                                peer_qk = hl.dot(q, kv_k[tile_n, tile_d].T, out_dtype=torch.float32)
                                peer_m_ij = torch.maximum(m_i, torch.amax(peer_qk, -1) * qk_scale)
                                peer_p = torch.exp2(peer_qk * qk_scale - peer_m_ij[:, None])
                                peer_alpha = torch.exp2(m_i - peer_m_ij)
                                l_i = l_i * peer_alpha + torch.sum(peer_p, -1)
                                peer_v = kv_v[tile_n, tile_d]
                                acc = hl.dot(peer_p.to(peer_v.dtype), peer_v, acc=acc * peer_alpha[:, None])
                                m_i = peer_m_ij
                            for tile_n in hl.tile(peer_row0 + peer_full, peer_row0 + peer_hi, block_size=block_n):
                                peer_qk = hl.dot(q, kv_k[tile_n, tile_d].T, out_dtype=torch.float32)
                                peer_cols = tile_n.index - peer_row0
                                peer_qk = torch.where(peer_cols[None, :] < peer_hi, peer_qk * qk_scale, -1.0e30)
                                peer_m_ij = torch.maximum(m_i, torch.amax(peer_qk, -1))
                                peer_p = torch.exp2(peer_qk - peer_m_ij[:, None])
                                peer_alpha = torch.exp2(m_i - peer_m_ij)
                                l_i = l_i * peer_alpha + torch.sum(peer_p, -1)
                                peer_v = torch.where((peer_cols < peer_hi)[:, None], kv_v[tile_n, tile_d], 0.0)
                                acc = hl.dot(peer_p.to(peer_v.dtype), peer_v, acc=acc * peer_alpha[:, None])
                                m_i = peer_m_ij
                    # Only the chunk's rows: a tile at a chunk's end also read some rows after it, discarded.
                    hl.store(out2, [tile_m, tile_d], (acc / l_i[:, None]).to(out2.dtype),
                             extra_mask=(offs_m < chunk)[:, None])
    return out2


def multiple_of(size: object, block: object) -> bool:
    """Whether the sympy expression ``size`` is a multiple of the int ``block`` for every value of its symbols
    (sizes, indices and their ``//`` and ``%``: all integers): every term of its expansion has an integer
    coefficient that ``block`` divides."""
    if not isinstance(block, int) or block < 1 or not isinstance(size, sympy.Expr):
        return False
    if not all(symbol.is_integer for symbol in size.free_symbols):
        return False
    coefficients = (term.as_coeff_Mul()[0] for term in sympy.Add.make_args(sympy.expand(size)))
    return all(c.is_Integer and int(c) % block == 0 for c in coefficients)


@contextlib.contextmanager
def symbolic_multiples():
    """While Helion generates this twin's kernel: a tile loop whose extent is a symbolic multiple of its block size
    gets no bounds mask. Helion 1.5 proves a multiple only for static ints, so every key loop over ``chunk_blocks *
    block_n`` keys kept a mask on its row max and row sum (two selects per score: 36% more instructions in the key
    loop at head_dim 64; docs/helion-notes.md). Only this twin's compile sees it; other kernels keep Helion's rule."""
    plain = CompileEnvironment.known_multiple

    def known_multiple(env, size, block):
        return plain(env, size, block) or multiple_of(size, block)

    CompileEnvironment.known_multiple = known_multiple
    try:
        yield
    finally:
        CompileEnvironment.known_multiple = plain


@functools.cache
def compiled(causal: bool, block_m: int, block_n: int, num_warps: int, num_stages: int) -> helion.Kernel:
    """One Helion kernel per config, each with an explicit config (every tile loop names its block size;
    TMA for q, k, v and the gather buffer through descriptors built on the host, as the recipe's;
    ``pid_type="flat"``: the recipe's grid, see ``helion_ports``)."""
    return flat_kernel(context_parallel_attention_body, (), num_warps, num_stages, indexing=indexing(causal),
                       host_tensor_descriptors=True)


def run_capped(kernel: helion.Kernel, args: tuple, launcher, maxnreg: int | None):
    """``helion_ports.run`` with the recipe's register cap (``plan``'s ``maxnreg``, where several blocks share an SM)
    given to Triton. Helion 1.5.0 takes ``maxnreg`` only with its persistent pid types (``flat`` here, see
    ``helion_ports``), so the cap goes into the launch itself: the bound kernel's generated host code launches
    through the ``_launcher`` it is given, and a Triton launch compiles for the ``maxnreg`` among its keywords. Even
    the first call launches so (it compiles the config, then launches capped): an uncapped kernel could fit fewer
    blocks per SM than the grid counts on."""
    if maxnreg is None:
        return run(kernel, args, launcher)

    def capped(triton_kernel, grid, *kernel_args, **meta):
        return launcher(triton_kernel, grid, *kernel_args, **meta, maxnreg=maxnreg)

    kept = getattr(launcher, "bound", None)  # a prepared call's host.Launcher keeps its bound kernel
    bound = kept.get(id(kernel)) if kept is not None else None
    if bound is None:
        bound = kernel.bind(args)
        bound.ensure_config_exists(args)
        if kept is not None:
            kept[id(kernel)] = bound
    return bound._run(*args, _launcher=capped)


def launch_attention(q, k, v, gathered, out, progress, rank: int, world_size: int, causal: bool, scale, wait: bool,
                     block_m: int, block_n: int, num_warps: int, num_stages: int, maxnreg: int | None, piece_rows: int,
                     pieces: int, num_blocks: int, launcher=host.jit_launch) -> torch.Tensor:
    """The attention kernel alone; mirrors the recipe's ``launch_attention``."""
    batch, heads, s_local, head_dim = q.shape
    kv_heads = k.shape[1]
    chunk = s_local // 2 if causal else s_local
    tiles_per_chunk = -(-chunk // block_m)
    rows = gathered.view(-1, head_dim)
    args = (
        q.view(-1, head_dim), k.view(-1, head_dim), v.view(-1, head_dim), rows, rows[batch * kv_heads * s_local:],
        out.view(-1, head_dim), progress, heads // kv_heads, batch * kv_heads, s_local, chunk, chunk // block_n,
        tiles_per_chunk, (2 if causal else 1) * tiles_per_chunk * (heads // kv_heads) * piece_rows, pieces,
        softmax_scale(scale, head_dim), num_blocks, rank, world_size, causal, wait, block_m, block_n,
    )
    with symbolic_multiples():  # (a warm call launches the bound kernel: nothing is generated, nothing changes)
        run_capped(compiled(causal, block_m, block_n, num_warps, num_stages), args, launcher, maxnreg)
    return out


def launch(q, k, v, peers, gathered, out, progress, signal_pad_ptrs: int, rank: int, causal: bool, scale,
           block_m: int, block_n: int, num_warps: int, num_stages: int, maxnreg: int | None, piece_rows: int,
           pieces: int, num_blocks: int, group_name: str = "", launcher=host.jit_launch,
           attention=None) -> torch.Tensor:
    """Launch on prepared arguments (no checks): the recipe's ``launch`` (the same K/V exchange on the copy engine)
    with this kernel (``attention`` None)."""
    return recipe_launch(q, k, v, peers, gathered, out, progress, signal_pad_ptrs, rank, causal, scale, block_m,
                         block_n, num_warps, num_stages, maxnreg, piece_rows, pieces, num_blocks, group_name,
                         launcher, attention or launch_attention)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    causal: bool = False,
    scale: float | None = None,
    **config,
) -> torch.Tensor:
    """This rank's output of attention over the whole sequence; see the kraken recipe."""
    return attend_to_sequence(q, k, v, group, causal, scale, config, f"helion {OP}", launch_attention)


def attention_on_gathered(q, k, v, gathered, rank: int, causal: bool = False, scale: float | None = None,
                          **config) -> torch.Tensor:
    """This twin's kernel with every rank's K/V here already (no communication); see the recipe's."""
    return on_gathered(q, k, v, gathered, rank, causal, scale, config, f"helion {OP}", launch_attention)
