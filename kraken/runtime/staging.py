"""Ordinary tensors into the symmetric-memory collectives (shared by the four and their twins).

A compiled graph's intermediates, and most of a model's tensors, are not in symmetric memory. Each
collective therefore has two prepared calls per signature:

* symmetric (``symm.is_symmetric(tensor)``): the tensor's own peers, zero copy, as before. Keyed with
  the tensor's address (it finds the peers).
* staged: the peers are kraken's shared symmetric workspace (``symm.symm_workspace``), and the kernel
  first copies, block by block, the part of the input that the peers' same block will read into it,
  before its first barrier (which then releases those writes), as torch's ``one_shot_all_reduce_copy``
  does: no separate copy launch (the Helion twins stage by a copy kernel of their own, ``kraken._blocks.helion.stage``).
  Keyed without the address, so a model's fresh activations hit it.

Ranks must agree on which: the choice is part of the signature agreed on its first call, so a rank that
passes a symmetric tensor where another passes an ordinary one raises on every rank.
"""

from __future__ import annotations

from typing import Callable

import torch

from kraken.runtime import prepared, symm
from kraken.runtime.launcher import Launcher, launch_hooked
from kraken.runtime.replay import replayed


def staged_key(tensor: torch.Tensor, group, op: str, config: dict) -> tuple:
    """``per_signature``'s key of a staged call: the tensor's signature, not its address."""
    return (op, group, prepared.tensor_key(tensor), prepared.config_key(config))


def prepares(check: Callable[[torch.Tensor, object, str, dict, bool], dict]) -> tuple[Callable, Callable, Callable]:
    """A collective's prepared calls, ``(prepare, prepare_staged, prepare_call)``, from its ``check(tensor, group,
    op, config, staged)``: validate (agreed across ranks, ``staged`` part of the signature) and plan.

    ``prepare`` (symmetric) and ``prepare_staged`` return (symmetric context of the peers, launch configuration
    with its ``Launcher``), each kept per signature. ``prepare_call``, what the public function calls,
    returns (context, launch configuration, staged): a tensor whose address has a symmetric prepared call is
    symmetric (symmetric tensors stay alive once rendezvoused, so their addresses are never an ordinary
    tensor's), which keeps that path one key and one lookup as before; any other asks ``symm.is_symmetric``."""

    @prepared.per_signature(prepared.symmetric_key)
    def prepare(tensor: torch.Tensor, group, op: str, config: dict) -> tuple[symm.SymmContext, dict]:
        launch_cfg = check(tensor, group, op, config, False)
        return symm.symm_context(tensor, group, op), {**launch_cfg, "launcher": Launcher(op)}

    @prepared.per_signature(staged_key)
    def prepare_staged(tensor: torch.Tensor, group, op: str, config: dict) -> tuple[symm.SymmContext, dict]:
        launch_cfg = check(tensor, group, op, config, True)
        workspace = symm.symm_workspace(max(tensor.numel(), 1), tensor.dtype, tensor.device, group, op)
        return symm.symm_context(workspace, group, op, name="workspace"), {**launch_cfg, "launcher": Launcher(op)}

    symmetric_calls, staged_calls = prepare.cache, prepare_staged.cache

    def prepare_call(tensor: torch.Tensor, group, op: str, config: dict) -> tuple[symm.SymmContext, dict, bool]:
        # Both caches' keys from one read of the tensor (``symmetric_key`` and ``staged_key``, spelled out): a warm
        # call is two lookups and ``is_symmetric`` here, with no call of ``prepare`` or ``prepare_staged``.
        try:
            ptr, config_key = tensor.data_ptr(), prepared.config_key(config)
            shape, strides, dtype, device = tensor.shape, tensor.stride(), tensor.dtype, tensor.device
            hit = symmetric_calls.get((op, group, (shape, strides, dtype, device, ptr), config_key))
            if hit is not None:
                return hit[0], hit[1], False
            if not symm.is_symmetric(tensor):
                hit = staged_calls.get((op, group, (shape, strides, dtype, device, ptr % 16 == 0), config_key))
                if hit is not None:
                    return hit[0], hit[1], True
        except (AttributeError, TypeError):  # not a tensor (prepare says so), or unhashable: a list in the config
            pass
        if symm.is_symmetric(tensor):
            return (*prepare(tensor, group, op, config), False)
        return (*prepare_staged(tensor, group, op, config), True)

    return prepare, prepare_staged, prepare_call


def new_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """A new tensor of ``rows`` rows shaped as ``tensor``'s (the output of a reduce-scatter or an all-gather). A 1-D
    one is allocated from an int size: torch parses that faster than a tuple (about 1 us of a warm call's host time on
    the lent H200 host, half that on the CI CPU)."""
    return tensor.new_empty(rows) if tensor.dim() == 1 else tensor.new_empty((rows, *tensor.shape[1:]))


def launched(launch: Callable, ctx: symm.SymmContext, launch_cfg: dict, staged: bool, tensor: torch.Tensor,
             *out: torch.Tensor | None) -> torch.Tensor:
    """A collective's (or its twin's) ``launch(peers, *out, signal_pad_ptrs, rank, **launch_cfg, group_name, x)`` on
    one call of its prepared call (``prepare_call``'s three results), replayed from the second call of the prepared
    call on (``replayed``: its launches from ``tensor``'s and ``out``'s addresses, with no host code). Returns
    ``out`` (one new tensor), or ``tensor`` where the sum is in place (no ``out``, or None)."""
    result = out[0] if out and out[0] is not None else tensor
    replay = launch_cfg["launcher"].replays.get(launch)
    if replay is not None and not launch_hooked():  # (``replayed``'s first step, without its frame)
        return replay((result, tensor))
    x = tensor if staged else None

    def host_code() -> torch.Tensor:
        launch(ctx.peers, *out, ctx.signal_pad_ptrs, ctx.rank, **launch_cfg, group_name=ctx.group_name, x=x)
        return result

    return replayed(launch_cfg["launcher"], launch, (result, tensor), host_code, (ctx, launch_cfg))
