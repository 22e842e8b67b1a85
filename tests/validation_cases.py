"""Issue 19's bad inputs and the routing-id rules, shared by the CPU tests in ``test_validation.py`` and
the rank processes its GPU tests spawn, so both backends are held to one list. Block-fp8 layers (issue 15)
have their own list (``FP8_BAD_CALLS``: the scales and the fp8 half of the contract).

Every bad call is made with ``out=`` filled with NaN: a call that raised must have left it untouched
(nothing computed). The GPU rank functions collect every failing case and raise once at the end, so a
run names all of them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from flashmoe import ExpertPlacement, FlashMoE, MoELayerSpec, moe_reference, moe_reference_fp8
from moe_inputs import (
    random_expert_weights,
    random_fp8_expert_weights,
    random_grouped_hidden,
    random_hidden,
    random_routing,
)
from tolerances import error_stats, kernel_budgets

# Shapes the megakernel accepts (H % 128, I % 64; fp8: both % 128), small enough for CPU.
E, K, H, I, T, MAX_T = 8, 2, 256, 128, 16, 64
ARGS = ("hidden_states", "topk_ids", "topk_weights", "w13", "w2")
SCALES = ("w13_scale_inv", "w2_scale_inv")


def layer_spec(max_tokens: int = MAX_T, dtype: str = "bf16") -> MoELayerSpec:
    """The layer of these cases; ``dtype="fp8"``: block-fp8 experts."""
    return MoELayerSpec(E, K, H, I, max_tokens, weight_dtype=torch.float8_e4m3fn if dtype == "fp8" else None)


def valid_call(device, seed: int, tokens: int = T, dtype: str = "bf16") -> dict:
    """Keyword arguments of one valid single-rank call (all E experts local), with a NaN ``out``.
    ``dtype="fp8"``: block-fp8 weights with their scales and token groups of random magnitude
    (``moe_inputs``' fp8 draws), for :func:`layer_spec` ``(dtype="fp8")``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ids, w = random_routing(tokens, E, K, "uniform", gen, device, drop_prob=0.2)
    if dtype == "fp8":
        w13, w13_scale_inv, w2, w2_scale_inv = random_fp8_expert_weights(E, H, I, gen, device)
        x = random_grouped_hidden(tokens, H, gen, device)
        scales = {"w13_scale_inv": w13_scale_inv, "w2_scale_inv": w2_scale_inv}
    else:
        w13, w2 = random_expert_weights(E, H, I, gen, device)
        x = random_hidden(tokens, H, gen, device)
        scales = {}
    return {
        "hidden_states": x,
        "topk_ids": ids,
        "topk_weights": w,
        "w13": w13,
        "w2": w2,
        **scales,
        "out": torch.full_like(x, float("nan")),
    }


def fp8_reference(a: dict) -> torch.Tensor:
    """The fp8 reference of a :func:`valid_call` ``(dtype="fp8")`` (single rank, all experts local)."""
    return moe_reference_fp8(
        *(a[n] for n in ARGS[:3]), a["w13"], a["w13_scale_inv"], a["w2"], a["w2_scale_inv"]
    )


@dataclass(frozen=True)
class BadCall:
    name: str
    corrupt: Callable[[dict], None]  # edits the call's keyword arguments in place
    error: type[Exception]
    match: str  # regex, searched from the start of the message: the argument's name comes first


def _narrow_hidden(a: dict) -> None:
    a.update(
        hidden_states=a["hidden_states"][:, :128].contiguous(),
        w13=a["w13"][:, :, :128].contiguous(),
        w2=a["w2"][:, :128].contiguous(),
        out=a["out"][:, :128].contiguous(),
    )


def _narrow_inter(a: dict) -> None:
    w13 = a["w13"]
    a.update(w13=torch.cat([w13[:, :64], w13[:, I : I + 64]], dim=1), w2=a["w2"][:, :, :64].contiguous())


def _to_fp32(a: dict) -> None:
    a.update({n: a[n].float() for n in ("hidden_states", "w13", "w2", "out")})


def _too_many_tokens(a: dict) -> None:
    reps = MAX_T // T + 1
    a.update(
        {
            n: a[n].repeat(reps, *[1] * (a[n].dim() - 1))
            for n in ("hidden_states", "topk_ids", "topk_weights", "out")
        }
    )


# What the layer's spec (E=8, k=2, H=256, I=128, bf16, 64 tokens) rules out, on every backend.
BAD_CALLS = [
    BadCall(
        "H_differs_from_spec",
        _narrow_hidden,
        ValueError,
        "hidden_states has H=128, the layer's hidden_size is 256",
    ),
    BadCall(
        "I_differs_from_spec",
        _narrow_inter,
        ValueError,
        "w13/w2 have I=64, the layer's intermediate_size is 128",
    ),
    BadCall(
        "k_differs_from_spec",
        lambda a: a.update(
            topk_ids=a["topk_ids"][:, :1].contiguous(), topk_weights=a["topk_weights"][:, :1].contiguous()
        ),
        ValueError,
        "topk_ids has k=1, the layer's top_k is 2",
    ),
    BadCall(
        "fp32_under_bf16_spec",
        _to_fp32,
        ValueError,
        r"hidden_states dtype torch.float32 differs from the layer's dtype torch.bfloat16",
    ),
    BadCall("tokens_over_max", _too_many_tokens, ValueError, "80 tokens exceed max_tokens_per_rank=64"),
    BadCall(
        "out_wrong_dtype", lambda a: a.update(out=a["out"].float()), ValueError, r"out must be \(16, 256\)"
    ),
    BadCall(
        "out_is_list",
        lambda a: a.update(out=a["out"].tolist()),
        TypeError,
        "out must be a torch.Tensor or None",
    ),
] + [
    BadCall(
        f"{name}_is_{kind}",
        lambda a, n=name, f=make: a.update({n: f(a[n])}),
        TypeError,
        f"{name} must be a torch.Tensor, got {kind}",
    )
    for name in ARGS
    for kind, make in (("list", lambda t: t.tolist()), ("NoneType", lambda t: None))
]

# What only the megakernel needs (the reference takes any device and strides).
GPU_ONLY_BAD_CALLS = [
    BadCall(
        "tensors_on_cpu",
        lambda a: a.update({n: t.cpu() for n, t in a.items()}),
        ValueError,
        "hidden_states is on cpu, the layer on cuda:0",
    ),
    BadCall(
        "w13_not_contiguous",
        lambda a: a.update(w13=a["w13"].transpose(1, 2).contiguous().transpose(1, 2)),
        ValueError,
        "w13 must be contiguous",
    ),
]


def _set(name: str, make) -> Callable[[dict], None]:
    return lambda a: a.update({name: make(a[name])})


# What the fp8 layer's contract (flashmoe.validation: scales [E, 2I/128, H/128] and [E, H/128, I/128] fp32,
# e4m3 weights, bf16 tokens) rules out, on every backend. E=8, H=256, I=128: w13_scale_inv [8, 2, 2],
# w2_scale_inv [8, 2, 1].
FP8_BAD_CALLS = [
    BadCall(
        "scales_missing",
        lambda a: a.update(w13_scale_inv=None, w2_scale_inv=None),
        ValueError,
        "w13_scale_inv and w2_scale_inv required: this layer's weights are block-fp8",
    ),
    BadCall(
        "w2_scale_inv_missing", _set("w2_scale_inv", lambda t: None), ValueError, "w2_scale_inv required"
    ),
    BadCall(
        "w2_scale_inv_transposed",
        _set("w2_scale_inv", lambda t: t.transpose(1, 2)),
        ValueError,
        r"w2_scale_inv shape \(8, 1, 2\) != \(8, 2, 1\) \(one scale per 128 x 128 block\)",
    ),
    BadCall(
        "w13_scale_inv_missing_expert",
        _set("w13_scale_inv", lambda t: t[:-1]),
        ValueError,
        r"w13_scale_inv shape \(7, 2, 2\) != \(8, 2, 2\)",
    ),
    BadCall(
        "w2_scale_inv_per_expert",
        _set("w2_scale_inv", lambda t: t.amax(dim=(1, 2))),
        ValueError,
        r"w2_scale_inv shape \(8,\) != \(8, 2, 1\)",
    ),
    BadCall(
        "w13_scale_inv_bf16",
        _set("w13_scale_inv", lambda t: t.bfloat16()),
        ValueError,
        "w13_scale_inv must be float32, got torch.bfloat16",
    ),
    BadCall(
        "w13_scale_inv_is_list",
        _set("w13_scale_inv", lambda t: t.tolist()),
        TypeError,
        "w13_scale_inv must be a torch.Tensor, got list",
    ),
    BadCall(
        "weights_bf16",
        lambda a: a.update(w13=a["w13"].bfloat16(), w2=a["w2"].bfloat16()),
        ValueError,
        r"w13/w2 dtype \(torch.bfloat16, torch.bfloat16\) must be torch.float8_e4m3fn when scales are given",
    ),
    BadCall(
        "hidden_states_fp32",
        lambda a: a.update(hidden_states=a["hidden_states"].float(), out=a["out"].float()),
        ValueError,
        "hidden_states dtype torch.float32: the fp8 path takes bf16 hidden states",
    ),
]

# What only the megakernel needs of the scales (it reads them in place).
FP8_GPU_ONLY_BAD_CALLS = [
    BadCall(
        "w2_scale_inv_on_cpu",
        _set("w2_scale_inv", lambda t: t.cpu()),
        ValueError,
        "w2_scale_inv is on cpu, hidden_states on cuda:0",
    ),
    BadCall(
        "w13_scale_inv_not_contiguous",
        _set("w13_scale_inv", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
        ValueError,
        "w13_scale_inv must be contiguous",
    ),
]


def bad_call_failures(
    layer: FlashMoE, cases: list[BadCall], device, seed: int, dtype: str = "bf16"
) -> list[str]:
    """Run every case on ``layer``, each on a fresh :func:`valid_call` of ``dtype``; return one line per case
    that did not raise as expected or wrote ``out``."""
    failures = []
    for case in cases:
        a = valid_call(device, seed, dtype=dtype)
        case.corrupt(a)
        out = a["out"]
        try:
            layer(**a)
        except case.error as e:
            if re.match(case.match, str(e)) is None:
                failures.append(f"{case.name}: message {str(e)!r} does not start with {case.match!r}")
        except Exception as e:  # noqa: BLE001 - any other exception is a failure of this case
            failures.append(f"{case.name}: {type(e).__name__}: {e} (expected {case.error.__name__})")
        else:
            failures.append(f"{case.name}: no exception (expected {case.error.__name__})")
        if isinstance(out, torch.Tensor) and not bool(torch.isnan(out).all()):
            failures.append(f"{case.name}: out was written although the call raised")
    return failures


def duplicate_routing(tokens: int, num_experts: int, k: int, world: int, seed: int, device) -> tuple:
    """Every row names one expert twice (slots shuffled). Which expert is chosen to fill the kernel's
    per-expert and per-row capacity when tokens == max_tokens (its workspace assumes distinct ids):
    one world, E=8, k=4: the last expert twice per row (2*T list entries for a list of T); two worlds,
    E=4 (2 per rank), k=4: experts 0 and 1 twice each (rank 0 receives 4 entries per row, sized for 2)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if world == 1:
        others = torch.stack([torch.randperm(num_experts - 1, generator=gen)[: k - 2] for _ in range(tokens)])
        ids = torch.cat([torch.full((tokens, 2), num_experts - 1), others], dim=1)
    else:
        ids = torch.tensor([0, 0, 1, 1]).repeat(tokens, 1)
    ids = ids.gather(1, torch.rand(tokens, k, generator=gen).argsort(dim=1)).to(torch.int32)
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), dim=1)
    return ids.to(device).contiguous(), weights.to(device).contiguous()


# ---------------------------------------------------------------------------------------------
# GPU rank processes (spawned by test_validation.py through multiproc.run_ranks)
# ---------------------------------------------------------------------------------------------


def _close(got: torch.Tensor, expected: torch.Tensor, what: str, dtype: str = "bf16") -> list[str]:
    """``got`` against the same-rounding reference ``expected`` of ``dtype`` weights, within its budget."""
    budget = kernel_budgets(dtype, I)["ref"]
    s = error_stats(got, expected)
    if s.within(*budget):
        return []
    return [
        f"{what}: rel Frobenius {s.rel_fro:.3e}, worst row {s.max_row_rel:.3e}, non-finite {s.nonfinite} "
        f"(budgets {budget[0]:.3e}, {budget[1]:.3e})"
    ]


def _megakernel_layer(spec: MoELayerSpec, world: int, name: str) -> FlashMoE:
    layer = FlashMoE(spec, ExpertPlacement.contiguous(spec.num_experts, world), layer_name=name)
    if layer.backend != "megakernel":
        raise AssertionError(f"backend is {layer.backend} ({layer.reason}); this test is for the megakernel")
    return layer


def gpu_bad_inputs_worker(rank: int, world: int, port: int, out_dir: str, seed: int) -> None:
    from megakernel_cases import init_rank

    ctx = init_rank(rank, world, port, "cuda", out_dir)
    failures = []
    try:
        FlashMoE(layer_spec(), ExpertPlacement.contiguous(2 * E, world))
        failures.append("placement of 16 experts under a spec of 8 was accepted")
    except ValueError as e:
        if "placement has 16 experts but the spec's num_experts is 8" not in str(e):
            failures.append(f"placement of 16 experts: unexpected message {e}")
    layer = _megakernel_layer(layer_spec(), world, "validation")
    failures += bad_call_failures(layer, BAD_CALLS + GPU_ONLY_BAD_CALLS, ctx.device, seed)
    # The layer still computes correctly after all those refusals.
    a = valid_call(ctx.device, seed)
    got = layer(**a)
    ctx.sync()
    failures += _close(got, moe_reference(*(a[n] for n in ARGS)), "valid call after the bad ones")
    if failures:
        raise AssertionError("GPU path:\n" + "\n".join(failures))
    dist.destroy_process_group()


def gpu_fp8_bad_inputs_worker(rank: int, world: int, port: int, out_dir: str, seed: int) -> None:
    """The fp8 layer on the megakernel: every case of FP8_BAD_CALLS and FP8_GPU_ONLY_BAD_CALLS refused before
    launch with ``out`` untouched, then a valid call on fresh random inputs within the fp8 budget of
    :func:`flashmoe.moe_reference_fp8`."""
    from megakernel_cases import init_rank

    ctx = init_rank(rank, world, port, "cuda", out_dir)
    layer = _megakernel_layer(layer_spec(dtype="fp8"), world, "validation_fp8")
    failures = bad_call_failures(layer, FP8_BAD_CALLS + FP8_GPU_ONLY_BAD_CALLS, ctx.device, seed, "fp8")
    a = valid_call(ctx.device, seed, dtype="fp8")
    got = layer(**a)
    ctx.sync()
    failures += _close(got, fp8_reference(a), "valid fp8 call after the bad ones", "fp8")
    if failures:
        raise AssertionError("GPU path, fp8 layer:\n" + "\n".join(failures))
    dist.destroy_process_group()


def gpu_routing_ids_worker(rank: int, world: int, port: int, out_dir: str, seed: int) -> None:
    """-1, other negative and out-of-range ids are skipped; duplicates are summed (small batch and one
    that fills the buffers), all against the reference."""
    from megakernel_cases import init_rank

    ctx = init_rank(rank, world, port, "cuda", out_dir)
    failures = []
    if world == 1:
        layer = _megakernel_layer(layer_spec(), world, "ids")
        a = valid_call(ctx.device, seed, tokens=32)
        ids = a["topk_ids"]
        ids[0, 0], ids[1, 1], ids[2, 0], ids[3, 1], ids[4, :] = -7, E, E + 100, 2**31 - 1, -1
        got = layer(**a)
        ctx.sync()
        masked = torch.where((ids >= 0) & (ids < E), ids, torch.full_like(ids, -1))
        expected = moe_reference(a["hidden_states"], masked, a["topk_weights"], a["w13"], a["w2"])
        failures += _close(got, expected, "ids outside [0, E) skipped like -1")
        if not bool((got[4] == 0).all()):
            failures.append("a row with only -1 ids is not zero")

    # Duplicates: world 1: E=8, k=4; world 2: E=4, k=4 (2 experts per rank, fewer than k).
    num_experts, k, tokens_max = (8, 4, 256) if world == 1 else (4, 4, 256)
    spec = MoELayerSpec(num_experts, k, H, I, tokens_max)
    layer = _megakernel_layer(spec, world, "duplicates")
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    w13_all, w2_all = random_expert_weights(num_experts, H, I, gen, ctx.device)
    per_rank = num_experts // world
    w13 = w13_all[rank * per_rank : (rank + 1) * per_rank].contiguous()
    w2 = w2_all[rank * per_rank : (rank + 1) * per_rank].contiguous()
    for tokens in (7, tokens_max):  # a few rows, then every row the buffers were sized for
        x = random_hidden(tokens, H, gen, ctx.device)
        ids, w = duplicate_routing(tokens, num_experts, k, world, seed + rank + tokens, ctx.device)
        got = layer(x, ids, w, w13, w2)
        ctx.sync()
        expected = moe_reference(x, ids, w, w13_all, w2_all)
        failures += _close(got, expected, f"rank {rank}: duplicate ids, {tokens} tokens of {tokens_max}")
    if failures:
        raise AssertionError(f"GPU path, world {world}:\n" + "\n".join(failures))
    dist.barrier()
    dist.destroy_process_group()


def cpu_duplicates_worker(rank: int, world: int, port: int, out_dir: str, seed: int) -> None:
    """FlashMoE's distributed CPU backend (gloo) sums duplicate ids as the single-rank reference does."""
    from megakernel_cases import init_rank

    init_rank(rank, world, port, "cpu", out_dir)
    num_experts, k = 4, 4
    layer = FlashMoE(
        MoELayerSpec(num_experts, k, H, I, MAX_T),
        ExpertPlacement.contiguous(num_experts, world),
        device=torch.device("cpu"),
    )
    gen = torch.Generator().manual_seed(seed)
    w13_all, w2_all = random_expert_weights(num_experts, H, I, gen)
    per_rank = num_experts // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    x = random_hidden(T, H, gen)
    ids, w = duplicate_routing(T, num_experts, k, world, seed + rank, "cpu")
    failures = _close(
        layer(x, ids, w, w13_all[mine], w2_all[mine]),
        moe_reference(x, ids, w, w13_all, w2_all),
        f"rank {rank}: distributed CPU backend, duplicate ids",
    )
    if failures:
        raise AssertionError("\n".join(failures))
    dist.barrier()
    dist.destroy_process_group()
