"""Where a result was measured: the fields every result row carries and every printed table names.

``collect`` runs on the GPU host at the start of a benchmark run; ``describe`` turns the fields
into the one line printed above each table (and above each section of ``docs/results.md``).
A field that cannot be read says ``unknown`` rather than guessing.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import re
import subprocess

import torch

FIELDS = ("gpu", "gpu_count", "driver", "nvlinks", "torch", "triton", "helion", "commit", "date", "iters",
          "warmup", "burst")
UNKNOWN = "unknown"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _command(args: list[str]) -> str | None:
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=20, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def _version(package: str) -> str:
    """The installed distribution's version (helion 1.5.0 has no ``__version__``)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return getattr(__import__(package), "__version__", UNKNOWN)


def commit() -> str:
    """The project's commit: ``KRAKEN_COMMIT`` if set (a copied tree has no ``.git``), else git's, with
    ``-dirty`` when tracked files differ from it."""
    if os.environ.get("KRAKEN_COMMIT"):
        return os.environ["KRAKEN_COMMIT"]
    head = _command(["git", "rev-parse", "--short=10", "HEAD"])
    if head is None:
        return UNKNOWN
    return head + ("-dirty" if _command(["git", "status", "--porcelain", "--untracked-files=no"]) else "")


def active_nvlinks(status: str | None) -> int | None:
    """Active links of the first GPU in ``nvidia-smi nvlink --status -i 0`` output (one ``Link N: x GB/s``
    line per active link)."""
    if not status:
        return None
    return len(re.findall(r"Link \d+: [\d.]+ GB/s", status))


def collect(iters: int, warmup: int, burst: int) -> dict:
    """The provenance fields of this run (call on the GPU host, after the device is selected)."""
    driver = _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"])
    links = active_nvlinks(_command(["nvidia-smi", "nvlink", "--status", "-i", "0"]))
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else UNKNOWN,
        "gpu_count": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
        "driver": driver or UNKNOWN,
        "nvlinks": UNKNOWN if links is None else links,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "helion": _version("helion"),
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "iters": iters,
        "warmup": warmup,
        "burst": burst,
    }


def describe(meta: dict) -> str:
    """One line: ``2x NVIDIA H200, 18 NVLinks, driver 580.1, torch 2.11.0 / triton 3.6.0 / helion 1.5.0,
    commit abc, 2026-11-23 07:00 UTC, 100 iters (10 warm-up) in bursts of 10``."""
    get = lambda key: meta.get(key, UNKNOWN)  # noqa: E731 (rows written before a field existed)
    return (f"{get('gpu_count')}x {get('gpu')}, {get('nvlinks')} NVLinks, driver {get('driver')}, "
            f"torch {get('torch')} / triton {get('triton')} / helion {get('helion')}, commit {get('commit')}, "
            f"{get('date')}, {get('iters')} iters ({get('warmup')} warm-up) in bursts of {get('burst')}")
