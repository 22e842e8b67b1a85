"""The rates the floor divides by, measured at the start of every run on the same GPUs.

* GEMM: a large square bf16 matmul (8192³ on GPU), FLOP/s.
* fp8 GEMM (``--dtype fp8`` runs): the same square shape as e4m3 x e4m3 -> bf16 ``torch._scaled_mm`` with
  per-tensor scales and fast accumulation, the fastest fp8 GEMM cuBLAS offers, so the floor built on it
  stays a lower bound. Beside it, for information only (the floor does not use it), the block-scaled
  recipe the fp8 layer computes: 1x128 activation and 128x128 weight scales (``fp8_blockwise``; None
  where torch has no such GEMM on the device, e.g. on a CPU).
* Copy: a large device-to-device copy (1 GiB on GPU), bytes read + bytes written per second.
* Link: one GPU's copy engine writing into its neighbour's memory (rank 0's GPU -> the next
  visible GPU, 1 GiB), bytes per second one way — the NVLink rate a dispatch or combine can hope
  for. Falls back to a timed send/recv between ranks 0 and 1 (NCCL on GPU, gloo on CPU) when the
  process cannot reach a second GPU. With one rank there is no link term and the rate is 0.

Each rank measures GEMM and copy on its own GPU; the floor uses the fastest rank (the floor is a
lower bound). All per-rank numbers go into the JSON.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .floor import Rates
from .ranks import Ranks


@dataclass(frozen=True)
class RateSizes:
    gemm_n: int
    copy_bytes: int
    link_bytes: int
    iters: int

    @staticmethod
    def for_device(device: torch.device) -> RateSizes:
        if device.type == "cuda":
            return RateSizes(gemm_n=8192, copy_bytes=1 << 30, link_bytes=1 << 30, iters=10)
        return RateSizes(gemm_n=512, copy_bytes=64 << 20, link_bytes=16 << 20, iters=5)


@dataclass
class MeasuredRates:
    rates: Rates
    gemm_flops_per_rank: list[float]
    copy_bytes_per_rank: list[float]
    link_method: str
    sizes: RateSizes
    fp8_gemm_flops_per_rank: list[float] | None = None  # measured only for --dtype fp8
    fp8_blockwise_flops_per_rank: list[float | None] | None = None  # information; None where unsupported
    fp8_blockwise_note: str | None = None

    def to_json(self) -> dict:
        fp8 = self.fp8_gemm_flops_per_rank is not None
        blockwise = [x for x in self.fp8_blockwise_flops_per_rank or [] if x is not None]
        return {
            "gemm_tflops": self.rates.gemm_flops / 1e12,
            "copy_GBps": self.rates.copy_bytes / 1e9,
            "link_GBps": self.rates.link_bytes / 1e9,
            "fp8_gemm_tflops": self.rates.fp8_gemm_flops / 1e12 if fp8 else None,
            "fp8_blockwise_gemm_tflops": max(blockwise) / 1e12 if blockwise else None,
            "gemm_tflops_per_rank": [x / 1e12 for x in self.gemm_flops_per_rank],
            "copy_GBps_per_rank": [x / 1e9 for x in self.copy_bytes_per_rank],
            "fp8_gemm_tflops_per_rank": [x / 1e12 for x in self.fp8_gemm_flops_per_rank] if fp8 else None,
            "fp8_blockwise_gemm_tflops_per_rank": [
                None if x is None else x / 1e12 for x in self.fp8_blockwise_flops_per_rank
            ]
            if fp8
            else None,
            "link_method": self.link_method,
            "gemm": f"bf16 matmul {self.sizes.gemm_n}^3, median of {self.sizes.iters}",
            "fp8_gemm": f"e4m3 torch._scaled_mm {self.sizes.gemm_n}^3 -> bf16, per-tensor scales, fast accumulation, "
            f"median of {self.sizes.iters}"
            if fp8
            else None,
            "fp8_blockwise_gemm": (
                f"e4m3 torch._scaled_mm {self.sizes.gemm_n}^3 -> bf16, 1x128 x 128x128 block scales "
                f"(information, not used by the floor){': ' + self.fp8_blockwise_note if self.fp8_blockwise_note else ''}"
            )
            if fp8
            else None,
            "copy": f"device copy of {self.sizes.copy_bytes >> 20} MiB, read+write counted, median of {self.sizes.iters}",
            "link": f"{self.sizes.link_bytes >> 20} MiB one way, median of {self.sizes.iters}",
            "floor_uses": "fastest rank for gemm, fp8 gemm and copy",
        }


def _median_seconds(fn, device: torch.device, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_flops(device: torch.device, n: int, iters: int) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    s = _median_seconds(lambda: torch.mm(a, b, out=c), device, iters)
    return 2.0 * n**3 / s


def fp8_gemm_flops(device: torch.device, n: int, iters: int) -> float:
    """e4m3 [n, n] x e4m3 [n, n] -> bf16 with per-tensor scales and fast accumulation, FLOP/s."""
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device=device)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)

    def mm():
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True, out=c)

    return 2.0 * n**3 / _median_seconds(mm, device, iters)


def fp8_blockwise_gemm_flops(device: torch.device, n: int, iters: int) -> tuple[float | None, str | None]:
    """(FLOP/s or None, why None) of the block-scaled recipe: 1x128 scales on A (outer-dim-major),
    128x128 scales on B, -> bf16."""
    if n % 128:
        return None, f"n={n} is not a multiple of 128"
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
    scale_a = torch.rand(n // 128, n, device=device).add_(0.5).t()  # [n, n/128], stride (1, n)
    # scale_b.t() is [N/128, K/128] row-major: the 128x128 layout.
    scale_b = torch.rand(n // 128, n // 128, device=device).add_(0.5).t()
    try:
        s = _median_seconds(
            lambda: torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16),
            device,
            iters,
        )
    except Exception as e:  # no block-scaled fp8 GEMM in this torch on this device
        return None, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:200]
    return 2.0 * n**3 / s, None


def copy_bytes(device: torch.device, nbytes: int, iters: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    s = _median_seconds(lambda: dst.copy_(src), device, iters)
    return 2.0 * nbytes / s  # read + write


def _peer_copy_bytes(device: torch.device, nbytes: int, iters: int) -> tuple[float, str] | None:
    """Copy-engine write from ``device`` into the next visible GPU; None if there is none."""
    count = torch.cuda.device_count()
    if count < 2:
        return None
    peer = torch.device("cuda", (device.index + 1) % count)
    access = torch.cuda.can_device_access_peer(device.index, peer.index)
    seconds = _timed_peer_copy(device, peer, nbytes, iters)
    torch.cuda.synchronize(peer)
    torch.cuda.empty_cache()  # give the peer GPU its memory back before the benchmark proper
    return (
        nbytes / seconds,
        f"copy engine cuda:{device.index} -> cuda:{peer.index} (peer access {'on' if access else 'off'})",
    )


def _timed_peer_copy(device: torch.device, peer: torch.device, nbytes: int, iters: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=peer)
    # torch issues a cross-device copy on the source device's current stream, so events there bracket it.
    return _median_seconds(lambda: dst.copy_(src, non_blocking=True), device, iters)


def _send_recv_bytes(ranks: Ranks, nbytes: int, iters: int) -> float:
    """Rank 0 sends to rank 1; timed on rank 1 from a common barrier to the end of each receive."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=ranks.device).fill_(1)
    times = []
    for i in range(iters + 1):
        ranks.barrier()
        if ranks.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if ranks.rank == 0:
            dist.send(buf, dst=1, group=ranks.group)
        elif ranks.rank == 1:
            dist.recv(buf, src=0, group=ranks.group)
        if ranks.device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first transfer sets up the connection
            times.append(time.perf_counter() - t0)
    s = ranks.broadcast_float(statistics.median(times) if ranks.rank == 1 else 0.0, src=1)
    return nbytes / s


