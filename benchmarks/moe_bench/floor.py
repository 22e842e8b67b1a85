"""The physical floor of one MoE layer call: what the hardware must do, at rates measured in the run.

Per rank r, from the routing of every rank (``topk_ids`` of all sources) and the expert placement:

    t_gemm    = 6 · rows_r · H · I / R_gemm          rows_r = (token, expert) pairs r's experts compute
    t_weights = touched_r · W_e / B_copy             touched_r = r's experts with at least one row
    t_link    = max(egress_r, ingress_r) / B_link    bytes crossing r's links, each direction

``W_e`` is one expert's weight bytes and the link bytes count token rows as the layer moves them, both
from the weight format (:mod:`.formats`): bf16 ``W_e = 3·H·I·2`` and rows of ``H·2`` bytes each way;
fp8 ``W_e = 3·H·I·1`` plus the fp32 scale of every 128 x 128 block, dispatch rows of ``H·1`` bytes plus
one fp32 scale per 128-group, combine rows still bf16 (``H·2``). ``R_gemm`` is the measured GEMM rate
of that format (bf16 matmul, or fp8 ``torch._scaled_mm``; see :mod:`.rates`).

The floor of rank r is the largest term (perfect overlap); the layer's floor is the largest over
ranks, i.e. every term is maxed over ranks and the floor is the largest of those. ``B_copy`` counts
read + write of a device copy, so streaming weights (read only) at that rate is the HBM bound;
activation traffic in HBM is ignored (a few percent of the weights at decode, below the GEMM at
prefill). One GPU has no link term.

Link rows: dispatch sends rows out and combine brings results back, so a rank's egress is
(its rows sent) x dispatch row bytes + (results for rows it received) x combine row bytes, and its
ingress is (rows received) x dispatch row bytes + (results for rows it sent) x combine row bytes. With
bf16 both row sizes are ``H·2`` and the two directions are equal: (sent + received) x ``H·2``. Two
accountings of the rows are kept:

* ``nodedup``: one row per (token, remote expert) — what a per-expert all-to-all moves.
* ``dedup``: one row per (token, remote rank) — a token goes once to each rank owning one of its
  experts and results are pre-reduced per rank before combine (kernel-design §3 item 8). This is
  the smaller, achievable amount, so ``floor`` (the one latency ratios use) is the dedup floor.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .formats import BF16, Format

TERMS = ("gemm", "weights", "link")


@dataclass(frozen=True)
class Rates:
    gemm_flops: float  # FLOP/s of a large dense bf16 matmul
    copy_bytes: float  # B/s of a large device-to-device copy, read + write counted
    link_bytes: float  # B/s one way between two GPUs; 0 when there is no second GPU
    fp8_gemm_flops: float = 0.0  # FLOP/s of a large e4m3 torch._scaled_mm; 0 when not measured

    def __post_init__(self):
        if self.gemm_flops <= 0 or self.copy_bytes <= 0 or self.link_bytes < 0 or self.fp8_gemm_flops < 0:
            raise ValueError(f"rates must be positive (link and fp8 GEMM may be 0): {self}")

    def gemm_rate(self, fmt: Format) -> float:
        """The GEMM rate that bounds ``fmt``'s expert GEMMs."""
        if fmt.gemm == "bf16":
            return self.gemm_flops
        if fmt.gemm == "fp8":
            if not self.fp8_gemm_flops:
                raise ValueError("an fp8 floor needs the fp8 GEMM rate, which was not measured")
            return self.fp8_gemm_flops
        raise ValueError(f"unknown GEMM rate {fmt.gemm!r}")


@dataclass(frozen=True)
class RankWork:
    expert_rows: int  # (token, expert) pairs computed by this rank's experts, from all sources
    experts_touched: int  # this rank's experts with >= 1 row
    sent_nodedup: int  # token rows this rank dispatches to other ranks, one per (token, remote expert)
    recv_nodedup: int  # token rows other ranks dispatch to this rank, one per (token, remote expert)
    sent_dedup: int  # the same two counts with one row per (token, remote rank)
    recv_dedup: int

    @property
    def link_rows_nodedup(self) -> int:
        """Rows each way over this rank's links (dispatch out + results back = dispatch in + results out)."""
        return self.sent_nodedup + self.recv_nodedup

    @property
    def link_rows_dedup(self) -> int:
        return self.sent_dedup + self.recv_dedup


