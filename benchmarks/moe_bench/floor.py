"""The physical floor of one MoE layer call: what the hardware must do, at rates measured in the run.

Per rank r, from the routing of every rank (``topk_ids`` of all sources) and the expert placement:

    t_gemm    = 6 · rows_r · H · I / R_gemm          rows_r = (token, expert) pairs r's experts compute
    t_weights = touched_r · 3 · H · I · b_w / B_copy touched_r = r's experts with at least one row
    t_link    = link_rows_r · H · b_a / B_link       rows crossing r's links in one direction

The floor of rank r is the largest term (perfect overlap); the layer's floor is the largest over
ranks, i.e. every term is maxed over ranks and the floor is the largest of those. ``B_copy`` counts
read + write of a device copy, so streaming weights (read only) at that rate is the HBM bound;
activation traffic in HBM is ignored (a few percent of the weights at decode, below the GEMM at
prefill). One GPU has no link term.

Link rows: dispatch sends rows out and combine brings results back, so a rank's egress is
(its rows sent) + (results for rows it received) and its ingress is the same two counts — equal.
Two accountings are kept:

* ``nodedup``: one row per (token, remote expert) — what a per-expert all-to-all moves.
* ``dedup``: one row per (token, remote rank) — a token goes once to each rank owning one of its
  experts and results are pre-reduced per rank before combine (kernel-design §3 item 8). This is
  the smaller, achievable amount, so ``floor`` (the one latency ratios use) is the dedup floor.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

TERMS = ("gemm", "weights", "link")


@dataclass(frozen=True)
class Rates:
    gemm_flops: float  # FLOP/s of a large dense bf16 matmul
    copy_bytes: float  # B/s of a large device-to-device copy, read + write counted
    link_bytes: float  # B/s one way between two GPUs; 0 when there is no second GPU

    def __post_init__(self):
        if self.gemm_flops <= 0 or self.copy_bytes <= 0 or self.link_bytes < 0:
            raise ValueError(f"rates must be positive (link may be 0): {self}")


@dataclass(frozen=True)
class RankWork:
    expert_rows: int  # (token, expert) pairs computed by this rank's experts, from all sources
    experts_touched: int  # this rank's experts with >= 1 row
    link_rows_nodedup: int  # rows each way over this rank's links, one per (token, remote expert)
    link_rows_dedup: int  # the same, one per (token, remote rank)


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
                # Egress = rows sent + results returned for rows received; ingress is the same sum.
                link_rows_nodedup=int(sent_nodedup[r] + recv_nodedup[r]),
                link_rows_dedup=int(sent_dedup[r] + recv_dedup[r]),
            )
        )
    return work


def rank_floor(
    work: RankWork, hidden: int, intermediate: int, rates: Rates, act_bytes: int = 2, weight_bytes: int = 2
) -> Floor:
    link_row = hidden * act_bytes
    if rates.link_bytes == 0 and (work.link_rows_dedup or work.link_rows_nodedup):
        raise ValueError("routing moves rows between ranks but the link rate is 0")
    per_link = (lambda rows: rows * link_row / rates.link_bytes) if rates.link_bytes else (lambda rows: 0.0)
    return Floor(
        gemm_s=6.0 * work.expert_rows * hidden * intermediate / rates.gemm_flops,
        weights_s=work.experts_touched * 3.0 * hidden * intermediate * weight_bytes / rates.copy_bytes,
        link_s=per_link(work.link_rows_dedup),
        link_nodedup_s=per_link(work.link_rows_nodedup),
    )


def layer_floor(
    works: list[RankWork],
    hidden: int,
    intermediate: int,
    rates: Rates,
    act_bytes: int = 2,
    weight_bytes: int = 2,
) -> Floor:
    """Every term maxed over ranks (the layer ends when its slowest rank does)."""
    per_rank = [rank_floor(w, hidden, intermediate, rates, act_bytes, weight_bytes) for w in works]
    return Floor(*(max(getattr(f, x.name) for f in per_rank) for x in fields(Floor)))


def load_imbalance(works: list[RankWork]) -> float:
    """max / mean of expert rows over ranks (1.0 = balanced)."""
    rows = [w.expert_rows for w in works]
    mean = sum(rows) / len(rows)
    return max(rows) / mean if mean else 1.0
