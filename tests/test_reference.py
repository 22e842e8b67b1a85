"""The PyTorch reference semantics (issue 2): single-rank vs the fp64 oracle, the gloo expert-parallel
reference vs the single-rank result, input validation, and FlashMoE's CPU backend.

Error budgets are defined and justified in ``tolerances.py``. The distributed cases run in one spawned
process group per world size (all cases inside it) so the file stays well under a minute on 2 cores.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import flashmoe
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from flashmoe import (
    ExpertPlacement,
    FlashMoE,
    MoELayerSpec,
    moe_oracle_fp64,
    moe_reference,
    moe_reference_distributed,
)
from moe_inputs import (
    local_weights,
    make_placement,
    random_expert_weights,
    random_hidden,
    random_routing,
    storage_order,
)
from multiproc import init_cpu_rank, run_ranks
from tolerances import (
    ORACLE_REL_FRO,
    ORACLE_ROW_REL,
    SAME_ROUNDING_REL_FRO,
    SAME_ROUNDING_ROW_REL,
    assert_within,
)

# ---------------------------------------------------------------------------------------------
# Single rank: reference vs an independent fp64 oracle
# ---------------------------------------------------------------------------------------------


def naive_fp64(x, topk_ids, topk_weights, w13, w2) -> torch.Tensor:
    """The layer written straight from its definition, expert by expert, in float64 (shares no code
    with flashmoe.reference): out[t] = sum_j w[t,j] * w2[e] @ (silu(gate_e x_t) * (up_e x_t))."""
    x64 = x.double()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    inter = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        gate, up = w13[e, :inter].double(), w13[e, inter:].double()
        y = (F.silu(x64 @ gate.T) * (x64 @ up.T)) @ w2[e].double().T
        coef = ((topk_ids == e).double() * topk_weights.double()).sum(dim=1, keepdim=True)
        out += coef * y
    return out


REFERENCE_SHAPES = [
    # T, E, k, H, inter, routing, drop_prob
    (64, 8, 2, 256, 128, "uniform", 0.1),
    (97, 16, 4, 512, 256, "zipf", 0.0),
    (50, 32, 8, 256, 64, "one_expert", 0.3),
    (33, 8, 1, 1024, 512, "uniform", 0.5),
    (64, 64, 8, 256, 128, "zipf", 0.1),
    (1, 4, 4, 128, 64, "uniform", 0.0),
]


@pytest.mark.parametrize("T,E,k,H,inter,routing,drop", REFERENCE_SHAPES)
def test_reference_matches_fp64_oracle(T, E, k, H, inter, routing, drop, gen):
    x = random_hidden(T, H, gen)
    ids, w = random_routing(T, E, k, routing, gen, drop_prob=drop)
    w13, w2 = random_expert_weights(E, H, inter, gen)
    ref = moe_reference(x, ids, w, w13, w2)
    oracle = moe_oracle_fp64(x, ids, w, w13, w2)
    assert ref.dtype == torch.bfloat16 and ref.shape == (T, H)
    assert oracle.dtype == torch.float64 and oracle.shape == (T, H)
    # The oracle shares its loop with the reference; pin it to the definition first.
    naive = naive_fp64(x, ids, w, w13, w2)
    assert float((oracle - naive).norm()) <= 1e-12 * float(naive.norm())
    assert float(naive.norm()) > 0
    assert_within(ref, oracle, ORACLE_REL_FRO, ORACLE_ROW_REL, "moe_reference vs fp64 oracle")


def test_skipped_slots_ignore_their_weights(gen):
    """A -1 slot contributes nothing whatever its weight; rows with every slot -1 are exactly zero."""
    T, E, k, H, inter = 40, 8, 4, 256, 64
    x = random_hidden(T, H, gen)
    ids, w = random_routing(T, E, k, "uniform", gen, drop_prob=0.4)
    ids[:5] = -1
    w13, w2 = random_expert_weights(E, H, inter, gen)
    ref = moe_reference(x, ids, w, w13, w2)
    assert torch.equal(ref[:5], torch.zeros_like(ref[:5]))
    w_other = torch.where(ids >= 0, w, torch.rand(T, k, generator=gen) * 100)
    assert torch.equal(moe_reference(x, ids, w_other, w13, w2), ref)
    assert float(ref[5:].float().norm()) > 0


def test_gate_rows_come_first_in_w13(gen):
    """Swapping the gate and up halves of w13 changes the result (silu is applied to the first half)."""
    T, E, k, H, inter = 16, 4, 2, 128, 64
    x = random_hidden(T, H, gen)
    ids, w = random_routing(T, E, k, "uniform", gen)
    w13, w2 = random_expert_weights(E, H, inter, gen)
    swapped = torch.cat([w13[:, inter:], w13[:, :inter]], dim=1)
    ref = moe_reference(x, ids, w, w13, w2).double()
    assert_within(ref, naive_fp64(x, ids, w, w13, w2), ORACLE_REL_FRO, ORACLE_ROW_REL, "gate-first")
    assert float((moe_reference(x, ids, w, swapped, w2).double() - ref).norm()) > 0.1 * float(ref.norm())


def test_empty_batch():
    w13, w2 = random_expert_weights(8, 128, 64, torch.Generator().manual_seed(0))
    out = moe_reference(
        torch.empty(0, 128, dtype=torch.bfloat16),
        torch.empty(0, 2, dtype=torch.int32),
        torch.empty(0, 2),
        w13,
        w2,
    )
    assert out.shape == (0, 128) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["round_robin", "random_permutation"])
def test_storage_order_reference_equals_global_order(kind, gen):
    """The GPU suites feed moe_reference one tensor with every rank's experts back to back (each
    rank's weights are a view into it); that layout must give the same result as global order."""
    T, E, k, H, inter, world = 48, 12, 4, 128, 64, 4
    placement = make_placement(kind, E, world, gen)
    x = random_hidden(T, H, gen)
    ids, w = random_routing(T, E, k, "zipf", gen, drop_prob=0.1)
    w13, w2 = random_expert_weights(E, H, inter, gen)
    ref_placement, offsets = storage_order(placement)
    parts = [local_weights(w13, w2, placement, r) for r in range(world)]
    w13_s, w2_s = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    for r in range(world):
        assert torch.equal(w13_s[offsets[r] : offsets[r + 1]], parts[r][0])
    assert torch.equal(
        moe_reference(x, ids, w, w13_s, w2_s, ref_placement), moe_reference(x, ids, w, w13, w2)
    )


