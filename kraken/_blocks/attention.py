"""Building blocks of the attention recipe and its twin: the online-softmax step and the key loop over one chunk (plain
Triton functions, inlined into the kernels of ``kraken/fused/context_parallel_attention.py``), and the tile schedules
those kernels read (``tile_order``, ``full_order``, ``balanced_order``: int32 tables whose fields the recipe's and the
twin's kernels both decode, so they live here, as ``kraken._gemm_core`` holds the GEMMs' tile order).
"""

from __future__ import annotations

import heapq

import torch
import triton
import triton.language as tl

# A masked key's score (after scaling): finite, so a row whose first tile were all masked would not turn into NaN.
MASKED_SCORE = -1.0e30
_MASKED_SCORE = tl.constexpr(MASKED_SCORE)  # Triton reads module globals only as constexprs


@triton.jit
def softmax_step(qk, m_i, l_i, acc, qk_scale, keep, MASKED: tl.constexpr):
    """One online-softmax step on a key tile's raw scores ``qk`` (MASKED: only where ``keep``, the rest scored
    ``MASKED_SCORE``): the probabilities ``p`` (exp2, the scale folded in), the new row max and row sum, and ``acc``
    rescaled to the new max, ready for ``acc += p @ v``. Both kernels' key loops take it."""
    if MASKED:
        qk = tl.where(keep, qk * qk_scale, _MASKED_SCORE)
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        qk = qk - m_ij[:, None]
    else:
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        qk = qk * qk_scale - m_ij[:, None]
    p = tl.math.exp2(qk)
    alpha = tl.math.exp2(m_i - m_ij)
    return p, m_ij, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None]


