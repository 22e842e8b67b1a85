"""Small-T GEMM0 split over K on a GPU (skips without one): few active experts leave blocks idle, so each GEMM0
tile's K is split over up to FLASHMOE_GEMM0_SPLITS tasks whose fp32 sums the last one adds (scheduler.cuh
gemm0_splits, gemm.cuh reduce_split).

For shapes where the rule splits (bf16: 2, 3 and 4 active experts at T = 1, the 3 in three splits of uneven K,
one expert with 40 rows: ping-pong tiles, one expert with 100 rows: split-width tiles, each consumer its own sums;
block-fp8, whose GEMM0 tasks of 128 features are half as many: 6 and 8 active experts at T = 1, ping-pong, the 6
in three splits of uneven K, and one expert with 40 rows, split-width tiles whose two consumers decide together),
the split layer and the unsplit layer (FLASHMOE_GEMM0_SPLITS=1) are
each compared with the same-rounding reference and the fp64 oracle under the format's budgets, and the split
layer must repeat bitwise (its sum is added in a fixed order, whichever split finishes last). The split and
unsplit results differ only in summation order, so they are not compared bitwise. fp8 calls with a 128-token
tile (one expert with 100 or 200 rows) must not split at all (its sums do not fit a split slot): there the
"split" layer runs the unsplit path, and a call that split anyway would leave part of K out and fail the
reference.
"""

from __future__ import annotations

import pytest
import torch
from moe_inputs import random_fp8_expert_weights, random_grouped_hidden, random_routing
from multiproc import init_one_gpu_rank, run_ranks
from tolerances import error_stats, kernel_budgets

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E, H, INTER = 32, 2048, 768  # Qwen3-30B-A3B per EP4 rank: 32 K steps per GEMM0 tile, up to 4 splits
# (dtype, top_k, tokens, routing of tests/moe_inputs.py), for 132 blocks (H100 and H200). bf16: 2, 3 and 4 active
# experts (24, 36 and 48 GEMM0 tiles, 12 per expert: 4, 3 and 2 splits, the 3 of 11, 11 and 10 K steps; 16-token
# tiles); top-1 onto one expert with 40 rows (64-token ping-pong tiles) and with 100 rows (128-token split-width
# tiles). fp8 (16 K steps of 128, two passes each: at least 4 steps a split, so up to 4 splits): 6 and 8 active
# experts (36 and 48 tasks, 16-token ping-pong: every expert of the call has one row; 3 splits of 5, 5 and 6 K
# steps, and 2), top-1 onto one expert with 40 rows (64-token split-width tiles, 6 tasks: 4 splits); with 100 and
# 200 rows (one and two 128-token tiles, 6 and 12 GEMM0 tasks: not split).
CASES = [
    ("bf16", 2, 1, "uniform"),
    ("bf16", 3, 1, "uniform"),
    ("bf16", 4, 1, "uniform"),
    ("bf16", 1, 40, "one_expert"),
    ("bf16", 1, 100, "one_expert"),
    ("fp8", 6, 1, "uniform"),
    ("fp8", 8, 1, "uniform"),
    ("fp8", 1, 40, "one_expert"),
    ("fp8", 1, 100, "one_expert"),
    ("fp8", 1, 200, "one_expert"),
]


def _split_against_unsplit(rank: int, world: int, port: int) -> None:
    device, cpu_group = init_one_gpu_rank("flashmoe-split-store-")
    import os

    import torch.distributed as dist
    from flashmoe import ExpertPlacement, FlashMoE, MoELayerSpec
    from flashmoe.reference import moe_oracle_fp64, moe_reference
    from flashmoe.reference_fp8 import moe_oracle_fp64_fp8, moe_reference_fp8

    def build(dtype: str, k: int, splits: str) -> FlashMoE:
        os.environ["FLASHMOE_GEMM0_SPLITS"] = splits  # read when the layer is built
        spec = MoELayerSpec(E, k, H, INTER, 256, weight_dtype=torch.float8_e4m3fn if dtype == "fp8" else None)
        moe = FlashMoE(spec, ExpertPlacement.contiguous(E, 1), dist.group.WORLD, cpu_group=cpu_group)
        assert moe.backend == "megakernel", moe.reason
        return moe

    gen = torch.Generator(device=device).manual_seed(7)
    w13 = torch.randn(E, 2 * INTER, H, device=device, generator=gen).div(H**0.5).to(torch.bfloat16)
    w2 = torch.randn(E, H, INTER, device=device, generator=gen).div(INTER**0.5).to(torch.bfloat16)
    q13, s13, q2, s2 = random_fp8_expert_weights(E, H, INTER, gen, device)
    for dtype, k, t, kind in CASES:
        split, unsplit = build(dtype, k, "4"), build(dtype, k, "1")
        ids, w = random_routing(t, E, k, kind, gen, device)
        if dtype == "fp8":
            x = random_grouped_hidden(t, H, gen, device)
            weights = dict(w13=q13, w2=q2, w13_scale_inv=s13, w2_scale_inv=s2)
            ref = moe_reference_fp8(x, ids, w, q13, s13, q2, s2)
            oracle = moe_oracle_fp64_fp8(x, ids, w, q13, s13, q2, s2)
        else:
            x = torch.randn(t, H, device=device, generator=gen).to(torch.bfloat16)
            weights = dict(w13=w13, w2=w2)
            ref = moe_reference(x, ids, w, w13, w2)
            oracle = moe_oracle_fp64(x, ids, w, w13, w2)
        budgets = kernel_budgets(dtype, INTER)
        outs = {}
        for name, moe in (("split", split), ("unsplit", unsplit), ("split again", split)):
            out = torch.full_like(x, float("nan"))  # poisoned: an unwritten row fails
            moe(x, ids, w, out=out, **weights)
            torch.cuda.synchronize()
            outs[name] = out
            for against, target in (("ref", ref), ("oracle", oracle)):
                stats = error_stats(out, target)
                assert stats.within(*budgets[against]), (
                    f"{dtype} {name} k={k} T={t} {kind} vs {against}: rel {stats.rel_fro:.3e} "
                    f"row {stats.max_row_rel:.3e} non-finite {stats.nonfinite}"
                )
        assert torch.equal(outs["split"].view(torch.int16), outs["split again"].view(torch.int16)), (
            f"{dtype} k={k} T={t} {kind}: the split layer did not repeat bitwise"
        )
    dist.destroy_process_group()


def test_split_gemm0_matches_the_reference_and_repeats_bitwise():
    from flashmoe import MoELayerSpec
    from flashmoe.backend import megakernel_unsupported_reason

    why = megakernel_unsupported_reason(MoELayerSpec(E, 8, H, INTER, 256), torch.device("cuda", 0), 1)
    if why is not None:
        pytest.skip(f"megakernel unavailable here: {why}")
    run_ranks(_split_against_unsplit, 1, timeout=600)  # includes a cold JIT build
