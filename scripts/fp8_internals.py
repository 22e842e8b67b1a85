"""One GPU, world 1: compare the fp8 megakernel's intermediate values with flashmoe.reference_fp8's, element by
element. Where kernel_check.py says *how far* the fp8 output is from the reference, this says *where* it parts:

* dispatch: the e4m3 rows and scales the kernel received (symmetric heap) vs quantize_per_token_group of the
  same bf16 tokens -- the rule is bit-exact, so any difference is a bug;
* GEMM0 + SwiGLU + re-quantisation: each (expert, row) activation the kernel stored (workspace, e4m3 + scale
  per 128-group) vs the reference's, computed from the same quantised token: scale ratios, and e4m3 codes that
  differ by one step (an accumulation-order flip at a rounding boundary) or more: near zero (a move below
  NEAR_ZERO_OF_AMAX of the group's amax, where e4m3's steps are finer than the sums' own perturbation) or not
  (a defect: the exit status is 1 for those and for any dispatch difference);
* the output, as kernel_check.py measures it.

    python scripts/fp8_internals.py --shape 32,8,2048,768 --tokens 128 [--cpu-reference] [--out X.json]

Mirrors csrc/flashmoe/layout.cuh to find the buffers (a layout change must be made here too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))
os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(8 << 30))

# The tensor core's block partial sums keep ~13 bits (tests/tolerances.py), so an activation may move by ~2^-13 of
# its GEMM0 terms, ~2^-12 of its group's amax through the SwiGLU's product; near zero that spans several e4m3 codes
# (the smallest step is amax / (448 * 512)). A move of more than two codes but at most this much is not a defect.
NEAR_ZERO_OF_AMAX = 2.0**-10

from flashmoe import buffers  # noqa: E402
from flashmoe.fp8 import GROUP, dequantize_per_token_group, quantize_per_token_group  # noqa: E402
from flashmoe.reference_fp8 import block_scaled_gemm, moe_oracle_fp64_fp8, moe_reference_fp8  # noqa: E402
from kernel_check import flashmoe_layer, fp8_weights, routing  # noqa: E402
from moe_inputs import random_grouped_hidden  # noqa: E402
from tolerances import error_stats  # noqa: E402

ALIGN = 256


def _take(offsets: list[int], nbytes: int) -> int:
    off = offsets[0]
    offsets[0] += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return off


def layouts(cap) -> tuple[dict, dict]:
    """csrc/flashmoe/layout.cuh's sym_layout and workspace_layout (the regions this script reads)."""
    W, T, H, I, k, El = (
        cap.world_size,
        cap.max_tokens_per_rank,
        cap.hidden_size,
        cap.intermediate_size,
        cap.top_k,
        cap.max_local,
    )
    o = [0]
    sym = {"recv_tokens": _take(o, W * T * H * 2), "recv_scales": _take(o, W * T * (H // 128) * 4)}
    sym["recv_meta"] = _take(o, W * T * (1 + k) * 4)
    o = [0]
    entries = W * T * min(k, El)
    ws = {"expert_rows": _take(o, El * W * T * 4), "act": _take(o, entries * I * 2)}
    ws["act_scales"] = _take(o, entries * (I // 128) * 4)
    return sym, ws


class _DeviceBytes:
    """A raw device allocation as a torch uint8 tensor (through __cuda_array_interface__)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="32,8,2048,768", help="E,k,H,I")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cpu-reference", action="store_true", help="run the references on the CPU (slow)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    E, k, H, I = (int(v) for v in args.shape.split(","))
    T = args.tokens
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    gen = torch.Generator().manual_seed(args.seed)
    moe = flashmoe_layer(E, k, H, I, fp8=True)
    w13, w2, s13, s2 = fp8_weights(E, H, I, args.seed, device)
    x = random_grouped_hidden(T, H, gen).to(device)
    ids, w = routing(E, k, T, args.routing, gen, device)
    out = torch.full_like(x, float("nan"))
    moe(x, ids, w, w13, w2, out=out, w13_scale_inv=s13, w2_scale_inv=s2)
    torch.cuda.synchronize()
    buf = buffers.current()
    sym_off, ws_off = layouts(buf.capacity)
    cap = buf.capacity
    sym = torch.as_tensor(_DeviceBytes(buf.sym_ptr, buf.sym_bytes), device=device)
    ws = buf.workspace
    report: dict = {"shape": [E, k, H, I], "tokens": T, "routing": args.routing, "seed": args.seed}

    # Dispatch: every received row against the rule applied to its token.
    rows = int((ids >= 0).any(dim=1).sum())  # world 1: one row per routed token
    meta = (
        sym[sym_off["recv_meta"] : sym_off["recv_meta"] + rows * (1 + k) * 4]
        .view(torch.int32)
        .view(rows, 1 + k)
    )
    tokens = meta[:, 0].long()
    recv_q = sym[sym_off["recv_tokens"] : sym_off["recv_tokens"] + rows * H].view(rows, H)
    recv_s = (
        sym[sym_off["recv_scales"] : sym_off["recv_scales"] + rows * (H // GROUP) * 4]
        .view(torch.float32)
        .view(rows, -1)
    )
    qx, sx = quantize_per_token_group(x.cpu())
    qx, sx = qx.to(device)[tokens], sx.to(device)[tokens]
    report["dispatch"] = {
        "rows": rows,
        "codes_differing": int((recv_q != qx.view(torch.uint8)).sum()),
        "scales_differing": int((recv_s != sx).sum()),
    }

    # Activations: each expert's entries in list order (row_offset = prefix of counts).
    lists = (
        ws[ws_off["expert_rows"] :]
        .view(torch.int32)[: E * cap.world_size * cap.max_tokens_per_rank]
        .view(E, -1)
    )
    counts = [int((meta[:, 1:] == e).sum()) for e in range(E)]
    act_q = ws[ws_off["act"] :][: sum(counts) * I].view(-1, I)
    act_s = (
        ws[ws_off["act_scales"] :][: sum(counts) * (I // GROUP) * 4].view(torch.float32).view(-1, I // GROUP)
    )
    step_hist = torch.zeros(
        4, dtype=torch.int64
    )  # |code difference| 0, 1, 2, >2 (same sign, e4m3 code order)
    scale_ratio_max, scales_differing, elements, near_zero = 0.0, 0, 0, 0
    rel_to_amax: list[torch.Tensor] = []
    offset = 0
    for e in range(E):
        n = counts[e]
        if n == 0:
            continue
        entries = lists[e, :n].long()
        r = entries >> 4
        gate_up = block_scaled_gemm(qx[r], sx[r], w13[e], s13[e])
        act = F.silu(gate_up[:, :I].double()).float() * gate_up[:, I:]
        ref_q, ref_s = quantize_per_token_group(act.cpu())
        ref_q, ref_s = ref_q.to(device), ref_s.to(device)
        got_q, got_s = act_q[offset : offset + n], act_s[offset : offset + n]
        # e4m3 codes: sign bit 7, magnitude order = code order within a sign.
        a, b = got_q.to(torch.int32), ref_q.view(torch.uint8).to(torch.int32)
        same_sign = (a ^ b) & 0x80 == 0
        code_steps = torch.where(same_sign, (a & 0x7F) - (b & 0x7F), (a & 0x7F) + (b & 0x7F)).abs()
        step_hist += torch.stack(
            [
                (code_steps == 0).sum(),
                (code_steps == 1).sum(),
                (code_steps == 2).sum(),
                (code_steps > 2).sum(),
            ]
        ).cpu()
        # Dequantised difference relative to its group's amax (448 * scale): the GEMM0 error, seen through the grid.
        diff = dequantize_per_token_group(
            got_q.view(torch.float8_e4m3fn), got_s
        ) - dequantize_per_token_group(ref_q, ref_s)
        rel = diff.abs().view(n, -1, GROUP) / (448 * ref_s[..., None])
        rel_to_amax.append(rel.flatten())
        near_zero += int(((code_steps > 2) & (rel.view(n, I) <= NEAR_ZERO_OF_AMAX)).sum())
        ratio = (got_s / ref_s - 1).abs().max().item()
        scale_ratio_max = max(scale_ratio_max, ratio)
        scales_differing += int((got_s != ref_s).sum())
        elements += n * I
        offset += n
    report["activations"] = {
        "entries": offset,
        "elements": elements,
        "code_steps_0_1_2_more": step_hist.tolist(),
        "more_than_two_near_zero": near_zero,  # of the last count: moves below NEAR_ZERO_OF_AMAX of the amax
        "scales_differing": scales_differing,
        "scale_rel_diff_max": scale_ratio_max,
        "diff_over_group_amax_max_p999_p99": [
            float(v)
            for v in (lambda r: (r.max(), r.quantile(0.999), r.quantile(0.99)))(
                torch.cat(rel_to_amax).float()[: 1 << 24]
            )
        ],
    }

    # Output.
    ref_dev = "cpu" if args.cpu_reference else device
    inputs = [t.to(ref_dev) for t in (x, ids, w, w13, s13, w2, s2)]
    ref = moe_reference_fp8(*inputs).to(device)
    oracle = moe_oracle_fp64_fp8(*inputs).to(device)
    s_ref, s_orc = error_stats(out, ref), error_stats(out, oracle)
    s_ro = error_stats(ref, oracle)
    report["output"] = {
        "kernel_vs_reference": [s_ref.rel_fro, s_ref.max_row_rel],
        "kernel_vs_oracle": [s_orc.rel_fro, s_orc.max_row_rel],
        "reference_vs_oracle": [s_ro.rel_fro, s_ro.max_row_rel],
        "reference_device": str(ref_dev),
    }
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    defects = int(step_hist[3]) - near_zero
    bad = report["dispatch"]["codes_differing"] or report["dispatch"]["scales_differing"] or defects > 0
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
