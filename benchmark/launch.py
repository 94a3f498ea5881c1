"""Run a function on one process per GPU, with a watchdog; shared by the harness and the tests.

``spawn(fn, args, world_size)`` starts ``world_size`` processes, each with NCCL
initialised and its GPU selected, and calls ``fn(*args)`` in every one. Workers
report progress with ``heartbeat(label)``; if any rank goes ``stall_s`` seconds
without one (a barrier that never completes, say) every rank is killed and
``WorkerError`` names the rank and its last label. Exceptions on any rank are
re-raised in the parent with that rank's traceback.

Under ``torchrun`` the harness does not spawn: ``init_from_env`` uses the given world.
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


def init(rank: int, world_size: int) -> None:
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        "nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", torch.cuda.current_device())
    )


def init_from_env() -> None:
    """Initialise from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*)."""
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))


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


def spawn(fn: Callable, args: tuple = (), world_size: int | None = None, stall_s: float = 60.0, name: str = "") -> list:
    """Run ``fn(*args)`` on ``world_size`` GPUs (default: all visible); returns each rank's result."""
    world_size = torch.cuda.device_count() if world_size is None else world_size
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
                    raise WorkerError(f"{name or fn.__name__}: rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        rank = min(errors)
        raise WorkerError(f"{name or fn.__name__}: rank {rank} failed:\n{errors[rank]}")
    return [results[r] for r in range(world_size)]


def print_rank0(*args, **kwargs) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def require_gpus(op_hint: str) -> int:
    """Exit with one clear sentence if fewer than 2 GPUs are visible; returns the GPU count."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        found = "no CUDA GPU" if count == 0 else "1 CUDA GPU"
        sys.exit(f"{op_hint} needs at least 2 NVLink-connected CUDA GPUs (one process per GPU); found {found}.")
    return count
