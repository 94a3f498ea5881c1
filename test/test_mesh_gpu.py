"""Recipes on a device mesh's groups (one process per rank; ``KRAKEN_WORLD_SIZE=4`` on one GPU is a functional run).

``init_device_mesh("cuda", (2, world_size / 2), mesh_dim_names=("dp", "tp"))``: every op runs on
``mesh.get_group("tp")`` (tensor parallelism inside each row: two groups of disjoint ranks running the same
op at the same time), then on ``mesh.get_group("dp")`` (the columns), each rank's result checked against
float64 from its group's inputs, every group member bitwise equal. Every collective and fused recipe, the
front doors (auto and both forced), their Helion twins, the copy-engine gather and the tp_mlp block.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
import torch.distributed as dist

from check_all import check_all
from benchmark.launch import spawn
from gpu_utils import POISON, WORLD_SIZE, assert_close, heartbeat, needs_gpus

pytestmark = [
    needs_gpus,
    pytest.mark.skipif(WORLD_SIZE < 4 or WORLD_SIZE % 2, reason="a (2, world size / 2) mesh needs an even world "
                       "size of at least 4 (KRAKEN_WORLD_SIZE=4 on one GPU)"),
]
BF16 = torch.bfloat16
EPS = 1e-5


def rank_tensor(seed: int, global_rank: int, shape, scale: float = 1.0) -> torch.Tensor:
    """Global rank ``global_rank``'s input (any rank can rebuild it)."""
    gen = torch.Generator(device="cuda").manual_seed(seed * 1000 + global_rank)
    return (torch.randn(shape, device="cuda", generator=gen) * scale).to(BF16)


class Group:
    """One mesh dimension's group as this rank sees it: its members' global ranks and my place among them."""

    def __init__(self, group: dist.ProcessGroup, dim: str):
        self.pg, self.dim = group, dim
        self.members = dist.get_process_group_ranks(group)
        self.size, self.rank = len(self.members), dist.get_rank(group)

    def inputs(self, seed: int, shape, scale: float = 1.0) -> list[torch.Tensor]:
        return [rank_tensor(seed, r, shape, scale) for r in self.members]

    def mine(self, seed: int, shape, scale: float = 1.0) -> torch.Tensor:
        return rank_tensor(seed, dist.get_rank(), shape, scale)

    def same_on_every_member(self, out: torch.Tensor, what: str) -> None:
        gathered = [torch.empty_like(out) for _ in range(self.size)]
        dist.all_gather(gathered, out.contiguous(), group=self.pg)
        for member, other in zip(self.members, gathered):
            assert torch.equal(other, out), f"{what}: rank {member}'s result differs from rank {dist.get_rank()}'s"


def symmetric(values: torch.Tensor, group: Group) -> torch.Tensor:
    import kraken

    buf = kraken.symm_empty(values.shape, values.dtype, group=group.pg)
    return buf.copy_(values)