@triton.jit
def attend(acc, m_i, l_i, q, k_desc, v_desc, k_row0, v_row0, lo, hi, q_limit, qk_scale,
           MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over keys ``lo .. hi`` of one chunk (rows ``k_row0 + ...`` of ``k_desc``, ``v_row0 + ...``
    of ``v_desc``). MASKED: key ``j`` counts for query row ``i`` only if ``j <= q_limit[i]`` and ``j < hi``."""
    for start in tl.range(lo, hi, BLOCK_N):
        k = k_desc.load([k_row0 + start, 0])
        cols = start + tl.arange(0, BLOCK_N)
        keep = (cols[None, :] <= q_limit[:, None]) & (cols[None, :] < hi)
        p, m_ij, l_i, acc = softmax_step(tl.dot(q, k.T), m_i, l_i, acc, qk_scale, keep, MASKED)
        v = v_desc.load([v_row0 + start, 0])
        if MASKED:
            # Rows past the chunk: another head's values, or a piece still in flight (any bits, NaN too).
            v = tl.where((cols < hi)[:, None], v, tl.zeros_like(v))
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
    return acc, m_i, l_i


# The tile schedules (host-built tables the kernels read: their fields are the kernels' contract) --------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_order(query_rows: int, group: int, s_local: int, causal: bool, block_m: int, piece_rows: int,
               device, blocks: int = 0) -> torch.Tensor:
    """The query tiles in the order the kernel's blocks take them, an int32 [tiles, 5] tensor on ``device``, each as
    (its first row of q, the first row of its kv head's K/V: rows of the flattened [rows, head_dim] q and k; half of
    the shard, first row in the chunk, piece): piece by piece (a piece's tiles need only its flags). Within a piece,
    under causal, the costliest position first across its heads (a tile's keys grow with its last row; the last tiles
    taken are short, so the blocks finish together); without, head by head (tiles running at once share K/V in L2).
    ``blocks``: a static schedule of that many blocks (below)."""
    halves = 2 if causal else 1
    tiles_per_chunk = _cdiv(max(s_local // halves, 1), block_m)
    position = torch.arange(halves * tiles_per_chunk)
    half = halves - 1 - position // tiles_per_chunk  # the later half first
    m0 = (tiles_per_chunk - 1 - position % tiles_per_chunk if causal else position) * block_m  # from its last
    heads_per_piece = group * piece_rows
    tiles = []
    for piece, first in enumerate(range(0, query_rows, heads_per_piece)):
        bh = torch.arange(first, min(first + heads_per_piece, query_rows))[None, :].expand(len(position), -1)
        tile_half, tile_m0 = half[:, None].expand_as(bh), m0[:, None].expand_as(bh)
        fields = (bh * s_local + tile_half * (s_local // halves) + tile_m0, bh // group * s_local, tile_half,
                  tile_m0, torch.full_like(bh, piece))
        stacked = torch.stack(fields, -1)  # [position, head, field]: position-major under causal, else head-major
        tiles.append((stacked if causal else stacked.transpose(0, 1)).reshape(-1, 5))
    order = torch.cat(tiles)
    if blocks:
        # A static schedule (block b takes b, b + blocks, ...): every other round of ``blocks`` tiles reversed, so the
        # block that takes a round's longest tile takes the next round's shortest (the blocks' sums even).
        p = torch.arange(len(order))
        first = p // blocks * blocks
        width = torch.clamp(len(order) - first, max=blocks)
        order = order[torch.where(p // blocks % 2 == 0, p, first + width - 1 - (p - first))]
    return order.to(torch.int32).to(device)


def full_order(batch: int, heads: int, kv_heads: int, s_local: int, causal: bool, block_m: int, piece_rows: int,
               world_size: int, grid: int, device, rank: int = 0, block_n: int = 128) -> torch.Tensor:
    """The warp-specialized kernel's ``tile_order`` on a grid of ``grid`` blocks. Under causal, with peers, balanced
    across the blocks by the tiles' key counts (``balanced_order``); at one rank no tile waits, so one piece, longest
    first, snaked, or, with a block per tile (``SPLIT_LONG``), kv head by kv head."""
    tiles = batch * heads * 2 * _cdiv(s_local // 2, block_m) if causal else 0
    if causal and world_size > 1 and grid < tiles:
        order = tile_order(batch * heads, heads // kv_heads, s_local, causal, block_m, piece_rows, "cpu")
        return balanced_order(order, s_local, block_n, rank, world_size, grid, device)
    rows = piece_rows if world_size > 1 or not causal else (1 if grid == tiles else batch * kv_heads)
    return tile_order(batch * heads, heads // kv_heads, s_local, causal, block_m, rows, device,
                      grid if causal and grid < tiles else 0)


def balanced_order(order: torch.Tensor, s_local: int, block_n: int, rank: int, world_size: int, blocks: int,
                   device) -> torch.Tensor:
    """``order`` (causal, on the CPU) rearranged for the warp-specialized kernel's static schedule (block b takes
    positions b, b + blocks, ...) so that the blocks' key tiles sum evenly (a causal tile sees its own shard's keys
    before its first row, both chunks of each later peer to the later half, the first chunk of each earlier peer).
    Piece by piece, the piece's tiles keep its positions but, longest first, each goes to the least-loaded block."""
    chunk = s_local // 2
    half, m0, piece = order[:, 2], order[:, 3], order[:, 4]
    later = world_size - 1 - rank
    # key tiles per tile (as the kernel counts them), plus two for the tile's own load and epilogue
    cost = (half * (chunk // block_n) + m0 // block_n + later * half * (s_local // block_n)
            + rank * (chunk // block_n) + 2).tolist()
    loads = [0] * blocks
    positions = torch.empty(len(cost), dtype=torch.long)
    pieces = piece.tolist()
    begin = 0
    while begin < len(cost):  # piece by piece: the positions its tiles take stay where ``order`` has them
        end = begin
        while end < len(cost) and pieces[end] == pieces[begin]:
            end += 1
        slots: dict[int, list[int]] = {}
        for position in range(begin, end):
            slots.setdefault(position % blocks, []).append(position)
        heap = [(loads[b], b) for b in slots]
        heapq.heapify(heap)
        for t in sorted(range(begin, end), key=lambda t: -cost[t]):
            _, b = heapq.heappop(heap)
            positions[slots[b].pop(0)] = t
            loads[b] += cost[t]
            if slots[b]:
                heapq.heappush(heap, (loads[b], b))
        begin = end
    return order[positions].to(torch.int32).to(device)
