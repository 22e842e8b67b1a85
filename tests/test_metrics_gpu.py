"""Device metrics on a GPU (skips without CUDA): the reader's asynchronous copy next to CUDA graph
capture, and real megakernel records (monotonic timestamps, SM utilization in (0, 1], exact totals,
calls made inside a CUDA graph).

Each test runs in one spawned rank process (world 1) with a deadline, so CUDA/NVSHMEM state stays
out of the pytest process and a hang fails the test instead of the session.
"""

from __future__ import annotations

import pytest
import torch
from multiproc import apply_rank_env, init_one_gpu_rank, run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SPEC = dict(num_experts=16, top_k=4, hidden_size=1024, intermediate_size=512, max_tokens_per_rank=256)
TOKEN_COUNTS = (1, 7, 64, 256) * 5
GRAPH_REPLAYS = 10


def _sample(name: str, **labels) -> float | None:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, {k: str(v) for k, v in labels.items()})


def _reader_next_to_graph_capture(rank: int, world: int, port: int) -> None:
    """The metrics thread copies the ring every 2 ms while this thread captures graphs in the
    default global capture mode, which any unsafe CUDA call from another thread would invalidate."""
    apply_rank_env()
    from flashmoe import metrics
    from flashmoe.metrics import ring as mr

    torch.cuda.set_device(0)
    lid = metrics.register_layer("gpu.synthetic", "megakernel", ep_rank=0)
    ring = torch.zeros(mr.RING_SLOTS, mr.RING_FIELDS, dtype=torch.int64, device="cuda")
    totals = torch.zeros(mr.MAX_LAYERS, mr.TOTALS_FIELDS, dtype=torch.int64, device="cuda")
    for epoch in (1, 2, 3):
        rec = torch.zeros(mr.RING_FIELDS, dtype=torch.int64)
        rec[[mr.SEQ, mr.LAYER_ID, mr.START_NS, mr.END_NS, mr.BUSY_NS, mr.BLOCKS_DONE, mr.NUM_BLOCKS]] = (
            torch.tensor([epoch, lid, 10**9 * epoch, 10**9 * epoch + 40_000, 132 * 20_000, 132, 132])
        )
        ring[epoch] = rec.cuda()
    totals[lid] = torch.tensor([3, 3, 3, 0], device="cuda")
    pump = metrics.attach_device_source(ring, totals, interval_s=0.002)

    static = torch.randn(512, 512, device="cuda")
    static @ static  # create the cuBLAS handle outside capture, as engines warm up before capturing
    torch.cuda.synchronize()
    for _ in range(50):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # capture_error_mode="global", as vLLM and SGLang capture
            out = static @ static
        graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out, static @ static)
    metrics.flush()
    assert not pump._warned, "a metrics poll failed during capture (see the log)"
    labels = {"layer": "gpu.synthetic", "ep_rank": 0}
    assert _sample("flashmoe_layer_latency_seconds_count", **labels) == 3
    assert _sample("flashmoe_calls_total", **labels) == 3
    assert _sample("flashmoe_sm_utilization_ratio", **labels) == pytest.approx(0.5)


def test_metrics_reader_copies_while_another_thread_captures_cuda_graphs():
    run_ranks(_reader_next_to_graph_capture, 1, timeout=120)