# ---------------------------------------------------------------------------------------------
# Expert parallel over gloo: every rank's rows equal the single-rank result for the global batch
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DistCase:
    name: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    tokens: tuple[int, ...]  # per rank of a 4-rank group; a 2-rank group takes the first two
    routing: str
    placement: str
    drop_prob: float = 0.0
    all_skipped_rank: int | None = None  # this rank's ids are all -1

    def tokens_for(self, world: int) -> list[int]:
        return list(self.tokens[:world])


DIST_CASES = [
    DistCase("uniform_contiguous", 16, 4, 256, 128, (37, 21, 64, 5), "uniform", "contiguous"),
    DistCase("empty_rank", 8, 2, 256, 128, (0, 29, 0, 48), "uniform", "round_robin"),
    DistCase("zipf_random_perm", 32, 8, 256, 64, (64, 17, 33, 1), "zipf", "random_permutation", 0.1),
    DistCase("one_expert", 16, 4, 128, 128, (40, 40, 9, 16), "one_expert", "random_permutation"),
    DistCase("one_expert_top1", 8, 1, 256, 64, (25, 3, 30, 12), "one_expert", "contiguous"),
    DistCase(
        "skipped_slots", 12, 4, 128, 64, (50, 20, 7, 31), "zipf", "round_robin", 0.5, all_skipped_rank=1
    ),
    DistCase("uneven_placement", 10, 3, 128, 64, (19, 23, 11, 2), "uniform", "random_permutation", 0.2),
    DistCase("all_ranks_empty", 8, 2, 128, 64, (0, 0, 0, 0), "uniform", "contiguous"),
]


def _make_global_case(case: DistCase, world: int, gen: torch.Generator) -> dict:
    tokens = case.tokens_for(world)
    total = sum(tokens)
    placement = make_placement(case.placement, case.num_experts, world, gen)
    ids, w = random_routing(total, case.num_experts, case.top_k, case.routing, gen, drop_prob=case.drop_prob)
    offsets = [0]
    for t in tokens:
        offsets.append(offsets[-1] + t)
    if case.all_skipped_rank is not None:
        ids[offsets[case.all_skipped_rank] : offsets[case.all_skipped_rank + 1]] = -1
    w13, w2 = random_expert_weights(case.num_experts, case.hidden, case.intermediate, gen)
    return {
        "x": random_hidden(total, case.hidden, gen),
        "ids": ids,
        "weights": w,
        "w13": w13,
        "w2": w2,
        "expert_rank": placement.expert_rank,
        "expert_local": placement.expert_local,
        "offsets": offsets,
        "spec": (case.num_experts, case.top_k, case.hidden, case.intermediate, max(1, max(tokens))),
    }


