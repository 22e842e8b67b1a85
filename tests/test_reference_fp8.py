"""The fp8 block-scaled semantics (issue 15): the quantisation rule, the weight block cast, the fp8
reference against its fp64 oracle (and the oracle against the definition), routing edge cases, the
bf16 path as a special case, input validation and the gloo expert-parallel reference.

Budgets are derived and measured in ``tolerances.py`` ("fp8"). Inputs come from ``moe_inputs.py``:
activations and weights with a different magnitude per 128-group and per 128 x 128 block, so a scale
applied to the wrong group or block shows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from flashmoe import ExpertPlacement, moe_reference
from flashmoe.fp8 import (
    AMAX_FLOOR,
    E4M3,
    E4M3_MAX,
    dequantize_per_token_group,
    dequantize_weight_blocks,
    quantize_per_token_group,
    quantize_weight_blocks,
)
from flashmoe.reference_fp8 import moe_oracle_fp64_fp8, moe_reference_distributed_fp8, moe_reference_fp8
from moe_inputs import (
    local_weights,
    make_placement,
    random_fp8_expert_weights,
    random_grouped_hidden,
    random_routing,
)
from multiproc import init_cpu_rank, run_ranks
from tolerances import (
    E4M3_UNIT_ROUNDOFF,
    FP8_ACTIVATION_QUANTISATION_REL_FRO,
    FP8_ORACLE_REL_FRO,
    MIN_ROWS_FOR_BATCH_BUDGET,
    ORACLE_REL_FRO,
    ErrorStats,
    assert_within,
    error_stats,
    fp8_row_rel,
    kernel_budgets,
)

FLOOR32 = float(torch.tensor(AMAX_FLOOR, dtype=torch.float32))
FLOOR_SCALE = float(torch.tensor(FLOOR32) / 448.0)  # an all-zero group's scale, fp32 division

# ---------------------------------------------------------------------------------------------
# The e4m3 grid and the quantisation rule, restated here from their definitions
# ---------------------------------------------------------------------------------------------


def e4m3_round_half_even(v: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the e4m3 grid (|v| <= 448), exactly, in float64: the spacing for
    |v| in [2**e, 2**(e+1)) is 2**(e - 3), and 2**-9 below 2**-6 (subnormals)."""
    v = v.double()
    _, exp = torch.frexp(v)  # |v| = m * 2**exp with m in [0.5, 1): the leading bit is 2**(exp - 1)
    spacing = torch.ldexp(torch.ones_like(v), (exp - 1).clamp(min=-6) - 3)
    return torch.round(v / spacing) * spacing  # torch.round: half to even


