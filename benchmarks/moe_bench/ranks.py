"""Agreement between the ranks of the benchmark: barriers, shared decisions, gathered numbers.

Every decision that changes which collectives run next (stop for the time budget, skip a variant
that failed its check, iteration counts) goes through here, so all ranks take the same branch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Ranks:
    def __init__(self, group, device: torch.device):
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._token = torch.zeros(1, device=device)

    def barrier(self) -> None:
        """Returns (on GPU: the current stream proceeds) once every rank has arrived."""
        if self.device.type == "cuda":
            # A stream-ordered all-reduce, not dist.barrier(): the work that follows on this stream
            # starts when the slowest rank arrives, so ranks enter a timed call together.
            dist.all_reduce(self._token, group=self.group)
        else:
            dist.barrier(group=self.group)

    def max(self, value: float) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def min(self, value: float) -> float:
        return -self.max(-value)

    def any(self, flag: bool) -> bool:
        return self.max(1.0 if flag else 0.0) > 0.5

    def gather(self, values: list[float]) -> list[list[float]]:
        """Every rank's equal-length list of floats, indexed by rank (on every rank)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = torch.empty(self.world * t.numel(), dtype=torch.float64, device=self.device)
        dist.all_gather_into_tensor(out, t, group=self.group)
        return out.view(self.world, -1).tolist()

    def gather_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """[world, *t.shape]: every rank's equally shaped tensor."""
        flat = t.contiguous().view(-1)
        out = flat.new_empty(
            self.world * flat.numel()
        )  # gloo wants the output as world copies of the input, concatenated
        dist.all_gather_into_tensor(out, flat, group=self.group)
        return out.view((self.world,) + tuple(t.shape))

    def broadcast_float(self, value: float, src: int = 0) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.broadcast(t, src=src, group=self.group)
        return float(t.item())
