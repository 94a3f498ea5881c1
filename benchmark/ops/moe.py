"""moe_dispatch and moe_combine: the eager NCCL path vs the kraken recipes and their Helion twins.

The shape is ``TxHxExKxSKEW``: tokens per rank, hidden size, experts (over all ranks, ``E /
world_size`` per rank), top-k, and the routing: ``SKEW`` 1 draws each token's k distinct experts
uniformly, 2 with Zipf weights ``1 / (e + 1)`` (expert 0 about ``E / H(E)`` times as busy as the
mean, the owner of the first experts receives the most; with 64 experts some get no token at small T).
Every field is a positive integer, as ``registry.parse_shape`` requires (as context_parallel_attention's
MASK field), so ``--shapes 4096x4096x8x2x1`` reads back what the tables print.
The routing is drawn on the CPU from a seed per rank, so every rank knows every rank's routing: the
capacity given to the recipes is the largest number of rows any rank receives (nothing is dropped),
and each backend's output is compared row for row.

Baseline ``nccl`` (the common eager path, Megatron-LM's all-to-all token dispatcher): dispatch sorts
the (token, k) pairs by expert (a stable argsort: a permute), exchanges the per-expert counts with
``all_to_all_single``, copies the splits to the host (a synchronisation), sends the rows with
``all_to_all_single`` with splits, and regroups the received chunks expert-major (the second permute,
``sort_chunks_by_idxs``). Combine reverses it with the splits the dispatch found (no synchronisation):
regroup rank-major, ``all_to_all_single`` back, and ``index_add_`` of the weighted rows (fp32) into the
tokens' order. Both produce exactly the recipes' layout, so outputs compare directly.

Not here: torch's ``all_to_all_vdev_2d``. It needs the NVSHMEM symmetric-memory backend, chosen once per
process (``symm_mem.set_backend("NVSHMEM")``) before the first symmetric allocation, for every buffer; the
recipes' buffers and signal pads (and every other op of this harness) use the CUDA backend in the same
process. A comparison with it needs a process of its own: not done in this first version.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
import triton

from benchmark.registry import Op, Pair, SYNC_US, copy_backend, copy_work, nvlink_us, public, register
from benchmark.sm90 import FAKE_SIGNAL_PADS, example_rank

DISPATCH, COMBINE = "comm.moe_dispatch", "comm.moe_combine"
SHAPE_FORMAT = "TxHxExKxSKEW"
UNIFORM, ZIPF = 1, 2  # the SKEW field
DEFAULT_SHAPES = [(t, h, e, k, skew) for t in (128, 1024, 4096) for h in (4096, 7168) for e in (8, 64)
                  for k in (2, 8) for skew in (UNIFORM, ZIPF)]


def routing(num_tokens: int, num_experts: int, top_k: int, skew: int, seed: int) -> torch.Tensor:
    """``[T, k]`` int64 distinct expert ids per token, on the CPU (every rank can draw every rank's)."""
    gen = torch.Generator().manual_seed(seed)
    check_skew(skew)
    zipf = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64)
    weights = torch.ones(num_experts) if skew == UNIFORM else zipf
    return torch.multinomial(weights.float().expand(num_tokens, num_experts), top_k, replacement=False,
                             generator=gen)


def check_skew(skew: int) -> None:
    if skew not in (UNIFORM, ZIPF):
        raise ValueError(f"moe: SKEW must be {UNIFORM} (uniform) or {ZIPF} (Zipf), got {skew}")


def check_shape(shape, world_size: int) -> None:
    num_tokens, hidden, num_experts, top_k, skew = shape
    check_skew(skew)
    if num_experts % world_size or top_k > num_experts:
        raise ValueError(f"moe: shape {shape}: E must be divisible by the world size {world_size} and K <= E")


def dispatch_inputs(shape, dtype, seed):
    """Tokens (random, per rank), this rank's routing, and every rank's, for the capacity and the baseline."""
    num_tokens, hidden, num_experts, top_k, skew = shape
    world_size, rank = dist.get_world_size(), dist.get_rank()
    check_shape(shape, world_size)
    all_ids = [routing(num_tokens, num_experts, top_k, skew, seed * 1000 + r) for r in range(world_size)]
    gen = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    tokens = torch.randn(num_tokens, hidden, dtype=torch.float32, device="cuda", generator=gen).to(dtype)
    book = bookkeeping(all_ids, rank, num_experts)
    return {**book, "tokens": tokens, "expert_ids": all_ids[rank].cuda(), "order": book["order"].cuda()}


