"""context_parallel_attention: every rank's queries attend to the whole sequence's keys and values.

Shapes are ``BATCHxSEQxHEADSxKV_HEADSxHEAD_DIMxMASK`` with SEQ the TOTAL sequence (divisible by the
world size; by twice the world size for causal) and MASK 1 (none) or 2 (causal). Every rank holds
q [BATCH, HEADS, SEQ / ws, HEAD_DIM] and k, v [BATCH, KV_HEADS, SEQ / ws, HEAD_DIM], its shard of the
sequence: the r-th contiguous part, or with causal the load-balanced layout of
``kraken.fused.context_parallel_attention`` (chunks r and 2 ws - 1 - r of 2 ws). Every rank needs
its queries' output. SDPA runs on one named backend at a time, inside ``sdpa_kernel`` with that
backend alone (nothing else may run, so a layout it refused would raise rather than fall back):
``cudnn`` (cuDNN's fused attention, the fastest on Hopper) or ``flash`` (FlashAttention-2). GQA goes
through ``enable_gqa`` (both read the fewer K/V heads themselves: no repeated copy). Under causal,
one call per query chunk over the keys up to that chunk's end: a square one with ``is_causal=True``;
the others, on flash, with a lower-right causal mask (``torch.nn.attention.bias.causal_lower_right``,
which calls the flash kernel directly); on cuDNN, which has no lower-right mask, as the keys before
the chunk (no mask) and the chunk's own keys (``is_causal=True``), merged through their
log-sum-exps (``torch.ops.aten._scaled_dot_product_cudnn_attention``, the op SDPA's cuDNN backend
calls). At world size 1 the query chunks are the sequence in order: one causal call. Backends:

* ``nccl_cudnn`` / ``nccl_flash``: ``dist.all_gather_into_tensor`` of k and of v, the gathered K/V put
  in sequence order, then SDPA on cuDNN / on flash. The GPU baseline test checks from the profiler
  (``attention_ops``) that only the named backend's ops ran;
* ``torch_cp``: torch's own context parallelism (``torch.distributed.tensor.experimental.
  context_parallel``, monkey-patch mode, all-gather rotation; under causal its head-tail load
  balancing, the same layout as ours; without, no load balancing, which it refuses to combine with a
  full mask): SDPA (flash backend alone) called on the local shards inside the context, a ring of
  flash calls merged through their log-sum-exp. It is a prototype; where it raises, the column says
  why instead of a time (and SDPA is un-patched again: the context manager does not restore it when
  its body raises);
* ``sdpa_cudnn`` / ``sdpa_flash``: the floor: this rank's queries against the whole sequence's K/V,
  gathered before the timing (no communication), with the same calls as ``nccl_cudnn`` /
  ``nccl_flash``; ``sdpa_cudnn`` is the one-GPU core table's library column;
* ``triton_local``: the recipe's own attention kernel on K/V gathered before the timing
  (``attention_on_gathered``: no communication, no flag waits): the recipe minus its exchange;
* ``triton`` / ``helion``: the kraken recipe and its Helion twin.

All of them compute the same output and are checked against ``nccl_cudnn``.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from benchmark.registry import Op, Pair, gemm_us, public, register
from benchmark.sm90 import H200_NUM_SMS
from kraken.fused.context_parallel_attention import progress_size, shard_chunks, unshard_sequence

RECIPE = "fused.context_parallel_attention"
NONE, CAUSAL = 1, 2  # the MASK field
# CPU compile example: batch 2, 4 heads over 2 kv heads (GQA), S_local 150 (causal chunks of 75: a query tile
# and a key tile end inside every chunk), head_dim 128.
EXAMPLE_SHAPE = (2, 150, 4, 2, 128)  # batch, S_local, heads, kv_heads, head_dim
# SDPA's backends by name, each run alone: no silent fallback (module docstring).
SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def unpack(shape, world_size: int) -> tuple[int, int, int, int, int, bool]:
    """(batch, S_local, heads, kv_heads, head_dim, causal) of a shape, checked."""
    batch, seq, heads, kv_heads, head_dim, mask = shape
    if mask not in (NONE, CAUSAL):
        raise ValueError(f"context_parallel_attention: MASK must be {NONE} (none) or {CAUSAL} (causal), got {mask}")
    causal = mask == CAUSAL
    parts = 2 * world_size if causal else world_size
    if seq % parts:
        raise ValueError(f"context_parallel_attention: SEQ = {seq} must be divisible by {parts} "
                         f"({'twice ' if causal else ''}the world size {world_size})")
    return batch, seq // world_size, heads, kv_heads, head_dim, causal


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


def rank_operands(shape, dtype, seed: int, rank: int, world_size: int, device="cuda"):
    """Rank ``rank``'s q, k, v shards; any rank can rebuild any other's (float references)."""
    batch, s_local, heads, kv_heads, head_dim, _ = unpack(shape, world_size)
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    q = torch.randn(batch, heads, s_local, head_dim, device=device, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, s_local, head_dim, device=device, generator=gen).to(dtype)
    v = torch.randn(batch, kv_heads, s_local, head_dim, device=device, generator=gen).to(dtype)
    return q, k, v


def gather_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Every rank's k and v as [world_size, 2, batch * kv_heads, S_local, head_dim] (NCCL)."""
    world_size = dist.get_world_size()
    kv = torch.stack([k, v])
    gathered = torch.empty(world_size * kv.numel(), dtype=k.dtype, device=k.device)
    dist.all_gather_into_tensor(gathered, kv.view(-1))
    return gathered.view(world_size, 2, k.shape[0] * k.shape[1], k.shape[2], k.shape[3])


