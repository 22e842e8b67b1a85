"""Run one function on N spawned rank processes with a hard deadline (tests and the GPU matrix runner).

``run_ranks(fn, world, args, timeout)`` calls ``fn(rank, world, port, *args)`` in ``world`` fresh
``spawn`` processes and returns when all exit 0. A rank that raises is re-raised here with its
traceback (the others are terminated); ranks still alive at the deadline are killed and
:class:`RanksTimedOut` is raised. Nothing this module starts can outlive the call, so a hung collective
fails one test instead of the whole session.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# NVLink multicast (NVLS) is absent on the test machines; every rank process turns it off before
# NCCL, torch symmetric memory or NVSHMEM initialise.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


class RanksTimedOut(RuntimeError):
    """Some rank processes were still running at the deadline (they have been killed)."""


def free_port() -> int:
    """A TCP port that was free a moment ago (the rendezvous binds it again right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_method(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


def init_cpu_rank(rank: int, world: int, port: int) -> None:
    """Call first thing in a CPU rank process: one thread (ranks share the machine's cores), gloo group."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init_method(port), rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )


def apply_rank_env(extra: dict[str, str] | None = None) -> None:
    """Call first thing in a rank process: multicast off, plus per-run variables."""
    os.environ.update(NO_MULTICAST_ENV)
    if extra:
        os.environ.update(extra)


def init_one_gpu_rank(store_prefix: str) -> tuple[torch.device, dist.ProcessGroup]:
    """Call first thing in a world-1 GPU rank process: multicast off, GPU 0, an NCCL world over a file store (no
    port to collide with whatever else the machine runs). Returns the device and a gloo group for the host side."""
    import tempfile

    apply_rank_env()
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    store = dist.FileStore(tempfile.mktemp(prefix=store_prefix), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    return device, dist.new_group(backend="gloo")


def run_ranks(fn, world: int, args: tuple = (), timeout: float = 60.0) -> None:
    """Run ``fn(rank, world, port, *args)`` on ``world`` processes; raise on failure or past ``timeout`` s."""
    port = free_port()
    ctx = mp.start_processes(fn, args=(world, port, *args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic()), grace_period=5.0):
            if time.monotonic() >= deadline:
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                raise RanksTimedOut(f"ranks {alive} of {world} still running after {timeout:.0f} s (killed)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join(timeout=10)