def bookkeeping(all_ids: list[torch.Tensor], rank: int, num_experts: int) -> dict:
    """From every rank's routing (CPU): the capacity, the rows this rank receives, and the eager path's splits
    and order, which its combine reuses (in a model its dispatch finds them)."""
    world_size = len(all_ids)
    per_rank = num_experts // world_size
    counts = torch.stack([torch.bincount(x.flatten(), minlength=num_experts) for x in all_ids])  # [src, e]
    received = counts.view(world_size, world_size, per_rank).sum((0, 2)).tolist()  # per owner
    send = counts[rank].view(world_size, per_rank)  # to rank d, expert e
    recv = counts[:, rank * per_rank:(rank + 1) * per_rank]  # from rank s, local expert e
    return {
        "num_experts": num_experts,
        # The largest count any rank receives, rounded up to a power of two: nothing is dropped, and shapes
        # and seeds share receive buffers (each is a symmetric allocation, kept for the process's life).
        "capacity": triton.next_power_of_2(max(1, max(received))),
        "recv_rows": received[rank], "order": torch.argsort(all_ids[rank].flatten(), stable=True),
        "in_splits": send.sum(1).tolist(), "out_splits": recv.sum(1).tolist(), "recv_chunks": recv.tolist(),
    }


def rank_major_to_expert_major(rows: torch.Tensor, chunks: list[list[int]]) -> torch.Tensor:
    """Rows arriving as (rank s, expert e) chunks, rank-major, regrouped expert-major (Megatron's
    ``sort_chunks_by_idxs``)."""
    world_size, per_rank = len(chunks), len(chunks[0])
    parts = rows.split([c for row in chunks for c in row])
    return torch.cat([parts[s * per_rank + e] for e in range(per_rank) for s in range(world_size)])


def expert_major_to_rank_major(rows: torch.Tensor, chunks: list[list[int]]) -> torch.Tensor:
    world_size, per_rank = len(chunks), len(chunks[0])
    parts = rows.split([chunks[s][e] for e in range(per_rank) for s in range(world_size)])
    return torch.cat([parts[e * world_size + s] for s in range(world_size) for e in range(per_rank)])


def nccl_dispatch(i):
    """Megatron-style: permute, count exchange, host sync for the splits, all_to_all_single, regroup."""
    tokens, ids = i["tokens"], i["expert_ids"]
    world_size, top_k = dist.get_world_size(), ids.shape[1]
    per_rank = i["num_experts"] // world_size
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    permuted = tokens.index_select(0, order // top_k)
    counts = torch.bincount(flat, minlength=i["num_experts"])
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts)  # [s * per_rank + e]: from rank s to my expert e
    chunks = received.view(world_size, per_rank).tolist()  # the host synchronisation
    in_splits = counts.view(world_size, per_rank).sum(1).tolist()
    out_splits = [sum(row) for row in chunks]
    out = tokens.new_empty((sum(out_splits), tokens.shape[1]))
    dist.all_to_all_single(out, permuted, out_splits, in_splits)
    return rank_major_to_expert_major(out, chunks)


def recipe_dispatch(package: str):
    fn = public(f"{package}.{DISPATCH}")

    def run(i):
        recv, _, _ = fn(i["tokens"], i["expert_ids"], i["num_experts"], capacity=i["capacity"])
        return recv[:i["recv_rows"]]

    return run


def combine_inputs(shape, dtype, seed):
    """The dispatch's inputs, the recipe's dispatch done (its handle), the expert outputs written in place into
    its receive buffer (``recv * 2``), the same rows as an ordinary tensor for the baseline, and weights."""
    i = dispatch_inputs(shape, dtype, seed)
    from kraken import moe_dispatch

    recv, _, handle = moe_dispatch(i["tokens"], i["expert_ids"], i["num_experts"], capacity=i["capacity"])
    recv[:i["recv_rows"]].mul_(2)
    gen = torch.Generator(device="cuda").manual_seed(seed * 1000 + 500 + dist.get_rank())
    logits = torch.randn(i["expert_ids"].shape, device="cuda", generator=gen)
    return {**i, "recv": recv, "handle": handle, "expert_out": recv[:i["recv_rows"]].clone(),
            "weights": torch.softmax(logits, dim=1)}


