"""TP+EP token slicing in the vLLM adapter (integration/vllm/token_slicing.py), on CPU over gloo.

Every rank holds the same T tokens (as under vLLM TP+EP), runs FlashMoE (CPU: the distributed
reference) on its slice only and all-gathers the slices; each rank's full output must be the same
tensor on every rank and match the unsliced single-rank ``flashmoe.moe_reference`` and the unsliced
EP run. T covers 0, T < W, T % W != 0 and T % W == 0. The end-to-end check (vLLM TP2+EP serving
through this path) is tests/test_vllm_serve.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from flashmoe import ExpertPlacement, FlashMoE, MoELayerSpec, moe_reference
from flashmoe.integration.vllm.token_slicing import (
    FULL,
    TP_SLICED,
    sliced_forward,
    sliced_max_tokens,
    token_mode,
    token_slice,
)
from moe_inputs import local_weights, random_expert_weights, random_hidden, random_routing
from multiproc import init_cpu_rank, run_ranks
from tolerances import SAME_ROUNDING_REL_FRO, SAME_ROUNDING_ROW_REL, assert_within

E, K, H, I = 6, 2, 64, 32
TOKEN_COUNTS = {2: [0, 1, 3, 8, 13], 3: [0, 1, 2, 7, 9]}  # per world: 0, < W, uneven, even, uneven
RUN_LIMIT_S = 90


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_token_slices_partition_in_order(world):
    for T in range(0, 3 * world + 2):
        slices = [token_slice(T, world, r) for r in range(world)]
        assert [s for s, _ in slices] == [sum(c for _, c in slices[:r]) for r in range(world)]
        assert sum(c for _, c in slices) == T
        counts = [c for _, c in slices]
        assert counts == sorted(counts, reverse=True) and max(counts) - min(counts) <= 1
        assert max(counts) <= sliced_max_tokens(T, world)


def test_token_mode_decision(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    def parallel(tp=1, dp=1, pcp=1, sp=1, ep=1, use_ep=True):
        return FusedMoEParallelConfig(
            tp_size=tp, pcp_size=pcp, dp_size=dp, ep_size=ep, tp_rank=0, pcp_rank=0, dp_rank=0, ep_rank=0,
            sp_size=sp, use_ep=use_ep, all2all_backend="allgather_reducescatter", enable_eplb=False,
        )  # fmt: skip

    monkeypatch.delenv("FLASHMOE_TP_SLICE", raising=False)
    assert token_mode(parallel(ep=4))[0] == TP_SLICED  # TP4+EP: vLLM folds TP into ep_size
    assert token_mode(parallel(ep=4, dp=4))[0] == FULL  # DP4+EP: rank-local tokens
    assert token_mode(parallel(ep=4, dp=2, sp=2))[0] == FULL  # sequence-parallel MoE: already chunked
    assert token_mode(parallel(ep=2, pcp=2))[0] == FULL
    assert token_mode(parallel(tp=2, use_ep=False))[0] == FULL
    assert token_mode(parallel())[0] == FULL
    monkeypatch.setenv("FLASHMOE_TP_SLICE", "0")
    assert token_mode(parallel(ep=4)) == (
        FULL,
        "FLASHMOE_TP_SLICE=0: every rank of TP4+EP dispatches all replicated tokens",
    )


def _slicing_worker(rank: int, world: int, port: int, cases_path: str, out_dir: str) -> None:
    init_cpu_rank(rank, world, port)
    try:
        cases = torch.load(cases_path)
        placement = ExpertPlacement.round_robin(E, world)
        w13, w2 = local_weights(cases["w13"], cases["w2"], placement, rank)
        spec = MoELayerSpec(E, K, H, I, max_tokens_per_rank=max(TOKEN_COUNTS[world]))
        moe = FlashMoE(spec, placement, layer_name="tp_slicing")

        def all_gather(part):
            gathered = part.new_empty(world * part.shape[0], part.shape[1])
            dist.all_gather_into_tensor(gathered, part)
            return gathered

        results = {}
        for T, (x, ids, w) in cases["tokens"].items():
            sliced = torch.full_like(x, float("nan"))  # every row must be written
            returned = sliced_forward(moe, x, ids, w, w13, w2, sliced, rank, world, all_gather)
            full = moe(x, ids, w, w13, w2)  # the unsliced ("full" mode) call, every rank all T tokens
            results[T] = {"sliced": sliced, "full": full, "returned_out": returned is sliced}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(RUN_LIMIT_S + 30)
@pytest.mark.parametrize("world", [2, 3])
def test_sliced_forward_matches_unsliced_reference(world, gen, tmp_path):
    w13, w2 = random_expert_weights(E, H, I, gen)
    tokens = {}
    for T in TOKEN_COUNTS[world]:
        ids, w = random_routing(T, E, K, "uniform", gen, drop_prob=0.2)
        tokens[T] = (random_hidden(T, H, gen), ids, w)
    torch.save({"w13": w13, "w2": w2, "tokens": tokens}, tmp_path / "cases.pt")
    run_ranks(_slicing_worker, world, (str(tmp_path / "cases.pt"), str(tmp_path)), timeout=RUN_LIMIT_S)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]

    for T, (x, ids, w) in tokens.items():
        single = moe_reference(x, ids, w, w13, w2)  # one rank, every expert, every token
        for rank in range(world):
            got = results[rank][T]
            assert got["returned_out"]
            assert got["sliced"].shape == (T, H) and got["sliced"].dtype == x.dtype
            # The gather hands every rank the same rows: bitwise equal to rank 0's.
            assert torch.equal(got["sliced"], results[0][T]["sliced"]), f"T={T}: rank {rank} differs from 0"
            if T == 0:
                continue
            what = f"world {world} T={T} rank {rank}"
            assert_within(
                got["sliced"], single, SAME_ROUNDING_REL_FRO, SAME_ROUNDING_ROW_REL, what + " vs single"
            )
            assert_within(
                got["sliced"], got["full"], SAME_ROUNDING_REL_FRO, SAME_ROUNDING_ROW_REL, what + " vs full"
            )
