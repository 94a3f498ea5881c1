"""The context-parallel attention core on one rank's problem, on one GPU: no communication, no process group.

At world size W, rank r's queries (S / W rows; under causal the load-balanced chunks r and 2W - 1 - r) attend to
the whole sequence's keys. That problem needs only one GPU: the recipe's kernel runs on it through
``attention_on_gathered`` (every rank's K/V laid out in a gather buffer, no flag waits), cuDNN through the same SDPA
calls as the benchmark's ``sdpa_cudnn`` column (rectangular, or per query chunk with a lower-right mask). Each row is
checked against a float64 reference of a few query rows, then timed (CUDA events, median).

    python -m benchmark.cp_core --shapes 1x32768x32x8x128x2 --world-sizes 2 4 --ranks 0 -1
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from benchmark.ops.context_parallel_attention import sdpa_on_sequence, unpack
from kraken.fused.context_parallel_attention import sequence_positions, shard_sequence
from kraken.runtime.attention import attention_on_gathered

CHECK_ROWS = 64  # query rows per head checked against float64


def rank_problem(shape, world_size: int, rank: int, seed: int = 0):
    """(q of rank ``rank``, its gather buffer [W, 2, batch * kv_heads, S_local, head_dim], the sequence's K and V, and
    the positions of its query rows), from one random sequence."""
    batch, s_local, heads, kv_heads, head_dim, causal = unpack(shape, world_size)
    seq = s_local * world_size
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h: torch.randn(batch, h, seq, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa
    q_seq, k_seq, v_seq = make(heads), make(kv_heads), make(kv_heads)
    q = shard_sequence(q_seq, rank, world_size, causal)
    gathered = torch.stack([torch.stack([shard_sequence(t, r, world_size, causal).view(batch * kv_heads, s_local,
                                                                                       head_dim) for t in (k_seq, v_seq)])
                            for r in range(world_size)])
    return q, gathered, k_seq, v_seq, sequence_positions(s_local, rank, world_size, causal)


def reference_error(out, q, k_seq, v_seq, positions, causal: bool) -> float:
    """‖out - ref‖ / ‖ref‖ over ``CHECK_ROWS`` query rows spread over the shard, ref in float64."""
    rows = torch.linspace(0, q.shape[2] - 1, CHECK_ROWS, device="cpu").long()
    group = q.shape[1] // k_seq.shape[1]
    k = k_seq.double().repeat_interleave(group, 1)
    v = v_seq.double().repeat_interleave(group, 1)
    scores = q[:, :, rows.cuda()].double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        keys = torch.arange(k.shape[2], device="cuda")
        scores = scores.masked_fill(keys[None, :] > positions[rows].cuda()[:, None], float("-inf"))
    ref = torch.softmax(scores, -1) @ v
    got = out[:, :, rows.cuda()].double()
    return ((got - ref).norm() / ref.norm()).item()


def median_us(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def run(shape, world_size: int, rank: int, iters: int, config: dict) -> dict:
    causal = unpack(shape, world_size)[5]
    q, gathered, k_seq, v_seq, positions = rank_problem(shape, world_size, rank)
    k, v = (gathered[rank, i].view(q.shape[0], -1, *gathered.shape[3:]) for i in (0, 1))
    ours = lambda: attention_on_gathered(q, k, v, gathered, rank, causal=causal, **config)  # noqa
    cudnn = lambda: sdpa_on_sequence(q, k_seq, v_seq, causal, "cudnn", rank, world_size)  # noqa
    errors = [reference_error(fn(), q, k_seq, v_seq, positions, causal) for fn in (ours, cudnn)]
    return {"shape": "x".join(map(str, shape)), "ws": world_size, "rank": rank, "err": errors[0],
            "err_cudnn": errors[1], "cudnn_us": median_us(cudnn, iters), "triton_us": median_us(ours, iters)}


def parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("x"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, required=True, help="BATCHxSEQxHEADSxKV_HEADSxHEAD_DIMxMASK, SEQ the total, MASK 1 none / 2 causal")
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--ranks", nargs="+", type=int, default=[0, -1], help="-1: the last rank")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--config", default="", help="the recipe's config, as key=value,key=value")
    args = parser.parse_args(argv)
    config = {k: int(v) for k, v in (item.split("=") for item in args.config.split(",") if item)}
    print(f"{'shape':>22} {'ws':>3} {'rank':>4} {'cudnn us':>10} {'triton us':>10} {'x cudnn':>8} {'err':>9} "
          f"{'err cudnn':>9}", flush=True)
    for shape in args.shapes:
        for world_size in args.world_sizes:
            for rank in sorted({r % world_size for r in args.ranks}):
                row = run(shape, world_size, rank, args.iters, config)
                print(f"{row['shape']:>22} {world_size:>3} {rank:>4} {row['cudnn_us']:>10.0f} {row['triton_us']:>10.0f} "
                      f"{row['triton_us'] / row['cudnn_us']:>8.3f} {row['err']:>9.2e} {row['err_cudnn']:>9.2e}",
                      flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
