"""The product layer: what makes the installed recipes fast and safe, wrapped around them from outside.

One module per topic (importing this package imports none of them):

* ``groups``: process groups and the world size, argument and config checks, the signal pad's budget, and the
  integer helpers plans use (``cdiv``, ``round_up``, ``persistent_grid``);
* ``agreement``: validate locally, agree globally (``agreed``): one rank's bad input raises on every rank;
* ``symm``: symmetric buffers (``symm_empty``, ``symm_context``, ``is_symmetric``), the shared and block-owned
  symmetric workspaces, local scratch and local barrier pads;
* ``timeout``: the barrier timeout's host half (the report page, the watchdog thread);
* ``prepared``: a prepared call per call signature (``per_signature`` and its keys, ``forget_prepared_calls``);
* ``launcher``: launching a prepared call's kernels (``jit_launch``, the cached ``Launcher``, TMA operands);
* ``replay``: replaying a call's launches with no host code (``Replay``, ``record_replay``, ``replayed``);
* ``graphs``: a call's work kept and replayed as CUDA graphs (``graphed``, ``forked``);
* ``staging``: ordinary tensors into the symmetric-memory collectives (their two prepared calls);
* ``crossover``: one-shot or two-shot, fused or sequential, by size and world size (the front doors' table);
* ``library``: the recipes as ``torch.library`` operators, and their front doors.
* ``moe``: the MoE pair's product layer (checks, buffers, the handle, the installed dispatch and combine);
* ``moe_ops``: the MoE pair as operators, the dispatch's handle crossing as tensors.
* ``collectives``: the product layer of the collective recipes (one ``check``, the prepared calls, the public
  functions ``kraken.<name>`` and ``helion_ports.<name>`` of the four collectives, and the all-reduce front door);
* ``gemm_checks``: the GEMM recipes' argument checks.
* ``progress``: the copy-engine gather's product layer (``kraken.all_gather_with_progress``: prepared calls, the side
  stream, kept events, graphs), and the primitives ``context_parallel_attention`` exchanges K/V with;
* ``gather_matmul``: the all-gather + matmul recipes' product layer (checks, forms, prepared calls, workspaces).
* ``bias_norm``: the all-reduce + bias (+ RMSNorm) family's product layer (checks, prepared calls on the shared
  workspace, the public functions); ``bias_doors``: its front doors, ``all_reduce_bias[_rms_norm]``.

Functions that tests replace (``groups.check_tensor``, ``symm.symm_context``, ...) are called through their
module (``symm.symm_context(...)``), here and in the recipes, so that replacing one there replaces it for every
caller. The launcher's and the replays' names, which run on every warm call, are imported by name.
"""