def sequence_kv(gathered: torch.Tensor, k: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered K/V in sequence order: [batch, kv_heads, S, head_dim] each."""
    shards = [g.view(2, *k.shape) for g in gathered.unbind(0)]
    return (unshard_sequence([s[0] for s in shards], causal), unshard_sequence([s[1] for s in shards], causal))


def make_inputs(shape, dtype, seed):
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"context_parallel_attention: inputs must be bf16 or fp16, got {dtype}")
    world_size = dist.get_world_size()
    causal = unpack(shape, world_size)[5]
    q, k, v = rank_operands(shape, dtype, seed, dist.get_rank(), world_size)
    gathered = gather_kv(k, v)  # for the no-communication backends only
    k_seq, v_seq = sequence_kv(gathered, k, causal)
    return {"q": q, "k": k, "v": v, "causal": causal, "gathered": gathered, "k_seq": k_seq, "v_seq": v_seq}


# ---------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "flash", **kwargs) -> torch.Tensor:
    """SDPA on one backend alone (``SDPA_BACKENDS``); fewer K/V heads through ``enable_gqa``."""
    with sdpa_kernel([SDPA_BACKENDS[backend]]):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kwargs)


def attention_ops(fn) -> set[str]:
    """The aten attention ops (``aten::_scaled_dot_product_*``, ``aten::_flash_attention_forward``,
    ``aten::_efficient_attention_forward``) that ``fn()`` runs, from the profiler: which SDPA backend really ran."""
    from torch.profiler import profile

    with profile(acc_events=True) as prof:  # (one cycle: keep its events, without the profiler's warning)
        fn()
    return {e.key for e in prof.key_averages()
            if e.key.startswith(("aten::_scaled_dot_product", "aten::_flash_attention", "aten::_efficient_attention"))}


def cudnn_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """cuDNN attention's output and its log-sum-exp per query row ([batch, heads, L, 1], float32); GQA as SDPA's
    ``enable_gqa`` passes it to cuDNN (the fewer K/V heads as they are)."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)[:2]
    return out, lse.reshape(*q.shape[:-1], 1).float()


def cudnn_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Lower-right causal attention of ``L`` queries over ``S >= L`` keys on cuDNN: the first ``S - L`` keys (all
    visible) and the last ``L`` (a square causal call), merged through their log-sum-exps."""
    before = k.shape[2] - q.shape[2]
    o_diag, lse_diag = cudnn_with_lse(q, k[:, :, before:], v[:, :, before:], True)
    o_prev, lse_prev = cudnn_with_lse(q, k[:, :, :before], v[:, :, :before], False)
    lse = torch.logaddexp(lse_prev, lse_diag)
    return (o_prev.float() * torch.exp(lse_prev - lse) + o_diag.float() * torch.exp(lse_diag - lse)).to(q.dtype)


def sdpa_on_sequence(q: torch.Tensor, k_seq: torch.Tensor, v_seq: torch.Tensor, causal: bool,
                     backend: str = "flash", rank: int | None = None, world_size: int | None = None) -> torch.Tensor:
    """Rank ``rank``'s output (default: this process's, in the default group) from the whole sequence's K/V (in
    order) on one SDPA backend: one call, or one per query chunk (module docstring)."""
    world_size = dist.get_world_size() if world_size is None else world_size
    rank = dist.get_rank() if rank is None else rank
    if not causal or world_size == 1:  # (at world size 1 my two chunks are the sequence in order)
        return attention(q, k_seq, v_seq, backend, is_causal=causal)
    chunk = q.shape[2] // 2
    outs = []
    for half, c in enumerate(shard_chunks(rank, world_size, True)):
        keys = (c + 1) * chunk  # the keys up to this chunk's end; the last chunk of them on the diagonal
        q_c, k_c, v_c = q[:, :, half * chunk:(half + 1) * chunk], k_seq[:, :, :keys], v_seq[:, :, :keys]
        if keys == chunk:
            outs.append(attention(q_c, k_c, v_c, backend, is_causal=True))
        elif backend == "cudnn":
            with sdpa_kernel([SDPA_BACKENDS[backend]]):
                outs.append(cudnn_lower_right(q_c, k_c, v_c))
        else:
            outs.append(attention(q_c, k_c, v_c, backend, attn_mask=causal_lower_right(chunk, keys)))
    return torch.cat(outs, dim=2)


def nccl(backend: str):
    def run(i):
        k_seq, v_seq = sequence_kv(gather_kv(i["k"], i["v"]), i["k"], i["causal"])
        return sdpa_on_sequence(i["q"], k_seq, v_seq, i["causal"], backend)
    return run


def sdpa(backend: str):
    return lambda i: sdpa_on_sequence(i["q"], i["k_seq"], i["v_seq"], i["causal"], backend)


_meshes: dict = {}


def torch_cp(i):
    """torch's context parallelism on the local shards (see the module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    q, k, v, causal = i["q"], i["k"], i["v"], i["causal"]
    if q.device.type not in _meshes:
        _meshes[q.device.type] = init_device_mesh(q.device.type, (dist.get_world_size(),))
    # Head-tail load balancing (our causal layout) under causal only: with a full mask it raises.
    cp._cp_options.enable_load_balance = causal
    # context_parallel shards its buffers in place and takes their device from the first: a small stand-in.
    stand_in = torch.zeros(2 * dist.get_world_size(), device=q.device)
    sdpa_fn = F.scaled_dot_product_attention
    try:
        with context_parallel(_meshes[q.device.type], buffers=[stand_in], buffer_seq_dims=[0],
                              no_restore_buffers={stand_in}):
            out = attention(q, k, v, "flash", is_causal=causal)
    except Exception as exc:  # a prototype, whatever it raises: report it in the column, do not crash the run
        raise NotImplementedError(f"torch context_parallel: {type(exc).__name__}: {exc}"[:300]) from exc
    finally:
        # context_parallel is a generator context manager with no try/finally: when its body raises, SDPA stays
        # patched (and the DTensor handlers registered), and every later SDPA call, the other columns' too, would
        # go through context parallelism. Undo what its exit would have done.
        if F.scaled_dot_product_attention is not sdpa_fn:
            cp._disable_context_parallel_dispatcher_impl()
    return out.to_local() if hasattr(out, "to_local") else out


