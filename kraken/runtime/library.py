"""The recipes as ``torch.library`` custom operators, so that a model calling them compiles.

Dynamo cannot trace a recipe's host code (symmetric-memory handles, c10d pybind calls, the
prepared-call caches), so under ``torch.compile`` each public recipe is one operator that it does not
look into: ``torch.ops.kraken.<name>`` for ``kraken``, ``torch.ops.kraken_helion.<name>`` for the twin
in ``helion_ports``. Each has a fake implementation (output shapes and dtypes, for tracing) and
declares what it writes (``two_shot_all_reduce`` sums its input in place).

The public functions stay the front door. ``install_front_doors(module, namespace)``, called at the end of
``kraken.runtime.api`` and ``kraken.runtime.twins``, replaces every public function of the table there (and in the
module that defines it) by a wrapper with the recipe's signature (``functools.wraps``): in eager it calls the recipe straight
away (one ``torch.compiler.is_dynamo_compiling()`` check; the wrapper costs about 0.2 us a call on the CI
CPU), and while Dynamo traces it calls the operator, whose implementation calls the recipe.

What an operator schema cannot say, and what the operator takes instead:

* ``group``: a process group object is not a schema type; the operator takes the group's name
  (``str?``, None for the default group) and, right after it, the group's size (``int world_size``, as
  torch's functional collectives take ``group_size``). A ``ProcessGroup`` passed to the front door is
  traced as its ``group_name``, its size as a constant. The fakes read the size from that argument, never
  from the live group: inductor and AOTAutograd cache compiled graphs on disk, keyed by the graph and its
  inputs' shapes, and a rank's shapes and the default group's name are the same at every world size, so
  a size outside the graph let a graph compiled at world size 1 run at 2 (where inductor's
  output-size assert refused the real output). The implementation checks the size against the group's.
* ``**config``: the operator takes it as one string, ``repr`` of its sorted items (``""`` when
  empty), which the implementation reads back with ``ast.literal_eval``: ints, floats, bools,
  strings and None, which is what every recipe's config holds.

Not an operator: ``all_gather_with_progress`` (its result, a gather in flight, is a Python object). The MoE pair
are operators of their own (``kraken/runtime/moe_ops.py``, installed from here): the dispatch's handle crosses the
operator boundary as its tensors (the received tokens and one int32 routing tensor).

Adding a recipe is one ``Entry`` in ``ENTRIES`` (its name, its fake, and, if it differs from a
single new tensor, what it returns and writes), plus its line in ``kraken.runtime.api`` (and ``.twins``).
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


def world_size(group: str | None) -> int:
    """The size of a group given by name (None: the default group): the operator's ``world_size`` argument.
    Dynamo calls both functions while it traces and puts the result in the graph as a constant (torch's
    functional collectives read their ``group_size`` the same way)."""
    return dist.get_world_size() if group is None else dist.distributed_c10d._get_group_size_by_name(group)


def encode_config(config: dict) -> str:
    """``**config`` as an operator argument (see the module docstring); traceable by Dynamo."""
    return repr(tuple(sorted(config.items()))) if config else ""


def decode_config(text: str) -> dict:
    return dict(ast.literal_eval(text)) if text else {}


def group_name(group) -> str | None:
    """The ``group`` argument as the operator takes it: a name, or None for the default group."""
    return group if group is None or isinstance(group, str) else group.group_name


# ---------------------------------------------------------------------------
# Fakes: the outputs' shapes and dtypes from the arguments alone (schema order, group by name then its
# size, config as text); never from the live process group (see the module docstring)
# ---------------------------------------------------------------------------


def like_first(first: torch.Tensor, *rest) -> torch.Tensor:
    return torch.empty_like(first, memory_format=torch.contiguous_format)


def writes_first(first: torch.Tensor, *rest) -> None:
    return None


def scattered(tensor: torch.Tensor, group, world_size, config) -> torch.Tensor:
    from kraken.runtime.collectives import check_shape  # the product's own error, at trace time

    check_shape(tuple(tensor.shape), world_size, "reduce_scatter")
    return tensor.new_empty((tensor.shape[0] // world_size, *tensor.shape[1:]))


def gathered(tensor: torch.Tensor, group, world_size, config) -> torch.Tensor:
    return tensor.new_empty((world_size * tensor.shape[0], *tensor.shape[1:]))


def gemm_all_reduced(a, b, group, world_size, out_dtype, config) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def gemm_scattered(a, b, *rest) -> torch.Tensor:
    world_size, out_dtype = rest[-3], rest[-2]  # after the fp8 scales, if any, and the group
    return a.new_empty((a.shape[0] // world_size, b.shape[1]), dtype=out_dtype)


def gathered_matmul(a, b, group, world_size, return_a, config) -> list[torch.Tensor]:
    rows = world_size * a.shape[0]
    out = a.new_empty((rows, b.shape[1]))
    return [a.new_empty((rows, a.shape[1])), out] if return_a else [out]


def gathered_matmul_fp8(a, b, scale_a, scale_b, group, world_size, config) -> torch.Tensor:
    return a.new_empty((world_size * a.shape[0], b.shape[1]), dtype=torch.bfloat16)


# ---------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One public recipe (and its twin) as an operator.

    ``fake(*operator arguments)`` gives the outputs' shapes and dtypes. ``returns``: the schema's return
    type. ``mutates``: the arguments the recipe writes. ``to_op``: the recipe's result as the operator
    returns it (no result for an in-place recipe; outputs never alias inputs), and ``from_op(result,
    arguments)``: the operator's result as the front door returns it (``arguments``: the recipe's, by name).
    """

    name: str
    fake: Callable
    returns: str = "Tensor"
    mutates: tuple[str, ...] = ()
    to_op: Callable = staticmethod(lambda result: result)
    from_op: Callable = staticmethod(lambda result, arguments: result)


