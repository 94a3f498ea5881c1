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
* ``library``: the recipes as ``torch.library`` operators, and their front doors; ``moe_ops``: the MoE pair as
  operators, the dispatch's handle crossing as tensors;
* ``helion_run``: the twins' Helion kernels run through a prepared call's ``Launcher`` (their host code replayed);
* ``api``, ``twins``: the public functions ``kraken.<name>`` and ``helion_ports.<name>``, gathered (the packages load
  them on first use) and installed as operators.

Per family, the checks, prepared calls and the factories (``<name>_with(launch, op)``) that make the installed
function of a recipe and of its twin around their ``launch``:

* ``collectives``: one-shot and two-shot all-reduce, reduce-scatter, all-gather (one ``check``) and the ``all_reduce``
  front door;
* ``bias_norm``: the all-reduce + bias (+ RMSNorm) family and ``rms_norm``; ``bias_doors``: its front doors;
* ``moe``: the MoE pair (checks, buffers, the handle);
* ``progress``: the copy-engine gather (the side stream, kept events, graphs), and the primitives
  context-parallel attention exchanges K/V with;
* ``gather_matmul``: the all-gather + matmul recipes (checks, forms, workspaces); ``gemm_checks``: the GEMM checks;
* ``gemm_reduce_scatter``, ``gemm_reduce_scatter_fp8``, ``gemm_all_reduce``: the reduce GEMMs (forms, workspaces);
* ``attention``: context-parallel attention (caches of tile orders, the exchange, the calls in pieces, graphs,
  ``attention_on_gathered``); ``attention_checks``: its checks.

Functions that tests replace (``groups.check_tensor``, ``symm.symm_context``, ...) are called through their
module (``symm.symm_context(...)``), so that replacing one there replaces it for every
caller. The launcher's and the replays' names, which run on every warm call, are imported by name.
"""
