"""Run a function on one process per GPU, with a watchdog; shared by the harness and the tests.

``spawn(fn, args, world_size)`` starts ``world_size`` processes, each with NCCL
initialised and its GPU selected, and calls ``fn(*args)`` in every one. Workers
report progress with ``heartbeat(label)``; if any rank goes ``stall_s`` seconds
without one (a barrier that never completes, say) every rank is killed and
``WorkerError`` names the rank and its last label. Exceptions on any rank are
re-raised in the parent with that rank's traceback.

Under ``torchrun`` the harness does not spawn: ``init_from_env`` uses the given world.

``KRAKEN_WORLD_SIZE=N`` with fewer than N GPUs visible puts several ranks on each GPU, for functional runs
only (the tests) on a host that lends fewer GPUs: the host-side collectives go through gloo (NCCL refuses two
ranks on one GPU) and torch's symmetric memory is told the devices overlap. The ranks' kernels time-slice on
the shared GPU, so every barrier still completes, but every timing taken so is meaningless.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

# Kept on, always: multicast (NVLS) can take the shared GPU host down.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

WORLD_SIZE_ENV = "KRAKEN_WORLD_SIZE"

_reports: Any = None  # the queue to the parent, in a spawned worker
_rank = 0


class WorkerError(RuntimeError):
    pass


def heartbeat(label: str) -> None:
    """Tell the watchdog this rank is making progress (no-op outside ``spawn``)."""
    if _reports is not None:
        _reports.put(("beat", _rank, label))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_world_size() -> int:
    """``KRAKEN_WORLD_SIZE`` if set (several ranks per GPU when it exceeds the GPU count), else the GPU count."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    value = os.environ.get(WORLD_SIZE_ENV, "")
    if not value:
        return count
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{WORLD_SIZE_ENV} must be a positive integer, got {value!r}")
    return int(value)


def init(rank: int, world_size: int, local_rank: int | None = None, local_world_size: int | None = None) -> None:
    """This process's GPU and process group: NCCL, one rank per GPU; gloo when the node's ranks outnumber its
    GPUs (see the module docstring)."""
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    local_rank = rank if local_rank is None else local_rank
    local_world_size = world_size if local_world_size is None else local_world_size
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise RuntimeError(f"rank {rank}: no CUDA GPU is visible")
    torch.cuda.set_device(local_rank % count)
    if local_world_size > count:  # functional runs only: see the module docstring
        if not os.environ.get(WORLD_SIZE_ENV):
            raise RuntimeError(
                f"{local_world_size} ranks on this node but {count} GPU(s): run one rank per GPU, or set "
                f"{WORLD_SIZE_ENV}={local_world_size} for a functional run on shared GPUs (no timing means anything there)"
            )
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    else:
        dist.init_process_group(
            "nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", torch.cuda.current_device())
        )


def init_from_env() -> None:
    """Initialise from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_*)."""
    env = os.environ
    world_size = int(env["WORLD_SIZE"])
    init(int(env["RANK"]), world_size, int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", world_size)))


def _worker(rank: int, world_size: int, port: int, reports, fn: Callable, args: tuple) -> None:
    global _reports, _rank
    _reports, _rank = reports, rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        init(rank, world_size)
        heartbeat("initialised")
        result = fn(*args)
        torch.cuda.synchronize()
        dist.destroy_process_group()
        reports.put(("done", rank, result))
    except BaseException:  # report everything, including KeyboardInterrupt in a child
        reports.put(("error", rank, traceback.format_exc()))


class _PortTaken(Exception):
    """The rendezvous port was taken between ``_free_port`` and rank 0's store binding it (another process)."""


def spawn(fn: Callable, args: tuple = (), world_size: int | None = None, stall_s: float = 60.0, name: str = "") -> list:
    """Run ``fn(*args)`` on ``world_size`` ranks, one per GPU (default: ``default_world_size()``); returns each
    rank's result. Where another process took the rendezvous port before the ranks bound it (many launches side by
    side), up to ``PORT_ATTEMPTS`` fresh ports are tried, ``fn`` never having started."""
    world_size = default_world_size() if world_size is None else world_size
    for _ in range(PORT_ATTEMPTS):
        try:
            return _spawn_once(fn, args, world_size, stall_s, name)
        except _PortTaken:
            pass
    raise WorkerError(f"{name or fn.__name__}: the rendezvous port was taken {PORT_ATTEMPTS} times")


PORT_ATTEMPTS = 3


def _spawn_once(fn: Callable, args: tuple, world_size: int, stall_s: float, name: str) -> list:
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, reports, fn, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    last_beat = {r: (time.monotonic(), "starting") for r in range(world_size)}
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        while len(results) + len(errors) < world_size:
            try:
                kind, rank, payload = reports.get(timeout=1.0)
            except queue.Empty:
                kind = None
            now = time.monotonic()
            if kind == "beat":
                last_beat[rank] = (now, payload)
            elif kind == "done":
                results[rank] = payload
            elif kind == "error":
                errors[rank] = payload
                break  # the other ranks may now be stuck in a collective: stop them
            for rank, (t, label) in last_beat.items():
                if rank not in results and now - t > stall_s:
                    raise WorkerError(
                        f"{name or fn.__name__}: rank {rank} made no progress for {stall_s:.0f} s after "
                        f"{label!r} (hung barrier?); all ranks killed"
                    )
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in errors]
            if dead and not errors:
                # A worker died without reporting (segfault, illegal address, OOM kill).
                time.sleep(1.0)
                if reports.empty():
                    raise WorkerError(
                        f"{name or fn.__name__}: rank {dead[0]} died with exit code {procs[dead[0]].exitcode} after "
                        f"{last_beat[dead[0]][1]!r}"
                    )
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        rank = min(errors)
        if "EADDRINUSE" in errors[rank] and all(label == "starting" for _, label in last_beat.values()):
            raise _PortTaken()
        raise WorkerError(f"{name or fn.__name__}: rank {rank} failed:\n{errors[rank]}")
    return [results[r] for r in range(world_size)]


def print_rank0(*args, **kwargs) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def require_gpus(op_hint: str) -> int:
    """Exit with one clear sentence if no GPU is visible, or if ranks would share one; returns the GPU count.
    One GPU runs world size 1: the cores and the host path, measured for real."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 1:
        sys.exit(f"{op_hint} needs at least 1 CUDA GPU (one process per GPU; 2 to 8 NVLink-connected GPUs "
                 "time the exchange, 1 GPU times the cores at world size 1); found no CUDA GPU.")
    ranks = default_world_size()
    if ranks > count:
        sys.exit(f"{op_hint} times kernels, one rank per GPU: unset {WORLD_SIZE_ENV} ({ranks} ranks, {count} GPUs); "
                 "ranks that share a GPU time-slice it.")
    return count