def in_place(result, arguments):
    return arguments["tensor"]


def as_list(result) -> list[torch.Tensor]:
    """``all_gather_matmul``'s result: ``out``, or ``(gathered a, out)`` with the gathered ``a`` contiguous."""
    return [result[0].contiguous(), result[1]] if isinstance(result, tuple) else [result]


ENTRIES = {
    entry.name: entry
    for entry in (
        # kraken.comm
        Entry("one_shot_all_reduce", like_first),
        Entry("two_shot_all_reduce", writes_first, returns="()", mutates=("tensor",),
              to_op=lambda result: None, from_op=in_place),
        Entry("reduce_scatter", scattered),
        Entry("all_gather", gathered),
        # kraken.fused
        Entry("one_shot_all_reduce_bias", like_first),
        Entry("one_shot_all_reduce_bias_rms_norm", like_first),
        Entry("two_shot_all_reduce_bias", like_first),
        Entry("two_shot_all_reduce_bias_rms_norm", like_first),
        Entry("rms_norm", like_first),
        Entry("gemm_one_shot_all_reduce", gemm_all_reduced),
        Entry("gemm_reduce_scatter", gemm_scattered),
        Entry("gemm_reduce_scatter_fp8", gemm_scattered),
        Entry("all_gather_matmul", gathered_matmul, returns="Tensor[]", to_op=as_list,
              from_op=lambda result, arguments: tuple(result) if arguments["return_a"] else result[0]),
        Entry("all_gather_matmul_fp8", gathered_matmul_fp8),
        Entry("context_parallel_attention", like_first),
    )
}


# ---------------------------------------------------------------------------
# Registration and front doors
# ---------------------------------------------------------------------------

SCHEMA_TYPES = {  # a recipe parameter's annotation -> its type in the operator's schema
    "torch.Tensor": "Tensor",
    "dist.ProcessGroup | str | None": "str?",
    "bool": "bool",
    "float": "float",
    "float | None": "float?",
    "int": "SymInt",
    "int | None": "SymInt?",
    "torch.dtype": "ScalarType",
}