def link_bytes(ranks: Ranks, sizes: RateSizes) -> tuple[float, str]:
    """(bytes/s one way, how it was measured), the same on every rank."""
    if ranks.world == 1:
        return 0.0, "none (one rank: no link term)"
    dev = ranks.device
    if dev.type == "cuda":
        ranks.barrier()
        torch.cuda.synchronize()
        found = _peer_copy_bytes(dev, sizes.link_bytes, sizes.iters) if ranks.rank == 0 else None
        have_peer = ranks.broadcast_float(1.0 if found else 0.0) > 0.5
        if have_peer:
            rate = ranks.broadcast_float(found[0] if found else 0.0)
            return rate, found[1] if found else "copy engine (measured on rank 0)"
        return _send_recv_bytes(
            ranks, sizes.link_bytes, sizes.iters
        ), "NCCL send/recv rank 0 -> 1 (no second GPU visible to rank 0)"
    return _send_recv_bytes(
        ranks, sizes.link_bytes, sizes.iters
    ), "gloo send/recv rank 0 -> 1 (CPU smoke run)"


def measure_rates(ranks: Ranks, fp8: bool = False) -> MeasuredRates:
    """``fp8``: also the fp8 GEMM rates (``--dtype fp8``)."""
    sizes = RateSizes.for_device(ranks.device)
    g = gemm_flops(ranks.device, sizes.gemm_n, sizes.iters)
    c = copy_bytes(ranks.device, sizes.copy_bytes, sizes.iters)
    f8, block, block_note = 0.0, None, None
    if fp8:
        f8 = fp8_gemm_flops(ranks.device, sizes.gemm_n, sizes.iters)
        block, block_note = fp8_blockwise_gemm_flops(ranks.device, sizes.gemm_n, sizes.iters)
    if ranks.device.type == "cuda":
        torch.cuda.empty_cache()
    per_rank = ranks.gather([g, c, f8, -1.0 if block is None else block])
    link, method = link_bytes(ranks, sizes)
    gemm_all = [r[0] for r in per_rank]
    copy_all = [r[1] for r in per_rank]
    fp8_all = [r[2] for r in per_rank] if fp8 else None
    block_all = [r[3] if r[3] >= 0 else None for r in per_rank] if fp8 else None
    return MeasuredRates(
        Rates(max(gemm_all), max(copy_all), link, max(fp8_all) if fp8 else 0.0),
        gemm_all,
        copy_all,
        method,
        sizes,
        fp8_all,
        block_all,
        block_note,
    )