@dataclass(frozen=True)
class Floor:
    """Seconds per term (each maxed over ranks) and the resulting floors."""

    gemm_s: float
    weights_s: float
    link_s: float  # dedup
    link_nodedup_s: float

    @property
    def floor_s(self) -> float:
        return max(self.gemm_s, self.weights_s, self.link_s)

    @property
    def floor_nodedup_s(self) -> float:
        return max(self.gemm_s, self.weights_s, self.link_nodedup_s)

    @property
    def bound(self) -> str:
        """The term that sets the (dedup) floor: 'gemm', 'weights' or 'link'."""
        terms = {"gemm": self.gemm_s, "weights": self.weights_s, "link": self.link_s}
        return max(terms, key=terms.get)

    @staticmethod
    def mean(floors: list[Floor]) -> Floor:
        """Term-wise mean (over rotated input sets of one case); the floors follow from the means."""
        if not floors:
            raise ValueError("no floors to average")
        return Floor(*(sum(getattr(f, x.name) for f in floors) / len(floors) for x in fields(Floor)))


def rank_work(topk_ids_all: torch.Tensor, expert_rank: torch.Tensor) -> list[RankWork]:
    """Per-rank work of one call. ``topk_ids_all``: [W, T, k] ids of every source rank (-1 = no expert);
    ``expert_rank``: [E] owning rank of each expert."""
    if topk_ids_all.dim() != 3:
        raise ValueError(f"topk_ids_all must be [world, T, k], got {tuple(topk_ids_all.shape)}")
    ids = topk_ids_all.to("cpu", torch.int64)
    owner = expert_rank.to("cpu", torch.int64)
    world = ids.shape[0]
    valid = ids >= 0
    dest = torch.where(valid, owner[ids.clamp(min=0)], torch.full_like(ids, -1))  # [W, T, k]
    src = torch.arange(world).view(world, 1, 1).expand_as(dest)
    remote = valid & (dest != src)

    # One row per (token, remote expert).
    sent_nodedup = remote.flatten(1).sum(1)  # [W] by source
    recv_nodedup = torch.bincount(dest[remote], minlength=world)  # [W] by destination
    # One row per (token, remote rank).
    hit = torch.zeros(ids.shape[0], ids.shape[1], world, dtype=torch.bool)  # [W, T, dest]
    s_idx, t_idx, _ = torch.nonzero(remote, as_tuple=True)
    hit[s_idx, t_idx, dest[remote]] = True
    sent_dedup = hit.flatten(1).sum(1)
    recv_dedup = hit.sum((0, 1))

    work = []
    for r in range(world):
        mine = valid & (dest == r)
        work.append(
            RankWork(
                expert_rows=int(mine.sum()),
                experts_touched=int(torch.unique(ids[mine]).numel()),
                sent_nodedup=int(sent_nodedup[r]),
                recv_nodedup=int(recv_nodedup[r]),
                sent_dedup=int(sent_dedup[r]),
                recv_dedup=int(recv_dedup[r]),
            )
        )
    return work


def link_bytes_one_way(sent: int, recv: int, hidden: int, fmt: Format = BF16) -> int:
    """Bytes over a rank's links in its busier direction: egress = sent dispatch rows + results returned
    for received rows, ingress = received dispatch rows + results for sent rows."""
    d, c = fmt.dispatch_row_bytes(hidden), fmt.combine_row_bytes(hidden)
    return max(sent * d + recv * c, recv * d + sent * c)


def rank_floor(work: RankWork, hidden: int, intermediate: int, rates: Rates, fmt: Format = BF16) -> Floor:
    if rates.link_bytes == 0 and (work.link_rows_dedup or work.link_rows_nodedup):
        raise ValueError("routing moves rows between ranks but the link rate is 0")

    def per_link(sent: int, recv: int) -> float:
        if not rates.link_bytes:
            return 0.0
        return link_bytes_one_way(sent, recv, hidden, fmt) / rates.link_bytes

    return Floor(
        gemm_s=6.0 * work.expert_rows * hidden * intermediate / rates.gemm_rate(fmt),
        weights_s=work.experts_touched * fmt.expert_weight_bytes(hidden, intermediate) / rates.copy_bytes,
        link_s=per_link(work.sent_dedup, work.recv_dedup),
        link_nodedup_s=per_link(work.sent_nodedup, work.recv_nodedup),
    )


def layer_floor(
    works: list[RankWork], hidden: int, intermediate: int, rates: Rates, fmt: Format = BF16
) -> Floor:
    """Every term maxed over ranks (the layer ends when its slowest rank does)."""
    per_rank = [rank_floor(w, hidden, intermediate, rates, fmt) for w in works]
    return Floor(*(max(getattr(f, x.name) for f in per_rank) for x in fields(Floor)))


def load_imbalance(works: list[RankWork]) -> float:
    """max / mean of expert rows over ranks (1.0 = balanced)."""
    rows = [w.expert_rows for w in works]
    mean = sum(rows) / len(rows)
    return max(rows) / mean if mean else 1.0