def schema_of(recipe: Callable, entry: Entry) -> str:
    """The operator's schema: the recipe's parameters in order (``group`` as ``str? group, int world_size``,
    ``**config`` as ``str config``), no defaults (the front door passes every argument)."""
    params = []
    for param in inspect.signature(recipe).parameters.values():
        if param.kind is param.VAR_KEYWORD:
            params.append(f"str {param.name}")
            continue
        kind = SCHEMA_TYPES[str(param.annotation)]
        if param.name in entry.mutates:
            kind = f"{kind}(a!)"
        params.append(f"{kind} {param.name}")
        if param.name == "group":
            params.append("int world_size")
    return f"({', '.join(params)}) -> {entry.returns}"


def register(recipe: Callable, entry: Entry, namespace: str):
    """``torch.ops.<namespace>.<name>``: calls ``recipe``; ``entry.fake`` under fake tensors."""
    parameters = inspect.signature(recipe).parameters
    has_config = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    size_at = list(parameters).index("group") + 1 if "group" in parameters else None  # world_size's position

    def implementation(*args):
        if size_at is not None:
            group, size, actual = args[size_at - 1], args[size_at], world_size(args[size_at - 1])
            if size != actual:
                raise RuntimeError(f"{entry.name}: called with world_size={size}, but the group "
                                   f"({group or 'default'}) has {actual} ranks")
            args = args[:size_at] + args[size_at + 1:]
        if has_config:
            return entry.to_op(recipe(*args[:-1], **decode_config(args[-1])))
        return entry.to_op(recipe(*args))

    implementation.__name__ = entry.name
    op = torch.library.custom_op(
        f"{namespace}::{entry.name}", implementation, mutates_args=entry.mutates, schema=schema_of(recipe, entry)
    )
    op.register_fake(entry.fake)
    return op


def front_door(recipe: Callable, entry: Entry, op) -> Callable:
    """``recipe`` in eager, ``op`` while Dynamo traces; the recipe's signature and docstring."""
    parameters = inspect.signature(recipe).parameters
    defaults = {n: p.default for n, p in parameters.items() if p.default is not p.empty}
    config_name = next((n for n, p in parameters.items() if p.kind is p.VAR_KEYWORD), None)
    positional = tuple(n for n in parameters if n != config_name)
    # Dynamo traces this check as True; in eager it is a bare ``return False`` (``is_compiling()`` costs
    # twice as much: it asks ``torch.jit.is_scripting()`` first). ``torch.export`` must run strict (Dynamo).
    tracing = torch.compiler.is_dynamo_compiling

    @functools.wraps(recipe)
    def call(*args, **kwargs):
        if not tracing():
            return recipe(*args, **kwargs)
        arguments = dict(defaults)
        arguments.update(zip(positional, args))
        arguments.update(kwargs)
        config = {k: v for k, v in arguments.items() if k not in positional}
        values = []
        for n in positional:
            if n == "group":  # its name, then its size, a constant in the graph (see the module docstring)
                name = group_name(arguments[n])
                values += [name, world_size(name)]
            else:
                values.append(arguments[n])
        if config_name is not None:
            values.append(encode_config(config))
        return entry.from_op(op(*values), arguments)

    call.op = op
    return call


def install_front_doors(package: str, namespace: str) -> None:
    """Register every recipe of ``ENTRIES`` exported by module ``package`` (``kraken.runtime.api``, ``.twins``,
    which call this last) under ``torch.ops.<namespace>`` and put its front door there and in the module that
    defines it (``kraken.x is <its module>.x``)."""
    exports = sys.modules[package]
    for name, entry in ENTRIES.items():
        recipe = getattr(exports, name, None)
        if recipe is None or hasattr(recipe, "op"):
            continue
        door = front_door(recipe, entry, register(recipe, entry, namespace))
        setattr(exports, name, door)
        home = sys.modules[recipe.__module__]
        if getattr(home, name, None) is recipe:  # (a twin made by a factory there is not that module's own)
            setattr(home, name, door)
    from kraken.runtime import moe_ops  # the MoE pair, whose handle crosses as tensors (it imports this module)

    moe_ops.install_front_doors(exports, namespace)
