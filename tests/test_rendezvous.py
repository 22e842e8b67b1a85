"""The host rendezvous before a process's first megakernel launch (flashmoe.buffers.rendezvous), on gloo.

EP ranks reach their first MoE call far apart at start-up (per-rank torch.compile); the first launch waits
for all of them on the host, bounded, instead of spending the skew in the kernel's own bounded waits.
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist
from flashmoe.buffers import rendezvous
from flashmoe.errors import FlashMoETimeoutError
from multiproc import init_cpu_rank, run_ranks

LATE_S = 2.0


def _late_rank(rank: int, world: int, port: int, results) -> None:
    init_cpu_rank(rank, world, port)
    if rank == 1:
        time.sleep(LATE_S)  # the rank whose compile took longer
    t0 = time.monotonic()
    rendezvous(dist.group.WORLD, world, timeout_s=30)
    results[rank] = time.monotonic() - t0


def _absent_rank(rank: int, world: int, port: int, results) -> None:
    init_cpu_rank(rank, world, port)
    if rank == 1:
        time.sleep(8)  # never comes within the bound
        return
    t0 = time.monotonic()
    try:
        rendezvous(dist.group.WORLD, world, timeout_s=2)
        results[rank] = "returned"
    except FlashMoETimeoutError as e:
        results[rank] = (time.monotonic() - t0, str(e))


def _shared_dict():
    import torch.multiprocessing as mp

    return mp.get_context("spawn").Manager().dict()


def test_first_launch_waits_for_a_late_rank():
    results = _shared_dict()
    run_ranks(_late_rank, 2, (results,), timeout=60)
    assert results[0] >= LATE_S - 0.5  # the early rank waited for the late one
    assert results[1] < LATE_S  # the late one found it waiting


def test_a_rank_that_never_comes_is_reported_within_the_bound():
    results = _shared_dict()
    run_ranks(_absent_rank, 2, (results,), timeout=60)
    waited, message = results[0]
    assert 1.5 <= waited < 8, waited
    assert "not every EP rank reached its first MoE call within 2 s" in message


def test_world_one_and_no_group_return_at_once():
    t0 = time.monotonic()
    rendezvous(None, 4)
    rendezvous(object(), 1)
    assert time.monotonic() - t0 < 0.1


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
