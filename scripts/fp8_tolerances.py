"""Measure the error budgets of the fp8 path (tests/tolerances.py, "fp8") on CPU, no GPU needed.

    python scripts/fp8_tolerances.py --out benchmarks/results/<date>-cpu-fp8-tolerances.json [--quick]

An fp8 kernel can differ from :func:`flashmoe.moe_reference_fp8` only in how it sums (the semantics fix
every rounding point and the quantiser bit for bit). This script computes the layer with the
reference's rounding points but with a kernel's summation instead, and compares it with the
reference and with the fp64 oracle. Two stand-ins for a kernel:

* ``fp32_order``: each 128-K block partial sum accumulated in fp32 by torch's matmul (its own order,
  not exact), the promotion ``acc = fma(sx * sw, P, acc)`` with one rounding, silu in fp32. A kernel
  with fp32-exact tensor-core partials and a different order.
* ``tensor_core_13b``: the block partial sum as Hopper's fp8 WGMMA forms it: four K=32 steps, each
  adding 32 exact products to the accumulator after aligning all 33 terms to the largest one and
  truncating them to 13 bits below its leading bit (the "around 14 bits" accumulation the
  DeepSeek-V3 report, section 3.3.2, measured and DeepGEMM's 128-K promotion exists for; 13 for
  margin), then promoted as above.

Besides the error statistics, each case records how many activation e4m3 roundings (per
(token, slot) pair, step 4 of the semantics) came out differently from the reference's, and the
quantisation error itself: the fp8 oracle against the same layer with unquantised activations on the
same dequantised weights (information, not a budget).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from flashmoe.fp8 import (  # noqa: E402
    GROUP,
    dequantize_per_token_group,
    dequantize_weight_blocks,
    quantize_per_token_group,
)
from flashmoe.placement import ExpertPlacement  # noqa: E402
from flashmoe.reference import _combine_local, _per_expert  # noqa: E402
from flashmoe.reference_fp8 import block_scaled_gemm, moe_oracle_fp64_fp8, moe_reference_fp8  # noqa: E402
from moe_inputs import random_fp8_expert_weights, random_grouped_hidden, random_routing  # noqa: E402
from tolerances import error_stats  # noqa: E402

TC_ACCUMULATOR_BITS = 13  # default of --tc-bits
TC_K_STEP = 32  # K of one fp8 WGMMA instruction


def partial_fp32_order(a_blk: torch.Tensor, w_blk: torch.Tensor) -> torch.Tensor:
    return a_blk.float() @ w_blk.float().t()


def partial_tensor_core(a_blk: torch.Tensor, w_blk: torch.Tensor, bits: int) -> torch.Tensor:
    a, w = a_blk.double(), w_blk.double()
    acc = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float64)
    for k0 in range(0, a.shape[1], TC_K_STEP):
        products = a[:, None, k0 : k0 + TC_K_STEP] * w[None, :, k0 : k0 + TC_K_STEP]  # exact
        terms = torch.cat([acc[..., None], products], dim=-1)
        _, lead_exp = torch.frexp(terms.abs().amax(dim=-1, keepdim=True))  # leading bit 2**(lead_exp - 1)
        unit = torch.ldexp(torch.ones_like(terms[..., :1]), lead_exp - 1 - bits)
        acc = (torch.trunc(terms / unit) * unit).sum(dim=-1)  # exact: few bits per term
    return acc.float()


def kernel_gemm(partial_fn):
    def gemm(q_a, s_a, q_w, s_w):
        w_scale = s_w.repeat_interleave(GROUP, dim=0)
        acc = torch.zeros(q_a.shape[0], q_w.shape[0], dtype=torch.float32)
        for kb in range(q_a.shape[1] // GROUP):
            cols = slice(kb * GROUP, (kb + 1) * GROUP)
            partial = partial_fn(q_a[:, cols].float(), q_w[:, cols].float())
            scale = s_a[:, kb : kb + 1] * w_scale[:, kb]
            acc = (acc.double() + scale.double() * partial.double()).float()  # fused multiply-add
        return acc

    return gemm


def stand_ins(tc_bits: list[int]) -> dict:
    kernels = {"fp32_order": kernel_gemm(partial_fp32_order)}
    for bits in tc_bits:
        kernels[f"tensor_core_{bits}b"] = kernel_gemm(functools.partial(partial_tensor_core, bits=bits))
    return kernels


def layer(x, ids, w, weights, gemm, silu_fp32: bool, record: dict | None = None):
    """The semantics' steps with ``gemm`` for both GEMMs; ``record[e]`` gets expert e's GEMM0 output,
    activation, dequantised activation and its e4m3 values (each expert runs once per layer call)."""
    w13, s13, w2, s2 = weights
    inter = w13.shape[1] // 2

    def expert_outputs(rows_x, local):
        q_x, s_x = quantize_per_token_group(rows_x)

        def expert(e, rows):
            gate_up = gemm(q_x[rows], s_x[rows], w13[e], s13[e])
            gate = gate_up[:, :inter]
            silu = F.silu(gate) if silu_fp32 else F.silu(gate.double()).float()
            act = silu * gate_up[:, inter:]
            q_a, s_a = quantize_per_token_group(act)
            if record is not None:
                record[e] = (gate_up, act, dequantize_per_token_group(q_a, s_a, dtype=torch.float64), q_a)
            return gemm(q_a, s_a, w2[e], s2[e])

        y = torch.empty(rows_x.shape[0], w2.shape[1], dtype=torch.float32)
        return _per_expert(local, y, expert).to(torch.bfloat16)

    placement = ExpertPlacement.contiguous(w13.shape[0], 1)
    return _combine_local(x, ids, w, placement, expert_outputs, torch.float32, torch.bfloat16)


def unquantised_oracle(x, ids, w, weights) -> torch.Tensor:
    """The layer on the same dequantised weights with x and the activation left unquantised, float64."""
    w13, s13, w2, s2 = weights
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(w13.shape[0]):
        gate_up = x.double() @ dequantize_weight_blocks(w13[e], s13[e], dtype=torch.float64).t()
        y = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ dequantize_weight_blocks(
            w2[e], s2[e], dtype=torch.float64
        ).t()
        out += ((ids == e).double() * w.double()).sum(dim=1, keepdim=True) * y
    return out


def recorded_rel_diff(got: dict, ref: dict, i: int) -> float:
    """Relative Frobenius difference of the i-th quantity ``layer`` recorded, over all experts."""
    diff = sum(float((got[e][i].double() - ref[e][i].double()).square().sum()) for e in got)
    return (diff / max(sum(float(ref[e][i].double().square().sum()) for e in got), 1e-300)) ** 0.5


def stats_dict(out, ref) -> dict:
    s = error_stats(out, ref)
    row_ref = ref.double().norm(dim=1)
    nonzero = row_ref > 0
    row_rel = (out.double() - ref.double()).norm(dim=1)[nonzero] / row_ref[nonzero]
    return {
        "rel_fro": s.rel_fro,
        "max_row_rel": s.max_row_rel,
        "p99_row_rel": float(row_rel.quantile(0.99)) if row_rel.numel() else 0.0,
        "rows": s.rows,
    }


CASES = [
    # name, T, E, k, H, I, seeds: DeepSeek-V3 and Qwen3-30B-A3B routed experts with few experts so
    # the weights fit, plus small-I shapes where one activation flip weighs the most.
    ("deepseek_v3", 32, 8, 8, 7168, 2048, 3),
    ("qwen3_30b_a3b", 128, 16, 8, 2048, 768, 4),
    ("h1024_i512_k4", 256, 8, 4, 1024, 512, 4),
    ("h512_i256_k2", 512, 8, 2, 512, 256, 4),
    ("h256_i128_k1", 1024, 8, 1, 256, 128, 4),
    ("h7168_i128_k8", 64, 8, 8, 7168, 128, 3),
]


def run_case(name, T, E, k, H, inter, seed, kernels: dict) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = random_grouped_hidden(T, H, gen)
    ids, w = random_routing(T, E, k, "uniform", gen, drop_prob=0.05)
    weights = random_fp8_expert_weights(E, H, inter, gen)
    t0 = time.perf_counter()
    ref = moe_reference_fp8(x, ids, w, *weights)
    oracle = moe_oracle_fp64_fp8(x, ids, w, *weights)
    result = {
        "case": name,
        "T": T,
        "E": E,
        "k": k,
        "H": H,
        "I": inter,
        "seed": seed,
        "reference_vs_oracle": stats_dict(ref, oracle),
        "quantisation_info": {
            "fp8_oracle_vs_unquantised_activations": stats_dict(
                oracle, unquantised_oracle(x, ids, w, weights)
            ),
        },
    }
    ref_acts: dict = {}
    layer(x, ids, w, weights, block_scaled_gemm, silu_fp32=False, record=ref_acts)
    for stand_in, gemm in kernels.items():
        acts: dict = {}
        out = layer(x, ids, w, weights, gemm, silu_fp32=True, record=acts)
        flips = sum(int((acts[e][3].float() != ref_acts[e][3].float()).sum()) for e in acts)
        result[stand_in] = {
            "vs_reference": stats_dict(out, ref),
            "vs_oracle": stats_dict(out, oracle),
            "gemm0_rel_diff": recorded_rel_diff(acts, ref_acts, 0),  # delta: the summation's error
            "activation_rel_diff": recorded_rel_diff(acts, ref_acts, 1),  # after the SwiGLU
            "quantised_activation_rel_diff": recorded_rel_diff(acts, ref_acts, 2),  # eps_act: after e4m3
            "activation_flip_fraction": flips / max(sum(acts[e][3].numel() for e in acts), 1),
        }
    result["seconds"] = time.perf_counter() - t0
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="one seed, at most 32 tokens, no DeepSeek-V3 case")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--tc-bits", type=int, nargs="+", default=[TC_ACCUMULATOR_BITS], help="tensor-core stand-ins' bits"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = stand_ins(args.tc_bits)
    results = []
    for name, T, E, k, H, inter, seeds in CASES:
        if args.quick and name == "deepseek_v3":
            continue
        for seed in range(1 if args.quick else seeds):
            if args.quick:
                T = min(T, 32)
            r = run_case(name, T, E, k, H, inter, seed, kernels)
            results.append(r)
            print(
                f"{name} seed {seed}: ref-oracle {r['reference_vs_oracle']['rel_fro']:.2e}/"
                f"{r['reference_vs_oracle']['max_row_rel']:.2e}  "
                + "  ".join(
                    f"{s}: ref {r[s]['vs_reference']['rel_fro']:.2e}/{r[s]['vs_reference']['max_row_rel']:.2e} "
                    f"oracle {r[s]['vs_oracle']['rel_fro']:.2e}/{r[s]['vs_oracle']['max_row_rel']:.2e} "
                    f"flips {r[s]['activation_flip_fraction']:.1e} delta {r[s]['gemm0_rel_diff']:.1e}"
                    for s in kernels
                )
                + f"  quant {r['quantisation_info']['fp8_oracle_vs_unquantised_activations']['rel_fro']:.2e}"
                f"  ({r['seconds']:.0f} s)",
                flush=True,
            )
    summary = {"torch": torch.__version__, "tc_accumulator_bits": args.tc_bits, "cases": results}
    args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