def _megakernel_records(rank: int, world: int, port: int) -> None:
    device, cpu_group = init_one_gpu_rank("flashmoe-metrics-store-")
    import torch.distributed as dist
    from flashmoe import ExpertPlacement, FlashMoE, MoELayerSpec, megakernel, metrics
    from flashmoe.metrics import ring as mr

    spec = MoELayerSpec(**SPEC)
    moe = FlashMoE(
        spec,
        ExpertPlacement.contiguous(spec.num_experts, 1),
        dist.group.WORLD,
        cpu_group=cpu_group,
        layer_name="gpu.layer0",
    )
    assert moe.backend == "megakernel", moe.reason
    gen = torch.Generator(device=device).manual_seed(0)
    E, H, inter, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    w13 = torch.randn(E, 2 * inter, H, device=device, dtype=torch.bfloat16, generator=gen) / H**0.5
    w2 = torch.randn(E, H, inter, device=device, dtype=torch.bfloat16, generator=gen) / inter**0.5

    def inputs(t):
        x = torch.randn(t, H, device=device, dtype=torch.bfloat16, generator=gen)
        ids = torch.rand(t, E, device=device, generator=gen).topk(k, dim=1).indices.to(torch.int32)
        w = torch.softmax(torch.randn(t, k, device=device, generator=gen), dim=1)
        return x, ids, w

    for t in TOKEN_COUNTS:
        moe(*inputs(t), w13, w2)
    torch.cuda.synchronize()
    ring, totals = (b.cpu() for b in megakernel.device_metrics())
    mine = ring[(ring[:, mr.SEQ] != 0) & (ring[:, mr.LAYER_ID] == moe.layer_id)]
    mine = mine[mine[:, mr.SEQ].argsort()]
    n = len(TOKEN_COUNTS)
    assert mine.shape[0] == n, f"{mine.shape[0]} records for {n} calls"
    assert (mine[:, mr.BLOCKS_DONE] == mine[:, mr.NUM_BLOCKS]).all() and (mine[:, mr.NUM_BLOCKS] > 0).all()
    start, end = mine[:, mr.START_NS], mine[:, mr.END_NS]
    assert (end > start).all(), (start, end)
    assert (start[1:] >= start[:-1]).all() and (end[1:] >= end[:-1]).all(), "device timestamps not monotonic"
    # Phase ends (the last block's arrival at each grid barrier; GEMM0's last tile; the last block's GEMM end) fall in
    # order inside the call.
    from flashmoe import contract as c

    phases = mine[:, [c.RING_DISPATCH_END_NS, c.RING_RECEIVE_END_NS, c.RING_GEMM1_END_NS]]
    assert (phases[:, 0] > start).all() and (phases[:, 2] <= end).all(), (start, phases, end)
    assert (phases[:, 1:] >= phases[:, :-1]).all(), phases
    gemm0_end = mine[:, c.RING_GEMM0_END_NS]
    assert ((gemm0_end > phases[:, 1]) & (gemm0_end <= phases[:, 2])).all(), (phases, gemm0_end)
    util = mine[:, mr.BUSY_NS].double() / (mine[:, mr.NUM_BLOCKS] * (end - start)).double()
    assert ((util > 0) & (util <= 1)).all(), util
    assert mine[:, mr.TOKENS_IN].tolist() == list(TOKEN_COUNTS)
    assert mine[:, mr.ROWS_DISPATCHED].tolist() == list(
        TOKEN_COUNTS
    )  # world 1: every token to this rank once
    assert (mine[:, mr.REMOTE_BYTES] == 0).all() and (mine[:, mr.WORLD_SIZE] == 1).all()
    assert totals[moe.layer_id].tolist() == [n, sum(TOKEN_COUNTS), sum(TOKEN_COUNTS), 0]

    metrics.flush()
    labels = {"layer": "gpu.layer0", "ep_rank": 0}
    assert _sample("flashmoe_calls_total", **labels) == n
    assert _sample("flashmoe_layer_latency_seconds_count", **labels) == n
    assert _sample("flashmoe_layer_latency_seconds_sum", **labels) == pytest.approx(
        float((end - start).sum()) * 1e-9
    )
    assert 0 < _sample("flashmoe_sm_utilization_ratio", **labels) <= 1

    # Inside a CUDA graph: every replay is a call with its own record and counts.
    x, ids, w = inputs(64)
    out = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe(x, ids, w, w13, w2, out=out)  # warm-up outside capture, as torch.cuda.graph recommends
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe(x, ids, w, w13, w2, out=out)
    for _ in range(GRAPH_REPLAYS):
        graph.replay()
    torch.cuda.synchronize()
    metrics.flush()
    assert _sample("flashmoe_calls_total", **labels) == n + 1 + GRAPH_REPLAYS
    assert _sample("flashmoe_layer_latency_seconds_count", **labels) == n + 1 + GRAPH_REPLAYS
    assert _sample("flashmoe_tokens_dispatched_total", **labels) == sum(TOKEN_COUNTS) + 64 * (
        1 + GRAPH_REPLAYS
    )
    dist.destroy_process_group()


def test_megakernel_records_are_monotonic_with_sm_utilization_in_unit_interval():
    from flashmoe import MoELayerSpec
    from flashmoe.backend import megakernel_unsupported_reason

    why = megakernel_unsupported_reason(MoELayerSpec(**SPEC), torch.device("cuda", 0), 1)
    if why is not None:
        pytest.skip(f"megakernel unavailable here: {why}")
    run_ranks(_megakernel_records, 1, timeout=600)  # includes a cold JIT build