def _gloo_reference_worker(rank: int, world: int, port: int, cases_path: str, out_dir: str) -> None:
    """One rank: per case, moe_reference_distributed and a FlashMoE layer (CPU backend) on its rows."""
    init_cpu_rank(rank, world, port)
    try:
        cases = torch.load(cases_path)
        results = {}
        for name, c in cases.items():
            placement = ExpertPlacement(c["expert_rank"], c["expert_local"], world)
            rows = slice(c["offsets"][rank], c["offsets"][rank + 1])
            x, ids, w = c["x"][rows], c["ids"][rows], c["weights"][rows]
            w13, w2 = local_weights(c["w13"], c["w2"], placement, rank)
            distributed = moe_reference_distributed(x, ids, w, w13, w2, placement)
            layer = FlashMoE(MoELayerSpec(*c["spec"]), placement, layer_name=name)
            out = torch.full_like(x, float("nan"))
            got = layer(x, ids, w, w13, w2, out=out)
            results[name] = {
                "distributed": distributed,
                "flashmoe": got,
                "backend": layer.backend,
                "returned_out": got is out,
            }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# Hard bound on one world's process group: ~10 s on an idle 2-core machine, generous for a loaded one.
GLOO_RUN_LIMIT_S = 150
_DIST_RUNS: dict[int, tuple[dict, list[dict]] | BaseException] = {}


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory):
    """world -> (global cases, per-rank results); each world's process group runs once per module
    (a failure too: the other tests of that world report it instead of running it again)."""
    from conftest import SESSION_SEED

    def run(world: int):
        if world not in _DIST_RUNS:
            gen = torch.Generator().manual_seed(SESSION_SEED + world)
            cases = {c.name: _make_global_case(c, world, gen) for c in DIST_CASES}
            d = tmp_path_factory.mktemp(f"gloo{world}")
            torch.save(cases, d / "cases.pt")
            try:
                run_ranks(
                    _gloo_reference_worker, world, (str(d / "cases.pt"), str(d)), timeout=GLOO_RUN_LIMIT_S
                )
                _DIST_RUNS[world] = (cases, [torch.load(d / f"rank{r}.pt") for r in range(world)])
            except Exception as e:
                _DIST_RUNS[world] = e
        if isinstance(_DIST_RUNS[world], BaseException):
            raise RuntimeError(f"the {world}-rank gloo run failed") from _DIST_RUNS[world]
        return _DIST_RUNS[world]

    return run


