"""Serving mode: what a decode step sees. L consecutive MoE layers with distinct weights, each with its
own routing, run as one CUDA graph with no L2 flush; per-layer time = step time / L.

Weights of layer l are not in L2 when layer l runs again one step later as long as the L layers' weights
together exceed the L2 several times over, so L is the smallest count (at least ``min_layers``) with
``L · per-rank weight bytes > L2_MULTIPLE · L2 size``. On a CPU (gloo) there is no graph and no L2 to
speak of: the L layers run eagerly, so the path is still exercised.

Input sets rotate between steps; each set has its own graph (a graph reads fixed addresses, and a
set's routing fixes its expert row counts, which compute_only's GEMMs are shaped by). The graphs
share one memory pool: they are replayed one at a time, and every output a graph returns stays
referenced, so their temporaries can share memory safely.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

L2_MULTIPLE = 4
CPU_LAYERS = 3  # no L2 to defeat on a CPU; enough layers to check each one's own weights and routing


def layers_for(per_rank_weight_bytes: int, l2_bytes: int, min_layers: int) -> int:
    """Smallest L >= min_layers with L · per_rank_weight_bytes > L2_MULTIPLE · l2_bytes."""
    if per_rank_weight_bytes <= 0:
        raise ValueError("per-rank weight bytes must be positive")
    return max(min_layers, L2_MULTIPLE * l2_bytes // per_rank_weight_bytes + 1)


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).L2_cache_size


def capture(steps: list[Callable[[], list]], device: torch.device, warmup: int = 2):
    """(replay callables, outputs of each step): CUDA graphs of each step on a GPU, the steps
    themselves on a CPU (outputs None: each call returns its own)."""
    if device.type != "cuda":
        return steps, [None] * len(steps)
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    # Lazy first-use work (Triton JIT, NCCL and cuBLAS setup) must not land in a capture.
    with torch.cuda.stream(side):
        for _ in range(warmup):
            for step in steps:
                step()
    current.wait_stream(side)
    torch.cuda.synchronize(device)
    pool = torch.cuda.graph_pool_handle()
    graphs, outputs = [], []
    for step in steps:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs.append(step())
        graphs.append(graph)
    torch.cuda.synchronize(device)
    return [g.replay for g in graphs], outputs