def rms_norm64(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


def check_front_doors(package: str, g: Group, seed: int) -> None:
    comm = fused = importlib.import_module(package)  # the installed functions: kraken.<name>, helion_ports.<name>
    for numel, shot in ((4099, None), (4099, "one"), (4099, "two"), ((1 << 16) + 5, None)):
        what = f"{package} all_reduce {g.dim} numel={numel} shot={shot}"
        heartbeat(what)
        config = {} if shot is None else {"shot": shot}
        out = comm.all_reduce(symmetric(g.mine(seed, numel), g), g.pg, **config)
        torch.cuda.synchronize()
        assert_close(out, sum(t.double() for t in g.inputs(seed, numel)).to(BF16), what)
        g.same_on_every_member(out, what)
        seed += 1
    hidden = 520
    bias, weight = rank_tensor(seed, 99, hidden), 1 + rank_tensor(seed, 98, hidden, 0.5)  # same on every rank
    for tokens, shot in ((7, None), (7, "two"), (40, None), (40, "one")):
        total = sum(t.double() for t in g.inputs(seed, (tokens, hidden))) + bias.double()
        config = {} if shot is None else {"shot": shot}
        for name, args, ref in (("all_reduce_bias", (bias,), total),
                                ("all_reduce_bias_rms_norm", (bias, weight, EPS), rms_norm64(total, weight))):
            what = f"{package} {name} {g.dim} tokens={tokens} shot={shot}"
            heartbeat(what)
            out = getattr(fused, name)(g.mine(seed, (tokens, hidden)), *args, group=g.pg, **config)
            torch.cuda.synchronize()
            assert_close(out, ref.to(BF16), what)
            g.same_on_every_member(out, what)
        seed += 1


def check_collectives(package: str, g: Group, seed: int) -> None:
    comm = importlib.import_module(package)
    shape = (g.size * 37, 65)
    what = f"{package} reduce_scatter {g.dim}"
    heartbeat(what)
    out = comm.reduce_scatter(symmetric(g.mine(seed, shape), g), g.pg)
    assert_close(out, sum(t.double() for t in g.inputs(seed, shape)).chunk(g.size)[g.rank].to(BF16), what)
    what = f"{package} all_gather {g.dim}"
    heartbeat(what)
    out = comm.all_gather(symmetric(g.mine(seed, (37, 65)), g), g.pg)
    assert torch.equal(out, torch.cat(g.inputs(seed, (37, 65)))), what
    what = f"{package} all_gather_with_progress {g.dim}"
    heartbeat(what)
    started = comm.all_gather_with_progress(symmetric(g.mine(seed, (37, 64)), g), g.pg,
                                            out=torch.full((g.size * 37, 64), POISON, dtype=BF16, device="cuda"))
    out = started.wait()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.cat(g.inputs(seed, (37, 64)))), what
    assert started.progress.tolist() == [1] * g.size, f"{what}: flags {started.progress.tolist()}"


def check_gemms(package: str, g: Group, seed: int) -> None:
    fused = importlib.import_module(package)
    m, n, k = 37, 200, 72
    b = rank_tensor(seed, 97, (k, n), k ** -0.5)  # the same on every rank
    what = f"{package} all_gather_matmul {g.dim}"
    heartbeat(what)
    out = fused.all_gather_matmul(g.mine(seed, (m, k)), b, g.pg)
    assert_close(out, (torch.cat(g.inputs(seed, (m, k))).double() @ b.double()).to(BF16), what)
    shards = g.inputs(seed, (g.size * m, k))
    bs = [rank_tensor(seed + 1, r, (k, n), k ** -0.5) for r in g.members]
    total = sum(a.double() @ w.double() for a, w in zip(shards, bs))
    what = f"{package} gemm_reduce_scatter {g.dim}"
    heartbeat(what)
    out = fused.gemm_reduce_scatter(g.mine(seed, (g.size * m, k)), bs[g.rank], g.pg)
    assert_close(out, total.chunk(g.size)[g.rank].to(BF16), what)
    what = f"{package} gemm_one_shot_all_reduce {g.dim}"
    heartbeat(what)
    out = fused.gemm_one_shot_all_reduce(g.mine(seed, (g.size * m, k)), bs[g.rank], g.pg, out_dtype=BF16)
    assert_close(out, total.to(BF16), what)
    g.same_on_every_member(out, what)


def check_tp_mlp(package: str, g: Group, seed: int) -> None:
    from benchmark.ops import tp_mlp

    shape = (g.size * 37, 256, g.size * 136)
    seed += 17 * g.members[0]  # tp_mlp seeds by the rank in the group: keep the two groups' inputs apart
    what = f"{package} tp_mlp {g.dim}"
    heartbeat(what)
    inputs = tp_mlp.make_inputs(shape, BF16, seed, group=g.pg)
    out = tp_mlp.BACKENDS["triton" if package == "kraken" else "helion"](inputs)
    assert_close(out, tp_mlp.reference(shape, BF16, seed, g.rank, g.size).to(BF16), what)


def mesh_worker() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    for dim in ("tp", "dp"):
        g = Group(mesh.get_group(dim), dim)
        others = [r for r in range(dist.get_world_size()) if r not in g.members]
        assert g.size == mesh.size(mesh.mesh_dim_names.index(dim)) and others, (dim, g.members)
        check_all([(f"{package} {check.__name__} on {dim}", functools.partial(check, package, g, seed))
                   for package in ("kraken", "helion_ports")
                   for check, seed in ((check_front_doors, 100), (check_collectives, 200), (check_gemms, 300),
                                       (check_tp_mlp, 400))])


def test_every_op_on_both_mesh_dimensions_at_once():
    spawn(mesh_worker, name="mesh", stall_s=180.0)  # Helion compiles with ranks sharing a host