def fused(package: str):
    path = f"{package}.{RECIPE}"
    fn = public(path)
    return lambda i: fn(i["q"], i["k"], i["v"], causal=i["causal"])


def triton_local(i):
    from kraken.runtime.attention import attention_on_gathered

    return attention_on_gathered(i["q"], i["k"], i["v"], i["gathered"], dist.get_rank(), causal=i["causal"])


# ---------------------------------------------------------------------------
# CPU compile example (benchmark.sm90)
# ---------------------------------------------------------------------------


def example(module, world_size: int, shape=None, causal: bool = True, dtype=torch.bfloat16, **config) -> None:
    """Launch the attention kernel (``module.launch_attention``, the flag consumer; the exchange needs no kernel
    but one-block barriers) on CPU stand-ins, rank 1; ``shape`` in the op's format (default: ``EXAMPLE_SHAPE``
    at every world size, causal)."""
    if shape is None:
        batch, s_local, heads, kv_heads, head_dim = EXAMPLE_SHAPE
    else:
        batch, s_local, heads, kv_heads, head_dim, causal = unpack(shape, world_size)
    q = torch.randn(batch, heads, s_local, head_dim, dtype=dtype)
    k = torch.randn(batch, kv_heads, s_local, head_dim, dtype=dtype)
    v = torch.randn(batch, kv_heads, s_local, head_dim, dtype=dtype)
    gathered = torch.empty(world_size, 2, batch * kv_heads, s_local, head_dim, dtype=dtype)
    cfg = module.plan(batch, heads, kv_heads, s_local, head_dim, world_size, causal, config, H200_NUM_SMS)
    progress = torch.zeros(progress_size(world_size, cfg["pieces"]), dtype=torch.int32)
    module.launch_attention(q, k, v, gathered, torch.empty_like(q), progress, 1, world_size, causal, None, True, **cfg)


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


