"""The layers flashmoe is measured against, written the way a careful PyTorch user would.

All take the flashmoe call signature (``x [T, H]``, ``topk_ids [T, k]`` int32 without -1 entries,
``topk_weights [T, k]`` fp32, this rank's ``w13 [E_local, 2I, H]`` and ``w2 [E_local, H, I]``) plus
an :class:`EPLayout` (the expert placement as device lookup tables). Any placement works, uneven
ones included.

* :func:`all_to_all_moe` — the classic EP path (Megatron's all-to-all dispatcher): one row per
  (token, expert) sorted by expert, a counts all-to-all, one host sync for the split sizes, a token
  all-to-all, the grouped SwiGLU GEMMs, the reverse all-to-all, and a weighted sum over k.
* :func:`allgather_rs_moe` — vLLM's default EP path: all-gather tokens and routing, every rank runs
  its own experts on the (token, expert) pairs that hit them with the weight applied in the GEMM
  output (as fused_moe), sums over k, and a reduce-scatter returns each rank its tokens.
* :func:`compute_only` — the grouped SwiGLU GEMMs alone on rows already grouped by expert: the
  expert work of one rank with no communication (at world 1 the very rows of the layer's tokens).

vLLM's own kernels (all-gather -> Triton ``fused_experts`` -> reduce-scatter) are in :mod:`.vllm_fused`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .grouped_gemm import GroupedSwiGLU, group_offsets


@dataclass(frozen=True)
class EPLayout:
    """Expert placement as the baselines use it: lookups by global expert id, on the device."""

    group: object
    rank: int
    world: int
    experts_per_rank: list[int]
    owner: torch.Tensor  # [E] int64: rank that holds expert e
    local: torch.Tensor  # [E] int64: index of e in its owner's w13/w2
    slot: torch.Tensor  # [E] int64: position of e when experts are listed rank by rank, local order within

    @staticmethod
    def from_placement(placement, group, device: torch.device) -> EPLayout:
        world = placement.world_size
        per_rank = [placement.num_local(r) for r in range(world)]
        owner = placement.expert_rank.long()
        local = placement.expert_local.long()
        first = torch.tensor([0] + per_rank[:-1]).cumsum(0)
        return EPLayout(
            group,
            dist.get_rank(group),
            world,
            per_rank,
            owner.to(device),
            local.to(device),
            (first[owner] + local).to(device),
        )

    @property
    def num_experts(self) -> int:
        return self.owner.numel()


def all_to_all_moe(x, topk_ids, topk_weights, w13, w2, swiglu: GroupedSwiGLU, ep: EPLayout) -> torch.Tensor:
    n_mine = w13.shape[0]
    T, k = topk_ids.shape
    H = x.shape[1]
    slot = ep.slot[topk_ids.reshape(-1).long()]
    # (token, j) pairs sorted by destination rank, then by its local expert.
    order = torch.argsort(slot, stable=True)
    send_counts = torch.bincount(slot, minlength=ep.num_experts)
    recv_counts = send_counts.new_empty(ep.world * n_mine)  # [source rank, my local expert]
    dist.all_to_all_single(recv_counts, send_counts, [n_mine] * ep.world, ep.experts_per_rank, group=ep.group)
    counts = torch.cat((send_counts, recv_counts)).cpu()  # the one host sync: split sizes
    send_splits = [int(c.sum()) for c in counts[: ep.num_experts].split(ep.experts_per_rank)]
    recv_by_source = counts[ep.num_experts :].view(ep.world, n_mine)
    recv_splits = recv_by_source.sum(1).tolist()
    expert_sizes = recv_by_source.sum(0).tolist()
    n_recv = sum(recv_splits)

    recv_x = x.new_empty(n_recv, H)
    dist.all_to_all_single(recv_x, x.index_select(0, order // k), recv_splits, send_splits, group=ep.group)
    # Rows arrive grouped by source rank; the grouped GEMM wants them grouped by expert.
    row_expert = torch.repeat_interleave(
        torch.arange(n_mine, device=x.device).repeat(ep.world), recv_counts, output_size=n_recv
    )
    perm = torch.argsort(row_expert, stable=True)
    offs = group_offsets(recv_counts.view(ep.world, n_mine).sum(0))
    y = swiglu(recv_x.index_select(0, perm), offs, expert_sizes, w13, w2)
    y_by_source = torch.empty_like(y).index_copy_(0, perm, y)

    back = x.new_empty(T * k, H)
    dist.all_to_all_single(back, y_by_source, send_splits, recv_splits, group=ep.group)
    y_tk = torch.empty_like(back).index_copy_(0, order, back).view(T, k, H)
    # sum_j w[t, j] · y[t, j]: one batched [1, k] x [k, H] product per token, fp32 accumulation.
    return torch.bmm(topk_weights.to(x.dtype).unsqueeze(1), y_tk).squeeze(1)


def all_gather_tokens(x, topk_ids, topk_weights, ep: EPLayout):
    """Every rank's tokens and routing, rank-major ([W*T, ...]; every rank has the same T), in ONE
    collective, as vLLM does it: its all-gather dispatch (``all_gatherv`` of hidden states, weights and
    ids) runs the three gathers inside one NCCL group, a single kernel. Three separate all-gathers cost
    three NCCL launches and latencies per layer, which made this baseline slower than vLLM's server at
    small T (kernel-notes, "what the serving profile showed"). Here the rows are packed into one byte
    matrix, gathered, and split back."""
    parts = [t.contiguous() for t in (x, topk_ids, topk_weights)]
    T, W = x.shape[0], ep.world
    packed = torch.cat([t.view(torch.uint8).reshape(T, -1) for t in parts], dim=1)
    gathered = packed.new_empty(W * T, packed.shape[1])
    dist.all_gather_into_tensor(gathered, packed, group=ep.group)
    out, col = [], 0
    for t in parts:
        width = t.view(torch.uint8).reshape(T, -1).shape[1]
        out.append(gathered[:, col : col + width].contiguous().view(t.dtype).reshape(W * T, *t.shape[1:]))
        col += width
    return tuple(out)


def allgather_rs_moe(x, topk_ids, topk_weights, w13, w2, swiglu: GroupedSwiGLU, ep: EPLayout) -> torch.Tensor:
    n_mine = w13.shape[0]
    T, k = topk_ids.shape
    H = x.shape[1]
    W = ep.world
    xg, ids_g, w_g = all_gather_tokens(x, topk_ids, topk_weights, ep)

    flat = ids_g.reshape(-1).long()
    key = torch.where(ep.owner[flat] == ep.rank, ep.local[flat], n_mine)  # other ranks' experts sort last
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=n_mine + 1)[:n_mine]
    sizes = counts.tolist()  # the one host sync: how many pairs are local
    pairs = order[: sum(sizes)]
    y = swiglu(xg.index_select(0, pairs // k), group_offsets(counts), sizes, w13, w2)
    # Gate weight applied in fp32 and stored in bf16, as fused_moe's second-GEMM epilogue does.
    torch.mul(y, w_g.reshape(-1)[pairs].unsqueeze(1), out=y)
    y_tk = x.new_zeros(W * T * k, H).index_copy_(0, pairs, y)
    partial = y_tk.view(W * T, k, H).sum(1)
    out = x.new_empty(T, H)
    dist.reduce_scatter_tensor(out, partial, group=ep.group)
    return out


@dataclass
class ExpertRows:
    """One rank's expert work with the rows already in place: ``x`` grouped by local expert."""

    x: torch.Tensor  # [N, H]
    offs: torch.Tensor  # [E_local] int32 cumulative ends, on the device
    sizes: list[int]  # rows per local expert

    @staticmethod
    def random(sizes: torch.Tensor, hidden: int, dtype: torch.dtype, gen: torch.Generator) -> ExpertRows:
        n = int(sizes.sum())
        x = torch.randn(n, hidden, generator=gen, device=sizes.device, dtype=dtype)
        return ExpertRows(x, group_offsets(sizes), sizes.tolist())

    @staticmethod
    def of_tokens(x: torch.Tensor, topk_ids: torch.Tensor, num_local: int) -> ExpertRows:
        """The rows a single rank's experts compute for these tokens (world 1: every expert is local,
        expert e at index e): each (token, expert) pair's token row, grouped by expert."""
        flat = topk_ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        sizes = torch.bincount(flat, minlength=num_local)
        return ExpertRows(x.index_select(0, order // topk_ids.shape[1]), group_offsets(sizes), sizes.tolist())


def compute_only(rows: ExpertRows, w13, w2, swiglu: GroupedSwiGLU) -> torch.Tensor:
    return swiglu(rows.x, rows.offs, rows.sizes, w13, w2)