def expected_group_quantisation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule of flashmoe.fp8 on x [T, K] (fp32 steps), with the e4m3 rounding done independently."""
    groups = x.float().reshape(x.shape[0], -1, 128)
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=FLOOR32) / 448.0
    scaled = (groups * (1.0 / scale)).clamp(-448.0, 448.0)
    return e4m3_round_half_even(scaled).reshape(x.shape), scale.squeeze(-1)


def all_e4m3_values() -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    return codes[torch.isfinite(codes)].unique()


def test_e4m3_cast_is_round_to_nearest_even(gen):
    """The quantiser's fp32 -> e4m3 cast is round-to-nearest-even, as CUDA's cvt.rn.satfinite: on every
    grid value, every midpoint (ties to even), one fp32 ulp either side of it, and random values."""
    grid = all_e4m3_values()
    assert grid.numel() == 253 and float(grid.max()) == E4M3_MAX
    assert torch.equal(e4m3_round_half_even(grid).float(), grid)
    mid = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1)])
    spread = torch.exp2(torch.randint(-12, 9, (100_000,), generator=gen).float())
    rand = (torch.randn(100_000, generator=gen) * spread).clamp(-E4M3_MAX, E4M3_MAX)
    for v in (grid, near, rand):
        assert torch.equal(v.to(E4M3).double(), e4m3_round_half_even(v)), "fp32 -> e4m3 is not RNE"
    # The midpoints check half-to-even, not a one-sided rule: about half of them go each way.
    rounded_mid = e4m3_round_half_even(mid)
    assert int((rounded_mid > mid).sum()) > 100 and int((rounded_mid < mid).sum()) > 100


def test_quantize_per_token_group_rule(gen):
    """Scale = max(amax, 1e-4) / 448 per (token, group) in fp32, q exactly the rule's (ties decided by
    the fp32 steps), |q| <= 448 reached by each group's largest element, and the round trip within
    half an e4m3 step; all-zero and tiny groups included."""
    T, H = 64, 1024  # 65536 values: ~340 exact e4m3 ties, ~30 that the fp32 steps decide against half-even
    x = random_grouped_hidden(T, H, gen)
    x[0, :128] = 0  # all-zero group
    x[1, 128:256] = (torch.randn(128, generator=gen) * 3e-6).bfloat16()  # below the amax floor
    x[2, 256:384] *= 4096  # a large group
    x[3, 384:512] = 0
    x[3, 400] = -0.375  # one non-zero element
    q, scale = quantize_per_token_group(x)
    assert q.dtype == E4M3 and q.shape == (T, H)
    assert scale.dtype == torch.float32 and scale.shape == (T, H // 128)
    q_expected, scale_expected = expected_group_quantisation(x)
    assert torch.equal(scale, scale_expected)
    assert torch.equal(q.double(), q_expected)
    q_groups = q.float().reshape(T, -1, 128).abs()
    assert float(q_groups.max()) <= E4M3_MAX
    amax = x.float().reshape(T, -1, 128).abs().amax(dim=-1)
    assert torch.equal(
        q_groups.amax(dim=-1)[amax >= FLOOR32], torch.full_like(amax[amax >= FLOOR32], E4M3_MAX)
    )

    assert torch.equal(q[0, :128].float(), torch.zeros(128)) and float(scale[0, 0]) == FLOOR_SCALE
    assert torch.isfinite(scale).all() and float(scale.min()) > 0
    assert float(scale[1, 1]) == FLOOR_SCALE

    back = dequantize_per_token_group(q, scale, dtype=torch.float64)
    err = (back - x.double()).abs()
    s = scale.double().repeat_interleave(128, dim=1)
    normal = x.double().abs() >= s * 2.0**-6  # e4m3 normal range: relative error <= unit roundoff
    assert bool((err[normal] <= x.double().abs()[normal] * E4M3_UNIT_ROUNDOFF * (1 + 1e-6)).all())
    assert bool((err[~normal] <= s[~normal] * 2.0**-10 * (1 + 1e-6)).all())  # half the 2**-9 subnormal step


def test_representable_groups_round_trip_exactly(gen):
    """A group that is e4m3 values times a power of two, with 448 among them, comes back unchanged:
    scale = that power of two, q = those values."""
    T, H = 8, 384
    grid = all_e4m3_values()
    q0 = grid[torch.randint(grid.numel(), (T, H), generator=gen)]
    q0.view(T, -1, 128)[:, :, 0] = E4M3_MAX * torch.where(
        torch.rand(T, H // 128, generator=gen) < 0.5, -1.0, 1.0
    )
    power = torch.exp2(torch.randint(-12, 4, (T, H // 128), generator=gen).float())
    x = (q0.view(T, -1, 128) * power[..., None]).reshape(T, H).bfloat16()
    assert torch.equal(x.float(), (q0.view(T, -1, 128) * power[..., None]).reshape(T, H))  # bf16-exact
    q, scale = quantize_per_token_group(x)
    assert torch.equal(scale, power)
    assert torch.equal(q.float(), q0)
    assert torch.equal(dequantize_per_token_group(q, scale).bfloat16(), x)


def test_quantize_weight_blocks(gen):
    """One scale per 128 x 128 block (DeepGEMM's per_block_cast_to_fp8 rule), the layout vLLM loads
    ``*_weight_scale_inv`` in; each block's largest weight maps to 448; an all-zero block is zero."""
    E, N, K = 3, 256, 384
    magnitude = torch.exp2(torch.rand(E, N // 128, 1, K // 128, 1, generator=gen) * 6 - 3)
    w = (torch.randn(E, N // 128, 128, K // 128, 128, generator=gen) * magnitude).reshape(E, N, K)
    w[1, 128:, :128] = 0
    q, s = quantize_weight_blocks(w)
    assert q.dtype == E4M3 and q.shape == (E, N, K)
    assert s.dtype == torch.float32 and s.shape == (E, N // 128, K // 128)
    tiles = w.reshape(E, N // 128, 128, K // 128, 128)
    amax = tiles.abs().amax(dim=(2, 4))
    assert torch.equal(s, amax.clamp(min=FLOOR32) / 448.0)
    assert float(s.max() / s.min()) > 2  # the blocks really differ, so a swapped scale would show
    q_tiles = q.float().reshape(E, N // 128, 128, K // 128, 128).abs()
    assert torch.equal(q_tiles.amax(dim=(2, 4)), torch.where(amax > 0, E4M3_MAX, 0.0))
    assert float(s[1, 1, 0]) == FLOOR_SCALE
    back = dequantize_weight_blocks(q, s, dtype=torch.float64)
    s_full = s.double().repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
    normal = w.double().abs() >= s_full * 2.0**-6
    err = (back - w.double()).abs()
    assert bool((err[normal] <= w.double().abs()[normal] * E4M3_UNIT_ROUNDOFF * (1 + 1e-6)).all())
    assert bool((err[~normal] <= s_full[~normal] * 2.0**-10 * (1 + 1e-6)).all())
    with pytest.raises(ValueError, match="multiples of the block size 128"):
        quantize_weight_blocks(torch.randn(128, 200))
    with pytest.raises(ValueError, match="multiple of the group size 128"):
        quantize_per_token_group(torch.randn(4, 100))


# ---------------------------------------------------------------------------------------------
# The layer: reference vs oracle, oracle vs the definition
# ---------------------------------------------------------------------------------------------


def naive_fp8_fp64(x, topk_ids, topk_weights, w13, s13, w2, s2) -> torch.Tensor:
    """The fp8 layer from its definition, expert by expert, in float64 (no flashmoe code besides what
    this file restates): dequantise with each block's scale, quantise x and the activation with the
    rule (fp32 steps), the rest exact."""

    def dequant_blocks(w, s):
        return w.double() * s.double().repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)

    def quant_dequant(v):
        q, scale = expected_group_quantisation(v.float())
        return (q.view(v.shape[0], -1, 128) * scale.double()[..., None]).reshape(v.shape)

    x64 = quant_dequant(x)
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        gate_up = x64 @ dequant_blocks(w13[e], s13[e]).T
        act = quant_dequant(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
        coef = ((topk_ids == e).double() * topk_weights.double()).sum(dim=1, keepdim=True)
        out += coef * (act @ dequant_blocks(w2[e], s2[e]).T)
    return out


FP8_SHAPES = [
    # T, E, k, H, I, routing, drop_prob
    (32, 8, 4, 512, 256, "uniform", 0.1),
    (48, 16, 8, 256, 128, "zipf", 0.2),
    (17, 4, 1, 1024, 384, "one_expert", 0.0),
    (6, 8, 8, 2048, 768, "uniform", 0.05),  # Qwen3-30B-A3B routed experts (E 128 -> 8)
]
DEEPSEEK_V3 = (2, 8, 8, 7168, 2048, "uniform", 0.0)  # routed experts (E 256 -> 8); one draw: 11 s


@pytest.mark.parametrize(
    "T,E,k,H,inter,routing,drop,draw",
    [(*shape, draw) for shape in FP8_SHAPES for draw in (0, 1)] + [(*DEEPSEEK_V3, 0)],
)
def test_reference_matches_fp64_oracle(T, E, k, H, inter, routing, drop, draw, gen):
    """``draw`` only makes a second test id, hence a second seed."""
    x = random_grouped_hidden(T, H, gen)
    ids, w = random_routing(T, E, k, routing, gen, drop_prob=drop)
    weights = random_fp8_expert_weights(E, H, inter, gen)
    ref = moe_reference_fp8(x, ids, w, *weights)
    oracle = moe_oracle_fp64_fp8(x, ids, w, *weights)
    assert ref.dtype == torch.bfloat16 and ref.shape == (T, H)
    assert oracle.dtype == torch.float64 and oracle.shape == (T, H)
    assert float(oracle.norm()) > 0
    if H <= 2048:  # the oracle's code does not depend on the shape; pinning it at 7168 costs 5 s
        naive = naive_fp8_fp64(x, ids, w, *weights)
        assert float((oracle - naive).norm()) <= 1e-12 * float(naive.norm())
    assert_within(ref, oracle, FP8_ORACLE_REL_FRO, fp8_row_rel(inter), "moe_reference_fp8 vs fp64 oracle")


def test_reference_does_not_depend_on_the_batch(gen):
    """Each (token, slot) is computed the same whatever else is in the batch (exact block sums, fixed
    order): a sub-batch gives the same bits, so kernel-vs-reference differences are the kernel's."""
    T, E, k, H, inter = 40, 8, 4, 512, 256
    x = random_grouped_hidden(T, H, gen)
    ids, w = random_routing(T, E, k, "zipf", gen, drop_prob=0.1)
    weights = random_fp8_expert_weights(E, H, inter, gen)
    full = moe_reference_fp8(x, ids, w, *weights)
    for rows in (slice(0, 1), slice(7, 23), slice(T - 5, T)):
        assert torch.equal(moe_reference_fp8(x[rows], ids[rows], w[rows], *weights), full[rows])


def test_skipped_slots_ignore_their_weights(gen):
    T, E, k, H, inter = 24, 8, 4, 256, 128
    x = random_grouped_hidden(T, H, gen)
    ids, w = random_routing(T, E, k, "uniform", gen, drop_prob=0.4)
    ids[:4] = -1
    weights = random_fp8_expert_weights(E, H, inter, gen)
    ref = moe_reference_fp8(x, ids, w, *weights)
    assert torch.equal(ref[:4], torch.zeros_like(ref[:4]))
    assert torch.equal(moe_oracle_fp64_fp8(x, ids, w, *weights)[:4], torch.zeros(4, H, dtype=torch.float64))
    w_other = torch.where(ids >= 0, w, torch.rand(T, k, generator=gen) * 100)
    assert torch.equal(moe_reference_fp8(x, ids, w_other, *weights), ref)
    assert float(ref[4:].float().norm()) > 0


def test_duplicate_ids_count_twice(gen):
    """An id twice in a row contributes twice, each time with its own weight, summed in slot order:
    out = bf16(fp32(a * y) + fp32(b * y)) with y the expert's bf16 output."""
    T, E, H, inter = 10, 4, 256, 128
    x = random_grouped_hidden(T, H, gen)
    weights = random_fp8_expert_weights(E, H, inter, gen)
    expert = torch.randint(E, (T, 1), generator=gen, dtype=torch.int32)
    y = moe_reference_fp8(x, expert, torch.ones(T, 1), *weights).float()  # 1.0 * y is exact
    a, b = torch.rand(T, 1, generator=gen), torch.rand(T, 1, generator=gen)
    doubled = moe_reference_fp8(x, expert.repeat(1, 2), torch.cat([a, b], dim=1), *weights)
    assert torch.equal(doubled, (a * y + b * y).bfloat16())
    once = moe_reference_fp8(
        x, torch.cat([expert, torch.full_like(expert, -1)], dim=1), torch.cat([a, b], dim=1), *weights
    )
    assert not torch.equal(once, doubled)


def test_fp8_path_is_the_bf16_path_plus_activation_quantisation(gen):
    """With weights whose bf16 values are exactly representable (e4m3 values times a power of two
    per block, 448 in each block), the fp8 and bf16 references compute the same layer on the same
    weights; they differ by the activation quantisation only: by about its derived size, far more
    than the bf16 rounding the bf16 path alone has."""
    T, E, k, H, inter = 48, 8, 4, 512, 256
    grid = all_e4m3_values()

    def representable(rows, cols):
        q0 = grid[torch.randint(grid.numel(), (E, rows, cols), generator=gen)]
        q0.view(E, rows // 128, 128, cols // 128, 128)[:, :, 0, :, 0] = E4M3_MAX
        power = torch.exp2(torch.randint(-14, -8, (E, rows // 128, 1, cols // 128, 1), generator=gen).float())
        return (q0.view(E, rows // 128, 128, cols // 128, 128) * power).reshape(E, rows, cols).bfloat16()

    w13_bf16, w2_bf16 = representable(2 * inter, H), representable(H, inter)
    (w13, s13), (w2, s2) = quantize_weight_blocks(w13_bf16), quantize_weight_blocks(w2_bf16)
    assert torch.equal(dequantize_weight_blocks(w13, s13).bfloat16(), w13_bf16)
    assert torch.equal(dequantize_weight_blocks(w2, s2).bfloat16(), w2_bf16)
    x = random_grouped_hidden(T, H, gen)
    ids, w = random_routing(T, E, k, "uniform", gen, drop_prob=0.1)
    fp8 = moe_reference_fp8(x, ids, w, w13, s13, w2, s2)
    bf16 = moe_reference(x, ids, w, w13_bf16, w2_bf16)
    stats = error_stats(fp8, bf16)
    assert ORACLE_REL_FRO < stats.rel_fro <= FP8_ACTIVATION_QUANTISATION_REL_FRO, stats


def test_oracle_bound_is_meaningful(gen):
    """One wrong expert in the heavier slot of one token exceeds that row's budget many times over."""
    T, E, k, H, inter = 16, 8, 2, 512, 1024
    x = random_grouped_hidden(T, H, gen)
    ids, w = random_routing(T, E, k, "uniform", gen)
    weights = random_fp8_expert_weights(E, H, inter, gen)
    oracle = moe_oracle_fp64_fp8(x, ids, w, *weights)
    j = int(w[3].argmax())
    wrong = ids.clone()
    wrong[3, j] = next(e for e in range(E) if e not in ids[3].tolist())
    bad = moe_reference_fp8(x, wrong, w, *weights)
    row_err = float((bad[3].double() - oracle[3]).norm() / oracle[3].norm())
    assert row_err > 10 * fp8_row_rel(inter)


# ---------------------------------------------------------------------------------------------
# Bad input: a ValueError (TypeError for a missing tensor) that names the problem
# ---------------------------------------------------------------------------------------------

E_BAD, K_BAD, T_BAD = 4, 2, 5


def fp8_args(x, ids, w, weights) -> dict:
    """One call's inputs by short name; ``weights`` = (w13, s13, w2, s2)."""
    return dict(zip(("x", "ids", "w", "w13", "s13", "w2", "s2"), (x, ids, w, *weights), strict=True))


def _valid_fp8_inputs(H=512, inter=128):
    g = torch.Generator().manual_seed(3)
    ids, w = random_routing(T_BAD, E_BAD, K_BAD, "uniform", g)
    weights = random_fp8_expert_weights(E_BAD, H, inter, g)
    return fp8_args(random_grouped_hidden(T_BAD, H, g), ids, w, weights)


def _unaligned(H, inter):
    """Inputs with H or I off the 128 grid (shapes consistent otherwise, scales sized by ceil)."""
    g = torch.Generator().manual_seed(4)
    ids, w = random_routing(T_BAD, E_BAD, K_BAD, "uniform", g)
    up = lambda n: -(-n // 128)  # noqa: E731
    return {
        "x": torch.randn(T_BAD, H, generator=g).bfloat16(),
        "ids": ids,
        "w": w,
        "w13": torch.randn(E_BAD, 2 * inter, H, generator=g).to(E4M3),
        "s13": torch.ones(E_BAD, up(2 * inter), up(H)),
        "w2": torch.randn(E_BAD, H, inter, generator=g).to(E4M3),
        "s2": torch.ones(E_BAD, up(H), up(inter)),
    }


BAD_FP8_INPUTS = [
    (
        "weights_bf16",
        lambda a: a.update(w13=a["w13"].bfloat16(), w2=a["w2"].bfloat16()),
        ValueError,
        "must be torch.float8_e4m3fn",
    ),
    ("w2_bf16", lambda a: a.update(w2=a["w2"].bfloat16()), ValueError, "must be torch.float8_e4m3fn"),
    ("hidden_fp32", lambda a: a.update(x=a["x"].float()), ValueError, "takes bf16 hidden states"),
    (
        "w13_scale_transposed",
        lambda a: a.update(s13=a["s13"].transpose(1, 2)),
        ValueError,
        r"w13_scale_inv shape \(4, 4, 2\) != \(4, 2, 4\)",
    ),
    ("w2_scale_missing_expert", lambda a: a.update(s2=a["s2"][:-1]), ValueError, "w2_scale_inv shape"),
    (
        "w2_scale_per_tensor",
        lambda a: a.update(s2=a["s2"].amax(dim=(1, 2))),
        ValueError,
        "w2_scale_inv shape",
    ),
    ("scale_bf16", lambda a: a.update(s13=a["s13"].bfloat16()), ValueError, "w13_scale_inv must be float32"),
    ("scale_none", lambda a: a.update(s2=None), TypeError, "w2_scale_inv must be a torch.Tensor"),
    ("hidden_192", lambda a: a.update(_unaligned(192, 128)), ValueError, "H and I multiples of 128.*H=192"),
    ("inter_64", lambda a: a.update(_unaligned(256, 64)), ValueError, "H and I multiples of 128.*I=64"),
    ("w2_wrong_inter", lambda a: a.update(w2=a["w2"][:, :, :64]), ValueError, r"w2 shape .* implied by w13"),
]


def _call(entry, a, placement):
    return entry(a["x"], a["ids"], a["w"], a["w13"], a["s13"], a["w2"], a["s2"], placement)


@pytest.mark.parametrize("name,corrupt,error,match", BAD_FP8_INPUTS, ids=[b[0] for b in BAD_FP8_INPUTS])
@pytest.mark.parametrize("entry", [moe_reference_fp8, moe_oracle_fp64_fp8], ids=lambda f: f.__name__)
def test_bad_fp8_input_raises(entry, name, corrupt, error, match):
    a = _valid_fp8_inputs()
    corrupt(a)
    with pytest.raises(error, match=match):
        _call(entry, a, ExpertPlacement.contiguous(E_BAD, 1))


def test_fp8_reference_refuses_multi_rank_placement():
    a = _valid_fp8_inputs()
    with pytest.raises(ValueError, match="moe_reference_distributed_fp8"):
        _call(moe_reference_fp8, a, ExpertPlacement.contiguous(E_BAD, 2))


# ---------------------------------------------------------------------------------------------
# Expert parallel over gloo: the same bits as the single-rank reference
# ---------------------------------------------------------------------------------------------

DIST_WORLD = 2
DIST_CASES = {
    # name: (E, k, H, I, tokens per rank, placement, drop_prob)
    "random_perm": (8, 4, 256, 128, (21, 9), "random_permutation", 0.1),
    "idle_rank": (6, 2, 512, 256, (0, 13), "round_robin", 0.0),
}


def ep_case(x, ids, w, weights, placement: ExpertPlacement, tokens: tuple[int, int]) -> dict:
    """One two-rank EP case as the gloo workers load it: the global batch, every expert's ``weights``
    (w13, s13, w2, s2), the placement and each rank's rows (``tokens`` per rank)."""
    return fp8_args(x, ids, w, weights) | {
        "expert_rank": placement.expert_rank,
        "expert_local": placement.expert_local,
        "offsets": [0, tokens[0], sum(tokens)],
    }


def _fp8_gloo_worker(rank: int, world: int, port: int, cases_path: str, out_dir: str) -> None:
    init_cpu_rank(rank, world, port)
    try:
        results = {}
        for name, c in torch.load(cases_path).items():
            placement = ExpertPlacement(c["expert_rank"], c["expert_local"], world)
            rows = slice(c["offsets"][rank], c["offsets"][rank + 1])
            w13, w2 = local_weights(c["w13"], c["w2"], placement, rank)
            s13, s2 = local_weights(c["s13"], c["s2"], placement, rank)
            results[name] = moe_reference_distributed_fp8(
                c["x"][rows], c["ids"][rows], c["w"][rows], w13, s13, w2, s2, placement
            )
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(200)
def test_distributed_fp8_equals_single_rank(gen, tmp_path):
    cases = {}
    for name, (E, k, H, inter, tokens, placement_kind, drop) in DIST_CASES.items():
        placement = make_placement(placement_kind, E, DIST_WORLD, gen)
        ids, w = random_routing(sum(tokens), E, k, "zipf", gen, drop_prob=drop)
        weights = random_fp8_expert_weights(E, H, inter, gen)
        cases[name] = ep_case(random_grouped_hidden(sum(tokens), H, gen), ids, w, weights, placement, tokens)
    torch.save(cases, tmp_path / "cases.pt")
    run_ranks(_fp8_gloo_worker, DIST_WORLD, (str(tmp_path / "cases.pt"), str(tmp_path)), timeout=150)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(DIST_WORLD)]
    for name, c in cases.items():
        single = moe_reference_fp8(c["x"], c["ids"], c["w"], c["w13"], c["s13"], c["w2"], c["s2"])
        assert float(single.float().norm()) > 0
        for rank in range(DIST_WORLD):
            rows = slice(c["offsets"][rank], c["offsets"][rank + 1])
            got = per_rank[rank][name]
            assert got.dtype == torch.bfloat16 and torch.equal(got, single[rows]), f"{name} rank {rank}"


def test_few_row_fp8_batches_are_held_to_the_row_budget():
    """tolerances.py "Few rows": a batch gets the fp8 batch budget only once one row at the row bound takes at
    most half of it. The Qwen3-30B case seen over budget (16 rows of one expert, kernel_check seed 1795537672)
    passes as a 16-row batch and would fail as a batch of min_rows rows."""
    budget = kernel_budgets("fp8", 768)["ref"]
    assert budget.min_rows == 86
    one_row = [budget.row_rel / n**0.5 for n in (budget.min_rows, budget.min_rows - 1)]
    assert one_row[0] <= budget.rel_fro / 2 < one_row[1]
    err_sq, worst_row = 1.28e-2**2, 2.66e-2
    assert ErrorStats(err_sq=err_sq, ref_sq=1.0, max_row_rel=worst_row, rows=16).within(*budget)
    assert not ErrorStats(err_sq=err_sq, ref_sq=1.0, max_row_rel=worst_row, rows=86).within(*budget)
    over_row = ErrorStats(err_sq=err_sq, ref_sq=1.0, max_row_rel=budget.row_rel * 1.01, rows=16)
    assert not over_row.within(*budget)  # the rows are still bound
    large_i = kernel_budgets("fp8", 7168)["oracle"]
    assert large_i.min_rows == MIN_ROWS_FOR_BATCH_BUDGET  # I = 7168: the bf16 floor
    assert kernel_budgets("bf16", 768)["ref"].min_rows == MIN_ROWS_FOR_BATCH_BUDGET  # bf16 unchanged
