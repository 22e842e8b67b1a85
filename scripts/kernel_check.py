"""One GPU, world 1: check the megakernel against the references, then time it against torch._grouped_mm on
the same rows. The first look after a kernel change (the multi-GPU suites are gpu_smoke.py and the matrix).

    python scripts/kernel_check.py --out /tmp/kernel_check.json            # check + time
    python scripts/kernel_check.py --check-only
    python scripts/kernel_check.py --dtype fp8 --out /tmp/kernel_check_fp8.json   # block-fp8 weights

Correctness: fresh random inputs per case, output poisoned with NaN, compared with the fp64 oracle and the
same-rounding fp32 reference under tests/tolerances.py's budgets. Timing is serving-like: a CUDA graph of L
calls with distinct weights (L x weights > 4 x L2) and distinct routing, no L2 flush; per-layer time =
replay / L, p10/p50/p90 over replays. The grouped_mm column runs GEMM0 -> SwiGLU -> GEMM1 on rows already
grouped by expert (no gather, no combine) in the same kind of graph; TFLOP/s count 6 * rows * H * I.

``--dtype fp8``: block-fp8 weights (e4m3, 128x128 block scales, tests/moe_inputs.random_fp8_expert_weights)
and token groups of random magnitude (random_grouped_hidden), checked against flashmoe.reference_fp8's
reference and fp64 oracle under the fp8 budgets; timings put the bf16 layer of the same shape and routing
beside the fp8 one, and the floor counts one byte per weight (+ scales).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(
    0, str(REPO / "benchmarks")
)  # moe_bench: the layer benchmark's serving-mode and timing pieces
os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(8 << 30))
for k, v in {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}.items():
    os.environ.setdefault(k, v)

from flashmoe import ExpertPlacement, FlashMoE, MoELayerSpec  # noqa: E402
from flashmoe.reference import moe_oracle_fp64, moe_reference  # noqa: E402
from flashmoe.reference_fp8 import moe_oracle_fp64_fp8, moe_reference_fp8  # noqa: E402
from moe_bench.results import git_commit  # noqa: E402
from moe_bench.serving import capture, l2_bytes, layers_for  # noqa: E402
from moe_bench.timing import CallTimes  # noqa: E402
from moe_inputs import random_fp8_expert_weights, random_grouped_hidden  # noqa: E402
from tolerances import error_stats, repeat_difference, within_kernel_budgets  # noqa: E402

MAX_TOKENS = 8192
# (name, E, k, H, I): per-rank expert counts of EP4 for the three model shapes, and odd shapes.
SHAPES = {
    "qwen3-30b/ep4": (32, 8, 2048, 768),
    "qwen3-235b/ep4": (32, 8, 4096, 1536),
    "dsv3/ep4": (64, 8, 7168, 2048),
    "small": (8, 2, 1024, 256),
    "odd": (16, 4, 1152, 320),
    # fp8: 9 and 11 K steps (an fp8 decode stage carries two: odd counts end on a zero step)
    "odd-k": (16, 4, 1152, 1408),
    # bf16 prefill: wide GEMM1 tiles (H a multiple of 256) over 7 K steps, narrow GEMM0 ones (I = 448 is not a
    # multiple of 128); odd-k is the other way round (scheduler.cuh wide_gemm)
    "wide-h": (16, 4, 1024, 448),
}
CHECKS = [  # shape, tokens, routing
    ("small", 7, "uniform"),
    ("small", 0, "uniform"),
    ("odd", 300, "one_expert"),
    ("odd", 77, "zipf"),
    ("odd", 2, "uniform"),  # decode tiles, an odd K-step count (bf16: 5 GEMM1 steps; fp8 skips the shape)
    ("odd-k", 2, "uniform"),  # decode tiles, fp8 GEMM0 of 9 K steps and GEMM1 of 11: both end on a zero step
    ("qwen3-30b/ep4", 1, "uniform"),  # 96 GEMM0 tiles for 132 blocks: not split (one wave, scheduler.cuh)
    ("qwen3-30b/ep4", 40, "one_expert"),  # 12 tiles of 64 tokens: 4 splits, ping-pong
    ("qwen3-30b/ep4", 100, "one_expert"),  # 12 tiles of 128 tokens: 4 splits, both consumers
    ("qwen3-30b/ep4", 8, "uniform"),
    ("qwen3-30b/ep4", 20, "one_expert"),  # 12 tiles of 32 tokens: 4 splits of the narrowest tile
    ("qwen3-30b/ep4", 16, "one_expert"),  # 16 rows: 16-token decode tiles (the call's widest fits), split
    ("qwen3-30b/ep4", 64, "uniform"),  # 512 received entries: the per-block lists' second round
    ("qwen3-30b/ep4", 96, "zipf"),  # 768 entries: both rounds full, the most the per-block lists take
    ("qwen3-30b/ep4", 128, "zipf"),
    ("qwen3-30b/ep4", 1000, "uniform"),
    ("qwen3-235b/ep4", 64, "uniform"),
    ("dsv3/ep4", 33, "uniform"),
    # bf16 wide calls (an expert of > 64 rows, more 64-feature GEMM0 tiles than blocks): experts of every size, a
    # few rows ones included, on wide tiles; GEMM0 only; GEMM1 only
    ("qwen3-235b/ep4", 1024, "zipf"),
    ("odd-k", 1024, "uniform"),
    ("wide-h", 1024, "zipf"),
    ("small", 64, "duplicates"),
    ("odd", MAX_TOKENS, "duplicates"),  # repeated ids at full capacity: each (row, expert) computed once
]
TIMINGS = (
    [("qwen3-30b/ep4", t) for t in (1, 8, 32, 128, 512, 2048, 4096)]
    + [("qwen3-235b/ep4", t) for t in (8, 128, 4096)]
    + [("dsv3/ep4", t) for t in (8, 128, 1024)]
)


def routing(E, k, T, kind, gen, device):
    if kind == "one_expert":
        ids = torch.full((T, k), -1, dtype=torch.int32)
        ids[:, 0] = 3
    elif kind == "duplicates":  # every row names expert E-1 twice, the rest drawn with replacement
        ids = torch.randint(0, E, (T, k), generator=gen, dtype=torch.int32)
        ids[:, :2] = E - 1
    else:
        p = (
            1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
            if kind == "zipf"
            else torch.ones(E, dtype=torch.float64)
        )
        ids = torch.multinomial(p.expand(max(T, 1), E), k, replacement=False, generator=gen)[:T].to(
            torch.int32
        )
        if T:
            ids[torch.rand(T, k, generator=gen) < 0.05] = -1
    w = torch.rand(T, k, generator=gen)
    return ids.to(device), w.to(device)


def weights(E, H, I, gen, device):
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=gen) / I**0.5).to(torch.bfloat16)
    return w13.to(device), w2.to(device)


def fp8_weights(E, H, I, seed, device):
    """(w13, w2, w13_scale_inv, w2_scale_inv), drawn on the GPU (a CPU draw of DeepSeek-V3's 2.8G weights is slow)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w13, s13, w2, s2 = random_fp8_expert_weights(E, H, I, gen, device)
    return w13, w2, s13, s2


def draw_layer(E, H, I, T, gen, device, fp8):
    """(x, w13, w2, scales): tokens and weights of one layer; scales = the fp8 weights' keyword arguments."""
    if not fp8:
        w13, w2 = weights(E, H, I, gen, device)
        return torch.randn(T, H, generator=gen).to(torch.bfloat16).to(device), w13, w2, {}
    w13, w2, s13, s2 = fp8_weights(E, H, I, int(torch.randint(1 << 30, (1,), generator=gen)), device)
    x = random_grouped_hidden(T, H, gen).to(device)
    return x, w13, w2, dict(w13_scale_inv=s13, w2_scale_inv=s2)


def flashmoe_layer(E, k, H, I, fp8=False) -> FlashMoE:
    """One rank's layer (world 1); fp8: block-fp8 weights, whose scales each call passes as keywords."""
    spec = MoELayerSpec(E, k, H, I, MAX_TOKENS, weight_dtype=torch.float8_e4m3fn if fp8 else None)
    return FlashMoE(spec, ExpertPlacement.contiguous(E, 1), None)


def layer(shape, fp8=False) -> FlashMoE:
    return flashmoe_layer(*SHAPES[shape], fp8=fp8)


def wait_or_report(moe, seconds: float = float(os.environ.get("KERNEL_CHECK_HANG_S", "30"))) -> None:
    """Wait for the device without blocking, so a kernel that never ends is reported with its status record."""
    from flashmoe import buffers

    done = torch.cuda.Event()
    done.record()
    start = time.time()
    while not done.query():
        if time.time() - start > seconds:
            status = buffers.current().status.tolist()
            print(f"HANG: kernel still running after {seconds} s; status record {status}", flush=True)
            os._exit(3)
        time.sleep(0.01)


def check(gen, device, only: int | None = None, fp8: bool = False) -> list[dict]:
    rows = []
    for i, (shape, T, kind) in enumerate(CHECKS):
        if only is not None and i != only:
            continue
        E, k, H, I = SHAPES[shape]
        if fp8 and (H % 128 or I % 128):
            continue  # block-fp8 needs both multiples of the block
        moe = layer(shape, fp8)
        ids, w = routing(E, k, T, kind, gen, device)
        x, w13, w2, scales = draw_layer(E, H, I, T, gen, device, fp8)
        out = torch.full_like(x, float("nan"))
        moe(x, ids, w, w13, w2, out=out, **scales)
        wait_or_report(moe)
        if fp8:
            s13, s2 = scales["w13_scale_inv"], scales["w2_scale_inv"]
            ref = moe_reference_fp8(x, ids, w, w13, s13, w2, s2)
            oracle = moe_oracle_fp64_fp8(x, ids, w, w13, s13, w2, s2)
        else:
            ref = moe_reference(x, ids, w, w13, w2)
            oracle = moe_oracle_fp64(x, ids, w, w13, w2)
        s_ref, s_orc = error_stats(out, ref), error_stats(out, oracle)
        ok = within_kernel_budgets({"ref": s_ref, "oracle": s_orc}, "fp8" if fp8 else "bf16", I)
        # Determinism: the same inputs again give the same bits.
        again = torch.full_like(x, float("nan"))
        moe(x, ids, w, w13, w2, out=again, **scales)
        torch.cuda.synchronize()
        bitwise = bool(torch.equal(out.view(torch.int16), again.view(torch.int16)))
        rows.append(
            dict(
                shape=shape,
                dtype="fp8" if fp8 else "bf16",
                tokens=T,
                routing=kind,
                ok=ok and bitwise,
                bitwise=bitwise,
                oracle_rel=s_orc.rel_fro,
                oracle_row=s_orc.max_row_rel,
                same_rounding_rel=s_ref.rel_fro,
                same_rounding_row=s_ref.max_row_rel,
                nonfinite=s_ref.nonfinite,
            )
        )
        if not bitwise:
            rows[-1]["repeat"] = repeat_difference(out, again, ref, ids)
            print(f"  not repeated: {rows[-1]['repeat']}", flush=True)
        print(
            f"check {'fp8 ' if fp8 else ''}{shape:15s} T={T:5d} {kind:10s} oracle {s_orc.rel_fro:.2e} row {s_orc.max_row_rel:.2e} "
            f"same-rounding {s_ref.rel_fro:.2e} row {s_ref.max_row_rel:.2e} bitwise={bitwise} "
            f"{'ok' if rows[-1]['ok'] else 'FAIL'}",
            flush=True,
        )
    return rows


def graph_times(fn, device, replays: int) -> CallTimes:
    """fn() captured once as a CUDA graph (moe_bench.serving.capture: warm-up outside the capture); the time of
    each replay from events."""
    (replay,), _ = capture([fn], device)
    for _ in range(3):
        replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return CallTimes(times)


def phase_breakdown(layer_id: int) -> dict[str, float]:
    """Median time (us) of each phase over this layer's complete records in the metrics ring (phase ends are
    the last block's; 'combine' runs to the kernel's end)."""
    from flashmoe import contract as c
    from flashmoe import megakernel

    ring = megakernel.device_metrics()[0].cpu()
    mine = ring[
        (ring[:, c.RING_LAYER_ID] == layer_id)
        & (ring[:, c.RING_SEQ] > 0)
        & (ring[:, c.RING_BLOCKS_DONE] == ring[:, c.RING_NUM_BLOCKS])
    ]
    marks = [
        c.RING_START_NS,
        c.RING_DISPATCH_END_NS,
        c.RING_RECEIVE_END_NS,
        c.RING_GEMM0_END_NS,
        c.RING_GEMM1_END_NS,
        c.RING_END_NS,
    ]
    names = ["dispatch", "receive", "gemm0", "gemm1", "combine"]
    if mine.shape[0] == 0:
        return {}
    return {
        n: float((mine[:, b] - mine[:, a]).double().median()) / 1e3
        for n, a, b in zip(names, marks[:-1], marks[1:], strict=True)
    }


def build_info() -> str:
    from flashmoe import build

    return build.load().build_info()


def unsplit_layer(shape, fp8=False) -> FlashMoE:
    """The same layer with GEMM0 tiles never split over K (FLASHMOE_GEMM0_SPLITS=1, read at construction)."""
    old = os.environ.get("FLASHMOE_GEMM0_SPLITS")
    os.environ["FLASHMOE_GEMM0_SPLITS"] = "1"
    try:
        return layer(shape, fp8)
    finally:
        if old is None:
            del os.environ["FLASHMOE_GEMM0_SPLITS"]
        else:
            os.environ["FLASHMOE_GEMM0_SPLITS"] = old


def time_case(shape, T, gen, device, l2, replays, fp8=False, unsplit=False) -> dict:
    E, k, H, I = SHAPES[shape]
    bytes_per_weight = 1 + 4 / 128**2 if fp8 else 2
    weight_bytes = E * 3 * H * I * bytes_per_weight
    L = layers_for(int(weight_bytes), l2, min_layers=4)
    moe = layer(shape, fp8)
    bf16_moe = layer(shape) if fp8 else None  # the bf16 layer on the same rows, timed beside it
    unsplit_moe = unsplit_layer(shape, fp8) if unsplit else None
    layers = []
    for _ in range(L):
        x, w13, w2, scales = draw_layer(E, H, I, T, gen, device, fp8)
        ids, w = routing(E, k, T, "uniform", gen, device)
        # Rows grouped by expert for the grouped_mm baseline (the same token-expert pairs).
        flat = ids.flatten().long()
        valid = flat >= 0
        order = torch.argsort(torch.where(valid, flat, E), stable=True)[: int(valid.sum())]
        xs = x[order // k].contiguous()
        counts = torch.bincount(flat[valid], minlength=E)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        layers.append(
            dict(w13=w13, w2=w2, x=x, ids=ids, w=w, out=torch.empty_like(x), xs=xs, offs=offs, **scales)
        )
    pairs = int(sum(int(lay["offs"][-1]) for lay in layers)) / L

    def runner(m: FlashMoE):
        """A graph body: every layer of the step through ``m`` (the default layer, or the unsplit one)."""

        def run():
            for lay in layers:
                extra = (
                    dict(w13_scale_inv=lay["w13_scale_inv"], w2_scale_inv=lay["w2_scale_inv"]) if fp8 else {}
                )
                m(lay["x"], lay["ids"], lay["w"], lay["w13"], lay["w2"], out=lay["out"], **extra)

        return run

    run_flashmoe = runner(moe)

    if fp8:  # bf16 weights of the same shape for the bf16 layer and grouped_mm (one set: fp8's L x 2 bytes)
        bf16_w = [weights(E, H, I, gen, device) for _ in range(L)]

    def run_bf16():
        for lay, (w13, w2) in zip(layers, bf16_w, strict=True):
            bf16_moe(lay["x"], lay["ids"], lay["w"], w13, w2, out=lay["out"])

    def run_grouped():
        for i, lay in enumerate(layers):
            w13, w2 = bf16_w[i] if fp8 else (lay["w13"], lay["w2"])
            h = torch._grouped_mm(lay["xs"], w13.transpose(1, 2), offs=lay["offs"])
            a = F.silu(h[:, :I]) * h[:, I:]
            torch._grouped_mm(a, w2.transpose(1, 2), offs=lay["offs"])

    fm = CallTimes([t / L for t in graph_times(run_flashmoe, device, replays).seconds])
    phases = phase_breakdown(moe.layer_id)
    # A/B of the small-T GEMM0 split: unsplit, then the default again (drift shows as a changed second p50).
    if unsplit:
        un = CallTimes([t / L for t in graph_times(runner(unsplit_moe), device, replays).seconds])
        fm_again = CallTimes([t / L for t in graph_times(run_flashmoe, device, replays).seconds])
    gm = CallTimes([t / L for t in graph_times(run_grouped, device, replays).seconds])
    bf = CallTimes([t / L for t in graph_times(run_bf16, device, replays).seconds]) if fp8 else None
    flops = 6 * pairs * H * I
    touched = sum(int((lay["offs"].diff(prepend=lay["offs"].new_zeros(1)) > 0).sum()) for lay in layers) / L
    floor_hbm = touched * 3 * H * I * bytes_per_weight / 4.3e12
    floor_mma = flops / (1580e12 if fp8 else 790e12)
    row = dict(
        shape=shape,
        dtype="fp8" if fp8 else "bf16",
        tokens=T,
        layers=L,
        pairs=pairs,
        experts_touched=touched,
        flashmoe_us=[fm.quantile(q) * 1e6 for q in (0.1, 0.5, 0.9)],
        grouped_mm_us=[gm.quantile(q) * 1e6 for q in (0.1, 0.5, 0.9)],
        floor_us=max(floor_hbm, floor_mma) * 1e6,
        phases_us=phases,
    )
    if bf is not None:
        row["flashmoe_bf16_us"] = [bf.quantile(q) * 1e6 for q in (0.1, 0.5, 0.9)]
    if unsplit:
        row["unsplit_us"] = [un.quantile(q) * 1e6 for q in (0.1, 0.5, 0.9)]
        row["flashmoe_again_us"] = [fm_again.quantile(q) * 1e6 for q in (0.1, 0.5, 0.9)]
    row["flashmoe_tflops"] = flops / (row["flashmoe_us"][1] * 1e-6) / 1e12
    row["grouped_mm_tflops"] = flops / (row["grouped_mm_us"][1] * 1e-6) / 1e12
    print(
        f"time  {shape:15s} T={T:5d} L={L} flashmoe p50 {row['flashmoe_us'][1]:8.1f} us "
        f"(p90/p10 {row['flashmoe_us'][2] / row['flashmoe_us'][0]:.2f}) grouped_mm {row['grouped_mm_us'][1]:8.1f} us "
        f"floor {row['floor_us']:7.1f} us"
        + (f" bf16 layer {row['flashmoe_bf16_us'][1]:.1f} us" if bf is not None else "")
        + (
            f" unsplit {row['unsplit_us'][1]:.1f} us, default again {row['flashmoe_again_us'][1]:.1f} us"
            if unsplit
            else ""
        )
        + " | phases "
        + " ".join(f"{k} {v:.1f}" for k, v in phases.items()),
        flush=True,
    )
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kernel_check.json")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--time-only", action="store_true", help="skip the checks (for timing experiments only)")
    ap.add_argument(
        "--timings",
        default="",
        help="shape:T,T;shape:T... instead of the default timing cases, e.g. qwen3-30b/ep4:1,8,128",
    )
    ap.add_argument("--case", type=int, default=None, help="run only this check case (index into CHECKS)")
    ap.add_argument("--adhoc", default="", help="E,k,H,I,T,routing: check this one case only")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument(
        "--unsplit",
        action="store_true",
        help="also time each case with GEMM0 tiles never split over K (FLASHMOE_GEMM0_SPLITS=1), same rows",
    )
    ap.add_argument(
        "--dtype", choices=("bf16", "fp8"), default="bf16", help="weight format of the checks and timings"
    )
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument(
        "--commit", default=None, help="commit to record when the tree has no .git (GPU machines)"
    )
    args = ap.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    gen = torch.Generator().manual_seed(args.seed)
    result = dict(
        seed=args.seed,
        device=torch.cuda.get_device_name(device),
        torch=torch.__version__,
        commit=args.commit or git_commit(REPO)[0],
        command=" ".join(sys.argv),
        build=build_info(),
    )
    t0 = time.time()
    if args.adhoc:
        E, k, H, I, T, kind = args.adhoc.split(",")
        SHAPES["adhoc"] = (int(E), int(k), int(H), int(I))
        CHECKS[:] = [("adhoc", int(T), kind)]
    if args.timings:
        TIMINGS[:] = [
            (shape, int(t))
            for part in args.timings.split(";")
            for shape, tokens in [part.split(":")]
            for t in tokens.split(",")
        ]
    fp8 = args.dtype == "fp8"
    result["dtype"] = args.dtype
    result["checks"] = [] if args.time_only else check(gen, device, args.case, fp8)
    result["check_seconds"] = time.time() - t0
    if not args.check_only:
        l2 = l2_bytes(device)
        result["timings"] = [
            time_case(s, t, gen, device, l2, args.replays, fp8, args.unsplit) for s, t in TIMINGS
        ]
    Path(args.out).write_text(json.dumps(result, indent=1))
    failed = [c for c in result["checks"] if not c["ok"]]
    print(f"\n{len(result['checks']) - len(failed)}/{len(result['checks'])} checks ok")
    if "timings" in result:
        print(
            f"{'shape':15s} {'T':>5s} {'flashmoe p50':>12s} {'p90/p10':>7s} {'grouped_mm':>10s} {'ratio':>6s} "
            f"{'floor':>7s} {'x floor':>7s} {'TFLOP/s fm/gm':>14s}" + (f" {'bf16 layer':>10s}" if fp8 else "")
        )
        for r in result["timings"]:
            fm, gm = r["flashmoe_us"], r["grouped_mm_us"]
            print(
                f"{r['shape']:15s} {r['tokens']:5d} {fm[1]:12.1f} {fm[2] / fm[0]:7.2f} {gm[1]:10.1f} "
                f"{gm[1] / fm[1]:6.2f} {r['floor_us']:7.1f} {fm[1] / r['floor_us']:7.2f} "
                f"{r['flashmoe_tflops']:6.0f}/{r['grouped_mm_tflops']:<6.0f}"
                + (f" {r['flashmoe_bf16_us'][1]:10.1f}" if fp8 else "")
            )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
