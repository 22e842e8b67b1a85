"""DeepEP's low-latency (LL) kernels as a baseline: the strongest EP communication path of vLLM and SGLang on
Hopper (``--all2all-backend deepep_low_latency``, SGLang's ``--deepep-mode low_latency``).

One layer: ``Buffer.low_latency_dispatch`` (bf16, or fp8 with per-token 128-channel scales) leaves every token
routed to this rank in DeepEP's *masked* per-expert layout ``[E_local, W * T_cap, H]`` with a per-expert count
(rows ``[0, count)`` of each expert are valid, the rest are garbage); the valid rows are packed back to back
(one gather), run through the same grouped SwiGLU GEMMs as every baseline (``torch._grouped_mm`` on the
device-side offsets), scattered back into the masked layout (one index_copy), and ``Buffer.low_latency_combine``
returns each token's weighted sum over its k experts to its own rank. No host synchronisation and no
``return_recv_hook``, so a serving step of these layers is one CUDA graph, as vLLM captures it.

* ``deepep_ll``: bf16 dispatch. ``deepep_ll_fp8``: fp8 dispatch (DeepEP casts on the send side), dequantised
  after the pack, bf16 GEMMs (the weights are bf16); checked against the reference on the same fp8-rounded
  input (:func:`fp8_roundtrip`, DeepEP's own cast), since the rounding is the method's, not an error.
* ``deepep_ll_comm``: dispatch then combine of the received rows unchanged, no GEMM: DeepEP's communication
  alone. Its output is ``x * sum_j w[t, j]``, which is what it is checked against.

The pack bound (how many rows the gather moves) is this rank's received row count, known from the routing
when the inputs are made, as compute_only's shapes are; a masked grouped GEMM (DeepGEMM's, vLLM's batched
Triton experts) reads the masked layout in place and would skip the gather and the scatter, so the pack costs
DeepEP two row copies that a production path does not pay (measured separately: see ``deepep_ll_comm`` and
``compute_only``). Without the known count the bound is min(E_local * W * T_cap, W * T * k).

DeepEP V1 (commit 567632d, built by ``scripts/build-deepep.sh``): its LL kernels reach intranode peers through
NVSHMEM P2P pointers over NVLink. The build relaxes one device assertion (a QP per local expert even where none
is used), so the kernels run with NVSHMEM initialised without IBGDA: by flashmoe, which layer_bench sets up first. It needs contiguous expert placement (expert e on rank e // E_local), every
rank dispatching with the same ``T_cap``, H in its compiled set, and the buffer's parity state: every layer is
one dispatch and one combine, so an even number of LL kernels per call keeps graphs and eager calls in step.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
from dataclasses import dataclass, field

import torch

from .grouped_gemm import MM_LOOP

VARIANTS = ("deepep_ll", "deepep_ll_fp8", "deepep_ll_comm")
FP8 = "deepep_ll_fp8"
COMM = "deepep_ll_comm"
# Hidden sizes DeepEP 567632d's LL kernels are compiled for (SWITCH_HIDDEN in csrc/kernels/launch.cuh).
SUPPORTED_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
# The LL buffer grows with E * T_cap * H (7.1 GiB per rank for DeepSeek-V3 at EP4 and 512 tokens): decode sizes.
DEFAULT_MAX_TOKENS = 512
FP8_MAX = 448.0  # e4m3
FP8_MARGIN = 1e-4  # DeepEP's amax floor (kFP8Margin)
BUILD_HINT = "build it with scripts/build-deepep.sh and put .carry/deepep/site on PYTHONPATH"


def _preload_nvshmem() -> None:
    """Load the pip NVSHMEM host library globally, so deep_ep_cpp's ``libnvshmem_host.so.3`` resolves to the
    very library torch and flashmoe use, without LD_LIBRARY_PATH."""
    try:
        import nvidia.nvshmem as nvshmem_pkg
    except ImportError:
        return
    for root in nvshmem_pkg.__path__:
        lib = os.path.join(root, "lib", "libnvshmem_host.so.3")
        if os.path.exists(lib):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            return


def deep_ep_version() -> str | None:
    try:
        return importlib.metadata.version("deep_ep")
    except importlib.metadata.PackageNotFoundError:
        return None


def load_deep_ep(device: torch.device):
    """(deep_ep module or None, version, reason it cannot run here or None)."""
    try:
        _preload_nvshmem()
        import deep_ep
    except Exception as e:  # missing, or built for another torch/NVSHMEM: say which
        return None, None, f"deep_ep not importable: {type(e).__name__}: {e} ({BUILD_HINT})"[:500]
    version = deep_ep_version() or "unknown version"
    if device.type != "cuda":
        return None, version, f"no CUDA device: deep_ep {version}'s LL kernels need Hopper GPUs and NVSHMEM"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return None, version, f"deep_ep {version} is built for sm_90; this GPU is sm_{major}{minor}"
    return deep_ep, version, None


def dispatch_capacity(tokens: int) -> int:
    """T_cap of a dispatch of ``tokens`` per rank: DeepEP's TMA paths want W * T_cap % 4 == 0."""
    return max(4, -(-tokens // 4) * 4)


def qp_depth(max_tokens: int) -> int:
    """NVSHMEM_QP_DEPTH DeepEP's Python asserts (>= 2 * (T_cap + 1)); its default 1024 covers T_cap <= 511."""
    need, depth = 2 * (dispatch_capacity(max_tokens) + 1), 1024
    while depth < need:
        depth *= 2
    return depth


def flashmoe_symmetric_bytes(tokens: int, hidden: int, top_k: int, world: int, blocks: int = 264) -> int:
    """flashmoe's symmetric heap for T tokens per rank (README, Memory: data + put-path staging), with the
    1.25x + 256 MiB headroom flashmoe.buffers gives it."""
    meta = world * tokens * (1 + top_k) * 4
    data = world * tokens * hidden * 2 + tokens * top_k * hidden * 2 + meta
    staging = tokens * hidden * 2 + meta + blocks * 32 * 1024
    return int((data + staging) * 1.25) + (256 << 20)


def packed_rows(counts: torch.Tensor, capacity: int, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(src [bound] int64, offs [E_local] int32) for packing the masked layout ``[E_local, capacity, H]``.

    ``src[p]`` is the flat row (``e * capacity + slot``) of packed row ``p`` when experts' valid rows are laid
    back to back in expert order; rows past the last valid one (``p >= counts.sum()``) get ``E_local *
    capacity``, one past the layout: a spare row to scatter into. ``offs`` are the cumulative ends, as
    ``torch._grouped_mm`` takes them, capped at ``bound`` (a bound below the real count leaves rows
    uncomputed, which the correctness check catches, rather than reading past the packed rows). All on the
    counts' device, no host synchronisation."""
    counts = counts.long()
    num = counts.numel()
    ends = counts.cumsum(0)
    starts = ends - counts
    p = torch.arange(bound, device=counts.device)
    e = torch.searchsorted(ends, p, right=True)  # num past the last valid row
    e_in = e.clamp(max=num - 1)
    src = torch.where(e < num, e_in * capacity + (p - starts[e_in]), num * capacity)
    return src, ends.clamp(max=bound).to(torch.int32)


def gather_rows(recv: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Rows ``src`` of the masked bf16 layout ``[E_local, capacity, H]`` (the spare index reads the last row)."""
    flat = recv.view(-1, recv.shape[-1])
    return flat.index_select(0, src.clamp(max=flat.shape[0] - 1))


def gather_rows_fp8(
    recv_q: torch.Tensor, scales: torch.Tensor, src: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rows ``src`` of DeepEP's fp8 layout, dequantised: ``recv_q [E_local, capacity, H]`` e4m3 and ``scales
    [E_local, capacity, H/128]`` fp32 (any strides; DeepEP's are column-major in the last two dims)."""
    num, capacity, hidden = recv_q.shape
    flat = src.clamp(max=num * capacity - 1)
    q = recv_q.view(torch.uint8).view(-1, hidden).index_select(0, flat).view(recv_q.dtype)
    s = scales[flat // capacity, flat % capacity]  # [bound, H/128]
    return (q.float().view(-1, s.shape[-1], 128) * s.unsqueeze(-1)).view(-1, hidden).to(dtype)


def scatter_rows(y: torch.Tensor, src: torch.Tensor, num_experts_local: int, capacity: int) -> torch.Tensor:
    """``[E_local, capacity, H]`` with packed row ``p`` at flat row ``src[p]``; rows no packed row maps to are
    left unset (combine reads only the valid ones), the spare row is dropped."""
    out = y.new_empty(num_experts_local * capacity + 1, y.shape[1])
    out.index_copy_(0, src, y)
    return out[: num_experts_local * capacity].view(num_experts_local, capacity, y.shape[1])


def fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """``x`` as DeepEP's fp8 dispatch delivers it: per token and 128 channels, amax = max(|x|, 1e-4), q =
    e4m3(x * 448 / amax) (round to nearest, saturating), back as q * amax / 448, in x's dtype."""
    T, H = x.shape
    xf = x.float().view(T, H // 128, 128)
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=FP8_MARGIN)
    q = (xf * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * (amax * (1.0 / FP8_MAX))).view(T, H).to(x.dtype)


def comm_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """What dispatch -> combine of the unchanged rows returns: ``x[t] * sum_j w[t, j]`` over the slots with an
    expert (fp32 sum, rounded once)."""
    w = torch.where(topk_ids >= 0, topk_weights.float(), 0.0).sum(1, keepdim=True)
    return (x.float() * w).to(x.dtype)


def received_rows(ids_all: torch.Tensor, local_experts: torch.Tensor, num_experts: int) -> int:
    """(token, expert) rows this rank's experts receive from every rank's routing ``ids_all [W, T, k]``:
    DeepEP's packed_recv_count summed (a repeated id counts twice, -1 not at all)."""
    flat = ids_all.flatten().long()
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)
    return int(counts[local_experts.to(counts.device)].sum())


@dataclass
class LowLatency:
    """One DeepEP LL buffer for the process, sized for the largest layer and ``max_tokens``."""

    deep_ep: object
    buffer: object
    world: int
    max_tokens: int
    num_rdma_bytes: int
    layout: tuple | None = field(default=None)  # (T_cap, H, E) of the last call: a change cleans the buffer

    @staticmethod
    def rdma_bytes(deep_ep, shapes, max_tokens: int, world: int) -> int:
        """``shapes``: (hidden, num_experts) pairs."""
        cap = dispatch_capacity(max_tokens)
        return max(deep_ep.Buffer.get_low_latency_rdma_size_hint(cap, h, world, e) for h, e in shapes)

    @classmethod
    def create(cls, deep_ep, group, shapes, max_tokens: int, world: int) -> LowLatency:
        """Collective over ``group`` (a torch.distributed process group). NVSHMEM is initialised here unless
        flashmoe already did (then DeepEP only registers its device state with it)."""
        depth = qp_depth(max_tokens)
        if int(os.environ.get("NVSHMEM_QP_DEPTH", "0")) < depth:
            os.environ["NVSHMEM_QP_DEPTH"] = str(depth)
        num_rdma_bytes = cls.rdma_bytes(deep_ep, shapes, max_tokens, world)
        max_local = max(e // world for _, e in shapes)
        buffer = deep_ep.Buffer(
            group,
            num_nvl_bytes=0,
            num_rdma_bytes=num_rdma_bytes,
            low_latency_mode=True,
            num_qps_per_rank=max_local,
            allow_nvlink_for_low_latency_mode=True,
            explicitly_destroy=True,  # never finalises NVSHMEM under flashmoe's feet (no destroy() at exit)
        )
        return cls(deep_ep, buffer, world, max_tokens, num_rdma_bytes)

    def unsupported(self, tokens: int, hidden: int, num_experts: int, placement) -> str | None:
        if tokens > self.max_tokens:
            return f"T={tokens} exceeds the DeepEP LL buffer's {self.max_tokens} tokens per rank (--deepep-max-tokens)"
        if hidden not in SUPPORTED_HIDDEN:
            return f"DeepEP LL kernels are not compiled for hidden {hidden} (only {SUPPORTED_HIDDEN})"
        if num_experts % self.world:
            return f"DeepEP LL needs E % world == 0 (E {num_experts}, world {self.world})"
        local = num_experts // self.world
        if not all(placement.num_local(r) == local for r in range(self.world)) or not torch.equal(
            placement.expert_rank.long().cpu(), torch.arange(num_experts) // local
        ):
            return "DeepEP LL needs contiguous expert placement (expert e on rank e // E_local)"
        return None

    def prepare(self, tokens: int, hidden: int, num_experts: int) -> int:
        """T_cap for this case; cleans the buffer (collective) when the layout changes. Call eagerly, on every
        rank, before any capture."""
        key = (dispatch_capacity(tokens), hidden, num_experts)
        if key != self.layout:
            self.buffer.clean_low_latency_buffer(*key)
            torch.cuda.synchronize()
            self.layout = key
        return key[0]

    def layer(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        swiglu,
        num_experts: int,
        capacity: int,
        variant: str = "deepep_ll",
        recv_rows: int | None = None,
    ) -> torch.Tensor:
        """One MoE layer (or, for ``deepep_ll_comm``, its communication alone) on this rank's tokens."""
        idx = topk_ids.to(self.deep_ep.topk_idx_t)
        fp8 = variant == FP8
        recv, counts, handle, _, _ = self.buffer.low_latency_dispatch(
            x, idx, capacity, num_experts, use_fp8=fp8, async_finish=False, return_recv_hook=False
        )
        if variant == COMM:
            y = recv
        else:
            n_local, per_expert = counts.numel(), self.world * capacity
            bound = recv_rows
            if bound is None:
                bound = min(n_local * per_expert, self.world * x.shape[0] * topk_ids.shape[1])
            src, offs = packed_rows(counts, per_expert, bound)
            rows = gather_rows_fp8(recv[0], recv[1], src, x.dtype) if fp8 else gather_rows(recv, src)
            # torch._grouped_mm reads the offsets on the device; the mm loop needs them on the host.
            sizes = counts.tolist() if swiglu.impl == MM_LOOP else None
            y = scatter_rows(swiglu(rows, offs, sizes, w13, w2), src, n_local, per_expert)
        out, _, _ = self.buffer.low_latency_combine(
            y, idx, topk_weights, handle, async_finish=False, return_recv_hook=False
        )
        return out