@pytest.mark.timeout(GLOO_RUN_LIMIT_S + 30)
@pytest.mark.parametrize("case", DIST_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("world", [2, 4])
def test_distributed_reference_equals_single_rank(world, case, gloo_runs):
    cases, results = gloo_runs(world)
    c = cases[case.name]
    single = moe_reference(c["x"], c["ids"], c["weights"], c["w13"], c["w2"])
    for rank in range(world):
        rows = slice(c["offsets"][rank], c["offsets"][rank + 1])
        got = results[rank][case.name]["distributed"]
        assert got.dtype == torch.bfloat16 and got.shape == single[rows].shape
        assert_within(
            got,
            single[rows],
            SAME_ROUNDING_REL_FRO,
            SAME_ROUNDING_ROW_REL,
            f"rank {rank}/{world} {case.name}",
        )
    if single.numel() and case.all_skipped_rank is None:
        assert float(single.float().norm()) > 0


@pytest.mark.timeout(GLOO_RUN_LIMIT_S + 30)
@pytest.mark.parametrize("world", [2, 4])
def test_flashmoe_cpu_backend_in_gloo_group(world, gloo_runs):
    """FlashMoE on CPU inside an EP group runs the distributed reference: same bits, out= filled."""
    _, results = gloo_runs(world)
    for rank, per_case in enumerate(results):
        for name, r in per_case.items():
            assert r["backend"] == "reference", (rank, name)
            assert r["returned_out"], f"rank {rank} {name}: FlashMoE did not return the out= tensor"
            assert torch.equal(r["flashmoe"], r["distributed"]), (
                f"rank {rank} {name}: FlashMoE != moe_reference_distributed"
            )


# ---------------------------------------------------------------------------------------------
# FlashMoE on one CPU process
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def no_backend_override(monkeypatch):
    for name in ("FLASHMOE_BACKEND", "FLASHMOE_STRICT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("T", [0, 1, 45])
def test_flashmoe_cpu_world1_equals_reference(T, gen, no_backend_override):
    E, k, H, inter = 16, 4, 256, 128
    placement = make_placement("random_permutation", E, 1, gen)
    moe = FlashMoE(MoELayerSpec(E, k, H, inter, max_tokens_per_rank=64), placement, layer_name="cpu_test")
    assert moe.backend == "reference" and "cpu" in moe.reason, moe.reason
    assert "backend=reference" in repr(moe)
    x = random_hidden(T, H, gen)
    ids, w = random_routing(T, E, k, "zipf", gen, drop_prob=0.2)
    w13_g, w2_g = random_expert_weights(E, H, inter, gen)
    w13, w2 = local_weights(w13_g, w2_g, placement, 0)
    expected = moe_reference(x, ids, w, w13_g, w2_g)
    assert torch.equal(moe(x, ids, w, w13, w2), expected)
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
    got = moe(x, ids, w, w13, w2, out=out)
    assert got is out and torch.equal(out, expected)


def test_flashmoe_strict_refuses_cpu(monkeypatch):
    monkeypatch.setenv("FLASHMOE_STRICT", "1")
    monkeypatch.delenv("FLASHMOE_BACKEND", raising=False)
    with pytest.raises(flashmoe.FlashMoEUnsupported, match="device is cpu"):
        FlashMoE(MoELayerSpec(8, 2, 128, 64, 16), ExpertPlacement.contiguous(8, 1))


# ---------------------------------------------------------------------------------------------
# Bad input: a ValueError that names the problem, from every entry point
# ---------------------------------------------------------------------------------------------

E_BAD, K_BAD, H_BAD, I_BAD, T_BAD = 8, 2, 128, 64, 6


def _valid_inputs():
    g = torch.Generator().manual_seed(7)
    x = random_hidden(T_BAD, H_BAD, g)
    ids, w = random_routing(T_BAD, E_BAD, K_BAD, "uniform", g)
    w13, w2 = random_expert_weights(E_BAD, H_BAD, I_BAD, g)
    return {"x": x, "ids": ids, "w": w, "w13": w13, "w2": w2}


BAD_INPUTS = [
    ("x_1d", lambda a: a.update(x=a["x"][0]), "hidden_states must be"),
    ("x_int", lambda a: a.update(x=a["x"].to(torch.int32)), "hidden_states dtype"),
    ("ids_int64", lambda a: a.update(ids=a["ids"].long()), "topk_ids must be int32"),
    ("ids_wrong_T", lambda a: a.update(ids=a["ids"][:-1], w=a["w"][:-1]), r"topk_ids must be \[T=6"),
    ("ids_1d", lambda a: a.update(ids=a["ids"][:, 0]), "topk_ids must be"),
    ("weights_shape", lambda a: a.update(w=a["w"][:, :1]), "topk_weights shape"),
    ("weights_bf16", lambda a: a.update(w=a["w"].bfloat16()), "topk_weights must be float32"),
    ("id_too_large", lambda a: a["ids"].__setitem__((2, 1), E_BAD), r"topk_ids values must be in \[-1, 8\)"),
    ("id_below_minus_one", lambda a: a["ids"].__setitem__((0, 0), -2), "topk_ids values"),
    ("w13_2d", lambda a: a.update(w13=a["w13"][0]), "w13 must be"),
    ("w13_wrong_hidden", lambda a: a.update(w13=a["w13"][:, :, :64]), "does not fit hidden size"),
    ("w13_odd_rows", lambda a: a.update(w13=a["w13"][:, :-1]), "does not fit hidden size"),
    ("w2_wrong_inter", lambda a: a.update(w2=a["w2"][:, :, :32]), r"w2 shape .* implied by w13"),
    ("w2_wrong_experts", lambda a: a.update(w2=a["w2"][:-1]), "w2 shape"),
    ("w2_transposed", lambda a: a.update(w2=a["w2"].transpose(1, 2)), "w2 shape"),
    ("weights_fp32", lambda a: a.update(w13=a["w13"].float(), w2=a["w2"].float()), "w13/w2 dtype"),
    ("too_few_experts", lambda a: a.update(w13=a["w13"][:-1], w2=a["w2"][:-1]), "placement gives rank 0 8"),
]


@pytest.mark.parametrize("name,corrupt,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
@pytest.mark.parametrize("entry", ["moe_reference", "moe_oracle_fp64", "FlashMoE"])
def test_bad_input_raises_value_error(entry, name, corrupt, match, no_backend_override):
    a = _valid_inputs()
    corrupt(a)
    args = (a["x"], a["ids"], a["w"], a["w13"], a["w2"], ExpertPlacement.contiguous(E_BAD, 1))
    if entry == "moe_reference":
        call = lambda: moe_reference(*args)  # noqa: E731
    elif entry == "moe_oracle_fp64":
        call = lambda: moe_oracle_fp64(*args)  # noqa: E731
    else:
        moe = FlashMoE(MoELayerSpec(E_BAD, K_BAD, H_BAD, I_BAD, 1024), args[-1])
        call = lambda: moe(*args[:-1])  # noqa: E731
    with pytest.raises(ValueError, match=match):
        call()


def test_flashmoe_construction_and_call_errors(no_backend_override):
    spec = MoELayerSpec(E_BAD, K_BAD, H_BAD, I_BAD, max_tokens_per_rank=4)
    with pytest.raises(ValueError, match="placement is for 2 ranks, EP group has 1"):
        FlashMoE(spec, ExpertPlacement.contiguous(E_BAD, 2))
    moe = FlashMoE(spec, ExpertPlacement.contiguous(E_BAD, 1))
    a = _valid_inputs()  # 6 tokens > 4
    with pytest.raises(ValueError, match="6 tokens exceed max_tokens_per_rank=4"):
        moe(a["x"], a["ids"], a["w"], a["w13"], a["w2"])


def test_flashmoe_names_bad_shape_before_token_count(no_backend_override):
    a = _valid_inputs()
    moe = FlashMoE(MoELayerSpec(E_BAD, K_BAD, H_BAD, I_BAD, 64), ExpertPlacement.contiguous(E_BAD, 1))
    with pytest.raises(ValueError, match="hidden_states must be"):
        moe(a["x"][0], a["ids"], a["w"], a["w13"], a["w2"])


def test_reference_refuses_multi_rank_placement():
    a = _valid_inputs()
    with pytest.raises(ValueError, match="moe_reference_distributed"):
        moe_reference(a["x"], a["ids"], a["w"], a["w13"], a["w2"], ExpertPlacement.contiguous(E_BAD, 2))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"num_experts": 0}, ValueError, "num_experts must be a positive int"),
        ({"top_k": 9}, ValueError, "top_k=9 exceeds num_experts=8"),
        ({"hidden_size": -128}, ValueError, "hidden_size"),
        ({"intermediate_size": 64.0}, TypeError, "intermediate_size"),
        ({"max_tokens_per_rank": 0}, ValueError, "max_tokens_per_rank"),
    ],
)
def test_layer_spec_validation(kwargs, error, match):
    base = {
        "num_experts": 8,
        "top_k": 2,
        "hidden_size": 128,
        "intermediate_size": 64,
        "max_tokens_per_rank": 16,
    }
    with pytest.raises(error, match=match):
        MoELayerSpec(**{**base, **kwargs})


def test_oracle_bound_is_meaningful():
    """The budgets are tight enough to see one wrong expert in a batch: swapping one token's expert
    for another exceeds the per-row budget by a wide margin."""
    g = torch.Generator().manual_seed(11)
    T, E, k, H, inter = 64, 8, 2, 256, 128
    x = random_hidden(T, H, g)
    ids, w = random_routing(T, E, k, "uniform", g)
    w13, w2 = random_expert_weights(E, H, inter, g)
    oracle = moe_oracle_fp64(x, ids, w, w13, w2)
    j = int(w[3].argmax())  # the heavier slot (weight >= 0.5)
    wrong = ids.clone()
    wrong[3, j] = next(e for e in range(E) if e not in ids[3].tolist())
    bad = moe_reference(x, wrong, w, w13, w2)
    row_err = float((bad[3].double() - oracle[3]).norm() / oracle[3].norm())
    assert row_err > 10 * ORACLE_ROW_REL