def nccl_combine(i):
    """Megatron-style, reusing the dispatch's splits: regroup rank-major, all_to_all_single back, weighted
    index_add_ (fp32) into token order."""
    tokens, top_k = i["tokens"], i["expert_ids"].shape[1]
    back = expert_major_to_rank_major(i["expert_out"], i["recv_chunks"])
    permuted = back.new_empty((sum(i["in_splits"]), back.shape[1]))
    dist.all_to_all_single(permuted, back, i["in_splits"], i["out_splits"])
    order = i["order"]
    weighted = permuted.float() * i["weights"].flatten()[order, None]
    out = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    out.index_add_(0, order // top_k, weighted)
    return out.to(tokens.dtype)


def recipe_combine(package: str):
    fn = public(f"{package}.{COMBINE}")
    return lambda i: fn(i["recv"], i["handle"], i["weights"])


# ---------------------------------------------------------------------------
# CPU compile examples (benchmark.sm90): fake peers, the launch only
# ---------------------------------------------------------------------------


def example_shape(world_size: int) -> tuple[int, ...]:
    return (37, 129, 2 * world_size, 2, UNIFORM)  # odd: every tail masked, nothing 16-byte aligned


def example_routing(world_size: int, shape, rank: int | None = None) -> tuple[tuple, dict]:
    """A dispatch launch's positional arguments (CPU stand-ins: every rank's receive buffer and count table as fake
    peers, uninitialised routing outputs) and its plan."""
    num_tokens, hidden, num_experts, top_k, _ = shape
    rank = example_rank(world_size) if rank is None else rank
    dispatch = importlib.import_module(f"kraken.{DISPATCH}")
    capacity = 2 * num_tokens * top_k
    cfg = dispatch.plan(num_tokens, top_k, hidden, num_experts, world_size, {})
    recv = tuple(torch.empty(capacity, hidden, dtype=torch.bfloat16) for _ in range(world_size))
    counts = tuple(torch.empty(world_size, cfg["e_pad"], dtype=torch.int32) for _ in range(world_size))
    tokens = torch.randn(num_tokens, hidden).to(torch.bfloat16)
    ids = torch.randint(0, num_experts, (num_tokens, top_k))
    local = num_experts // world_size
    routing = (torch.empty(num_tokens, top_k, dtype=torch.int32), *(torch.empty(n, dtype=torch.int32)
                                                                    for n in (local, local, 2)))
    return (tokens, ids, *routing, recv, FAKE_SIGNAL_PADS, counts, FAKE_SIGNAL_PADS, rank, num_experts, capacity), cfg


def dispatch_example(module, world_size: int, shape=None, rank: int | None = None) -> None:
    shape = shape or example_shape(world_size)
    check_shape(shape, world_size)
    args, cfg = example_routing(world_size, shape, rank)
    module.launch(*args, **cfg)


def combine_example(module, world_size: int, shape=None, rank: int | None = None) -> None:
    shape = shape or example_shape(world_size)
    check_shape(shape, world_size)
    num_tokens, hidden, _, top_k, _ = shape
    rank = example_rank(world_size) if rank is None else rank
    capacity = 2 * num_tokens * top_k
    recv = tuple(torch.empty(capacity, hidden, dtype=torch.bfloat16) for _ in range(world_size))
    slots = torch.empty(num_tokens, top_k, dtype=torch.int32)
    cfg = importlib.import_module(f"kraken.{COMBINE}").plan(num_tokens, hidden, world_size, {})
    out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16)
    module.launch(out, torch.rand(num_tokens, top_k), slots, recv, FAKE_SIGNAL_PADS, rank, capacity, **cfg)


def routed_rows(i: dict) -> torch.Tensor:
    """Every (token, expert) pair's row, ``[T * k, H]``: the bytes dispatch and combine each move, copied by the
    ``copy`` column (made once per inputs)."""
    rows = i.get("_routed_rows")
    if rows is None:
        rows = i["_routed_rows"] = i["tokens"].repeat_interleave(i["expert_ids"].shape[1], 0)
    return rows


def work(shape, dtype):
    num_tokens, hidden, _, top_k, _ = shape
    return copy_work(num_tokens * top_k * hidden, dtype)


def nvlink_bytes(shape, dtype, world_size):
    """Rows a rank sends to (or pulls from) its peers under uniform routing: (ws - 1) / ws of its T * k pairs.
    (Skewed rows move as much on average but unevenly: the busiest rank receives more.)"""
    num_tokens, hidden, _, top_k, _ = shape
    return (world_size - 1) / world_size * num_tokens * top_k * hidden * dtype.itemsize


def floor_us(shape, dtype, world_size):
    return nvlink_us(nvlink_bytes(shape, dtype, world_size)) + 2 * SYNC_US


register(
    Op(
        name="moe_combine",
        description="MoE combine: top-k expert outputs back to their tokens' ranks, weighted sum in token order",
        make_inputs=combine_inputs,
        backends={"nccl": nccl_combine, "triton": recipe_combine("kraken"), "helion": recipe_combine("helion_ports"),
                  "copy": copy_backend(routed_rows)},
        library="copy",
        work=work,
        reference_free=frozenset({"copy"}),
        default_shapes=DEFAULT_SHAPES,
        shape_format=SHAPE_FORMAT,
        nvlink_bytes=nvlink_bytes,
        floor_us=floor_us,
        pairs=[Pair("triton", "helion", f"kraken.{COMBINE}", f"helion_ports.{COMBINE}", combine_example)],
    )
)

register(
    Op(
        name="moe_dispatch",
        description="MoE dispatch: every token to its top-k experts' ranks, expert-major, counts on the device",
        make_inputs=dispatch_inputs,
        backends={"nccl": nccl_dispatch, "triton": recipe_dispatch("kraken"),
                  "helion": recipe_dispatch("helion_ports"), "copy": copy_backend(routed_rows)},
        library="copy",
        eager_only=frozenset({"nccl"}),  # its splits come to the host (tolist): not capturable
        work=work,
        reference_free=frozenset({"copy"}),
        default_shapes=DEFAULT_SHAPES,
        shape_format=SHAPE_FORMAT,
        nvlink_bytes=nvlink_bytes,
        floor_us=floor_us,
        pairs=[Pair("triton", "helion", f"kraken.{DISPATCH}", f"helion_ports.{DISPATCH}", dispatch_example)],
    )
)