def nvlink_bytes(shape, dtype, world_size):
    # Every rank receives every other rank's K and V.
    batch, s_local, _, kv_heads, head_dim, _ = unpack(shape, world_size)
    return (world_size - 1) * 2 * batch * kv_heads * s_local * head_dim * dtype.itemsize


def work(shape, dtype):
    # One call at world size 1: the whole sequence's attention (causal: half the score matrix).
    batch, seq, heads, _, head_dim, causal = unpack(shape, 1)
    flops = 4 * batch * heads * seq * seq * head_dim
    return (flops / 2 if causal else flops), "flop"


def floor_us(shape, dtype, world_size):
    # This rank's attention at the measured dense peak (causal: half the score matrix); the exchange can hide.
    batch, s_local, heads, _, head_dim, causal = unpack(shape, world_size)
    flops = 4 * batch * heads * s_local * (s_local * world_size) * head_dim
    return gemm_us(flops / 2 if causal else flops)


register(
    Op(
        name="context_parallel_attention",
        description="attention of each rank's sequence shard over the whole sequence (q, k, v [B, H, S/ws, D] per "
                    "rank); shapes BATCHxSEQxHEADSxKV_HEADSxHEAD_DIMxMASK, SEQ the total, MASK 1 none / 2 causal",
        make_inputs=make_inputs,
        backends={"nccl_cudnn": nccl("cudnn"), "nccl_flash": nccl("flash"), "torch_cp": torch_cp,
                  "sdpa_cudnn": sdpa("cudnn"), "sdpa_flash": sdpa("flash"), "triton_local": triton_local,
                  "triton": fused("kraken"), "helion": fused("helion_ports")},
        default_shapes=[(1, seq, 32, kv_heads, 128, mask) for mask in (NONE, CAUSAL) for kv_heads in (32, 8)
                        for seq in (8192, 32768, 131072)],
        shape_format="BATCHxSEQxHEADSxKV_HEADSxHEAD_DIMxMASK",
        nvlink_bytes=nvlink_bytes,
        floor_us=floor_us,
        pairs=[Pair("triton", "helion", f"kraken.{RECIPE}", f"helion_ports.{RECIPE}", example)],
        library="sdpa_cudnn",  # the one-GPU core table's library column (world size 1)
        eager_only=frozenset({"torch_cp"}),  # its load balancer copies host indices: not capturable
        work=work,
    )
)
