"""Timing one variant of one case: warm-up, then per-call device timing over rotated input sets.

Each timed call is bracketed by its own pair of CUDA events (wall clock on CPU), so the median is
over calls, not over a loop average. Before every call, outside the bracket: the L2 is flushed (a
write of several times its size), then the ranks meet at a stream-ordered barrier, so a call is
neither helped by the previous call's weights in L2 nor charged for another rank arriving late.
Input sets rotate call by call (each set has its own tokens and routing, so small cases do not
re-use one set of experts).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .ranks import Ranks


class L2Flusher:
    """Overwrites a buffer of ``multiple`` × the device's L2 size (no-op on CPU)."""

    def __init__(self, device: torch.device, enabled: bool = True, multiple: int = 4):
        self.buf = None
        if enabled and device.type == "cuda":
            l2 = torch.cuda.get_device_properties(device).L2_cache_size
            self.buf = torch.empty(max(multiple * l2, 1 << 20), dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        if self.buf is not None:
            self.buf.zero_()


class _Bracket:
    """Start/stop marks around one call; seconds are read after the loop (one sync for all calls)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, started) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((started, ev))
        else:
            self.marks.append((started, time.perf_counter()))

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in self.marks]
        return [b - a for a, b in self.marks]


@dataclass(frozen=True)
class TimingPolicy:
    warmup: int = 3
    min_iters: int = 10
    max_iters: int = 200
    target_s: float = 0.25  # timed device time per variant and case (before min/max)

    def iterations(self, seconds_per_call: float) -> int:
        if seconds_per_call <= 0:
            return self.max_iters
        return max(self.min_iters, min(self.max_iters, math.ceil(self.target_s / seconds_per_call)))


@dataclass(frozen=True)
class CallTimes:
    seconds: list[float]  # this rank's per-call times

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def quantile(self, q: float) -> float:
        s = sorted(self.seconds)
        return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def time_calls(
    call: Callable[[int], object], num_sets: int, ranks: Ranks, flush: L2Flusher, policy: TimingPolicy
) -> CallTimes:
    """Time ``call(set_index)``; all ranks run the same number of calls (collectives inside must pair up)."""
    device = ranks.device
    warm = _Bracket(device)
    for i in range(policy.warmup):
        flush()
        ranks.barrier()
        started = warm.start()
        call(i % num_sets)
        warm.stop(started)
    est = statistics.median(warm.seconds()) if policy.warmup else 0.0
    # Whole rounds over the input sets, so every set is timed equally often (the floor is their mean).
    iters = math.ceil(policy.iterations(ranks.max(est)) / num_sets) * num_sets
    timed = _Bracket(device)
    for i in range(iters):
        flush()
        ranks.barrier()
        started = timed.start()
        call(i % num_sets)
        timed.stop(started)
    return CallTimes(timed.seconds())
