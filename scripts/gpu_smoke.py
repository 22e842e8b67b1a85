"""Quick megakernel check on every GPU of this machine: builds both variants, then for world sizes 1, 2, 4 (as
available) compares a few configurations with the reference, checks determinism, graph replay, the put path,
the stress build and the timeout. The full matrix is tests/megakernel_matrix.py; this is the first look.

    python scripts/gpu_smoke.py --out /tmp/smoke.json

The fp8 leg (``--which`` has ``fp8``, the default): the same configurations with block-fp8 experts (e4m3,
one fp32 scale per 128 x 128 block: tests/moe_inputs.random_fp8_expert_weights, token groups of random
magnitude) against flashmoe.reference_fp8 under the fp8 budget of tests/tolerances.py, each call repeated
bitwise, and one layer on the forced put path bitwise equal to the normal one.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # moe_inputs, tolerances

for k, v in {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}.items():
    os.environ.setdefault(k, v)

CONFIGS = [  # E, k, H, I, tokens per rank (by rank), routing
    (8, 2, 1024, 256, [7, 0, 128, 1], "uniform"),
    (32, 4, 2048, 768, [128, 33, 1, 64], "zipf"),
    (128, 8, 2048, 768, [256, 256, 256, 256], "uniform"),
    (16, 8, 1024, 512, [64, 64, 0, 5], "one_expert"),
    (256, 8, 7168, 2048, [64, 17, 3, 100], "uniform"),
]


def make_inputs(E, k, H, I, T, routing, seed, device):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    if routing == "one_expert":
        ids = torch.full((T, k), -1, dtype=torch.int32)
        ids[:, 0] = 3
    else:
        if routing == "zipf":
            p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
        else:
            p = torch.ones(E, dtype=torch.float64)
        ids = torch.multinomial(p.expand(max(T, 1), E), k, replacement=False, generator=g)[:T].to(torch.int32)
        if T:
            ids[torch.rand(T, k, generator=g) < 0.05] = -1
    w = torch.rand(T, k, generator=g)
    return x.to(device), ids.to(device), w.to(device)


def make_weights(E, H, I, device):
    # On the GPU: the DeepSeek-V3 config is ~7.5 G values, minutes on the CPU. A seeded CUDA generator gives
    # every rank the same weights (the same Philox stream on every device).
    g = torch.Generator(device=device).manual_seed(1234 + E + H + I)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device=device) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g, device=device) / I**0.5).to(torch.bfloat16)
    return w13, w2


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def fp8_leg(world, rank, dev, record):
    """CONFIGS with block-fp8 experts (every H and I there is a multiple of 128); see the module docstring."""
    from flashmoe import ExpertPlacement, FlashMoE, MoELayerSpec, megakernel
    from flashmoe.reference_fp8 import moe_reference_fp8
    from moe_inputs import random_fp8_expert_weights, random_grouped_hidden
    from tolerances import error_stats, kernel_budgets

    for ci, (E, k, H, I, Ts, routing) in enumerate(CONFIGS):
        name = f"fp8:cfg{ci}:E{E}k{k}H{H}I{I}:{routing}"
        try:
            pl = ExpertPlacement.round_robin(E, world) if ci % 2 else ExpertPlacement.contiguous(E, world)
            # A seeded CUDA generator draws the same weights on every rank.
            g = torch.Generator(device=dev).manual_seed(4321 + E + H + I)
            w13, s13, w2, s2 = random_fp8_expert_weights(E, H, I, g, dev)
            loc = pl.local_experts(rank).long().to(dev)
            mine = [t[loc].contiguous() for t in (w13, w2)]
            scales = dict(w13_scale_inv=s13[loc].contiguous(), w2_scale_inv=s2[loc].contiguous())
            spec = MoELayerSpec(E, k, H, I, 256, weight_dtype=torch.float8_e4m3fn)
            moe = FlashMoE(spec, pl, dist.group.WORLD, layer_name=name)
            assert moe.backend == "megakernel", moe.reason
            xs = []
            for r in range(world):
                T = Ts[r % len(Ts)]
                _, ids_r, w_r = make_inputs(E, k, H, I, T, routing, 100 * ci + r, dev)
                x_r = random_grouped_hidden(T, H, torch.Generator().manual_seed(200 * ci + r)).to(dev)
                xs.append((x_r, ids_r, w_r))
            x, ids, w = xs[rank]
            out, again = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
            moe(x, ids, w, *mine, out=out, **scales)
            moe(x, ids, w, *mine, out=again, **scales)
            megakernel.synchronize_and_check()
            X, IDS, W = (torch.cat([inp[i] for inp in xs]) for i in range(3))
            start = sum(Ts[r % len(Ts)] for r in range(rank))
            ref = moe_reference_fp8(X, IDS, W, w13, s13, w2, s2)[start : start + x.shape[0]]
            stats = error_stats(out, ref)
            det = torch.equal(out, again)
            ok = stats.within(*kernel_budgets("fp8", I)["ref"]) and det
            extra = {}
            if ci == 1:  # the put path (FLASHMOE_FORCE_PUT is read when a layer is built)
                os.environ["FLASHMOE_FORCE_PUT"] = "1"
                moe_put = FlashMoE(spec, pl, dist.group.WORLD, layer_name="fp8_put")
                os.environ["FLASHMOE_FORCE_PUT"] = "0"
                put = torch.full_like(x, float("nan"))
                moe_put(x, ids, w, *mine, out=put, **scales)
                megakernel.synchronize_and_check()
                extra["force_put_bitwise"] = torch.equal(out, put)
                ok = ok and extra["force_put_bitwise"]
            record(
                name, ok, rel_err=stats.rel_fro, row_rel_err=stats.max_row_rel, nonfinite=stats.nonfinite,
                deterministic=det, T=x.shape[0], **extra,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001
            record(name, False, error=f"{type(e).__name__}: {e}"[:2000], tb=traceback.format_exc()[-3000:])
            if "timed out" in str(e):
                raise


def worker(rank, world, port, out_q, which):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    import flashmoe
    from flashmoe import ExpertPlacement, FlashMoE, MoELayerSpec, megakernel
    from flashmoe.reference import moe_oracle_fp64, moe_reference

    results = []

    def record(name, ok, **kw):
        results.append({"world": world, "rank": rank, "case": name, "ok": bool(ok), **kw})

    try:
        t0 = time.time()
        megakernel.reserve(256, 7168, 2048, 8, 256)
        record("reserve", True, seconds=round(time.time() - t0, 1))
        for ci, (E, k, H, I, Ts, routing) in enumerate(CONFIGS):
            name = f"cfg{ci}:E{E}k{k}H{H}I{I}:{routing}"
            try:
                pl = ExpertPlacement.round_robin(E, world) if ci % 2 else ExpertPlacement.contiguous(E, world)
                w13, w2 = make_weights(E, H, I, dev)
                loc = pl.local_experts(rank).long().to(dev)
                moe = FlashMoE(MoELayerSpec(E, k, H, I, 256), pl, dist.group.WORLD, layer_name=name)
                assert moe.backend == "megakernel", moe.reason
                xs = [
                    make_inputs(E, k, H, I, Ts[r % len(Ts)], routing, 100 * ci + r, dev) for r in range(world)
                ]
                x, ids, w = xs[rank]
                out = torch.full_like(x, float("nan"))
                moe(x, ids, w, w13[loc].contiguous(), w2[loc].contiguous(), out=out)
                megakernel.synchronize_and_check()
                X, IDS, W = (torch.cat([inp[i] for inp in xs]) for i in range(3))
                ref_all = moe_reference(X, IDS, W, w13, w2)
                start = sum(Ts[r % len(Ts)] for r in range(rank))
                ref = ref_all[start : start + x.shape[0]]
                nan = bool(torch.isnan(out).any())
                err = rel_err(out, ref) if x.shape[0] else 0.0
                orc = (
                    moe_oracle_fp64(X, IDS, W, w13, w2)[start : start + x.shape[0]]
                    if E * H * I <= 32 * 2048 * 768
                    else None
                )
                err_o = rel_err(out, orc) if orc is not None and x.shape[0] else None
                out2 = torch.empty_like(out)
                moe(x, ids, w, w13[loc].contiguous(), w2[loc].contiguous(), out=out2)
                megakernel.synchronize_and_check()
                det = torch.equal(out, out2)
                record(
                    name,
                    (not nan) and err < 1e-2 and det,
                    rel_err=err,
                    rel_err_oracle=err_o,
                    nan=nan,
                    deterministic=det,
                    T=x.shape[0],
                )
            except Exception as e:  # noqa: BLE001
                record(
                    name, False, error=f"{type(e).__name__}: {e}"[:2000], tb=traceback.format_exc()[-3000:]
                )
                if "timed out" in str(e):
                    raise
        # Graph capture + replays with new inputs.
        E, k, H, I = 32, 4, 2048, 768
        pl = ExpertPlacement.contiguous(E, world)
        w13, w2 = make_weights(E, H, I, dev)
        loc = pl.local_experts(rank).long().to(dev)
        w13l, w2l = w13[loc].contiguous(), w2[loc].contiguous()
        moe = FlashMoE(MoELayerSpec(E, k, H, I, 256), pl, dist.group.WORLD, layer_name="graph")
        T = 64
        sx, sids, sw = make_inputs(E, k, H, I, T, "uniform", 7, dev)
        sout = torch.empty_like(sx)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            moe(sx, sids, sw, w13l, w2l, out=sout)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            moe(sx, sids, sw, w13l, w2l, out=sout)
        worst = 0.0
        replays = 200
        for it in range(replays):
            xs = [make_inputs(E, k, H, I, T, "uniform", 10_000 + it * world + r, dev) for r in range(world)]
            for static, new in zip((sx, sids, sw), xs[rank], strict=True):
                static.copy_(new)
            g.replay()
            if it % 50 == 0 or it == replays - 1:
                megakernel.synchronize_and_check()
                X, IDS, W = (torch.cat([inp[i] for inp in xs]) for i in range(3))
                ref = moe_reference(X, IDS, W, w13, w2)[rank * T : (rank + 1) * T]
                worst = max(worst, rel_err(sout, ref))
        record("graph_replay", worst < 1e-2, replays=replays, worst_rel_err=worst)
        # Timing (single layer, events) for a first look.
        x, ids, w = make_inputs(E, k, H, I, T, "uniform", 5, dev)
        o = torch.empty_like(x)
        for _ in range(5):
            moe(x, ids, w, w13l, w2l, out=o)
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        ev0.record()
        for _ in range(50):
            moe(x, ids, w, w13l, w2l, out=o)
        ev1.record()
        torch.cuda.synchronize()
        record("timing_E32k4H2048I768_T64", True, us_per_call=ev0.elapsed_time(ev1) * 1000 / 50)
        # Put path.
        os.environ["FLASHMOE_FORCE_PUT"] = "1"
        moe_put = FlashMoE(MoELayerSpec(E, k, H, I, 256), pl, dist.group.WORLD, layer_name="put")
        os.environ["FLASHMOE_FORCE_PUT"] = "0"
        o1, o2 = torch.empty_like(x), torch.empty_like(x)
        moe(x, ids, w, w13l, w2l, out=o1)
        moe_put(x, ids, w, w13l, w2l, out=o2)
        megakernel.synchronize_and_check()
        record("force_put_bitwise", torch.equal(o1, o2))
        if "stress" in which:
            os.environ["FLASHMOE_STRESS_DELAY_NS"] = "2000"
            moe_s = FlashMoE(MoELayerSpec(E, k, H, I, 256), pl, dist.group.WORLD, layer_name="stress")
            os.environ["FLASHMOE_STRESS_DELAY_NS"] = "0"
            o3 = torch.empty_like(x)
            same = True
            for _ in range(20):
                moe_s(x, ids, w, w13l, w2l, out=o3)
                megakernel.synchronize_and_check()
                same = same and torch.equal(o1, o3)
            record("stress_bitwise", same)
        if "fp8" in which:
            fp8_leg(world, rank, dev, record)
        if "timeout" in which and world > 1:
            os.environ["FLASHMOE_TIMEOUT_MS"] = "2000"
            moe_t = FlashMoE(MoELayerSpec(E, k, H, I, 256), pl, dist.group.WORLD, layer_name="timeout")
            t0 = time.time()
            if rank != world - 1:
                moe_t(x, ids, w, w13l, w2l, out=o1)
                try:
                    megakernel.synchronize_and_check()
                    record("timeout_raises", False, error="no exception")
                except flashmoe.FlashMoETimeoutError as e:
                    record(
                        "timeout_raises",
                        f"peer rank {world - 1}" in str(e) or "rank" in str(e),
                        seconds=round(time.time() - t0, 1),
                        message=str(e),
                    )
            else:
                record("timeout_skipped_rank", True)
    except Exception as e:  # noqa: BLE001
        record("worker", False, error=f"{type(e).__name__}: {e}"[:2000], tb=traceback.format_exc()[-4000:])
    out_q.put(results)
    out_q.close()
    out_q.join_thread()  # the queue's feeder thread must flush before the hard exit below
    sys.stdout.flush()
    os._exit(0)  # skip teardown: a timed-out NVSHMEM state cannot finalise cleanly


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="smoke.json")
    ap.add_argument("--worlds", default="")
    ap.add_argument("--which", default="stress,timeout,fp8")
    args = ap.parse_args()

    t0 = time.time()
    import subprocess

    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "flashmoe.build"]
            + (["--variant", "stress"] if v else ["--variant", "default"])
        )
        for v in (0, 1)
    ]
    for p in procs:
        p.wait()
    build_s = time.time() - t0
    n = torch.cuda.device_count()
    worlds = [int(w) for w in args.worlds.split(",")] if args.worlds else [w for w in (1, 2, 4) if w <= n]
    ctx = mp.get_context("spawn")
    all_results = [
        {"case": "build", "ok": all(p.returncode == 0 for p in procs), "seconds": round(build_s, 1)}
    ]
    for world in worlds:
        q = ctx.Queue()
        port = free_port()
        ps = [ctx.Process(target=worker, args=(r, world, port, q, args.which)) for r in range(world)]
        for p in ps:
            p.start()
        got = []
        deadline = time.time() + 360  # the fp8 leg draws and checks the DeepSeek-V3-sized layer too
        while len(got) < world and time.time() < deadline:
            try:
                got.append(q.get(timeout=5))
            except Exception:  # noqa: BLE001
                if not any(p.is_alive() for p in ps):
                    break
        for p in ps:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if len(got) < world:
            all_results.append(
                {
                    "world": world,
                    "case": "workers",
                    "ok": False,
                    "error": f"only {len(got)}/{world} reported (hang or crash)",
                }
            )
        for r in got:
            all_results.extend(r)
    info = {
        "device": torch.cuda.get_device_name(0),
        "gpus": n,
        "torch": torch.__version__,
        "results": all_results,
    }
    with open(args.out, "w") as f:
        json.dump(info, f, indent=1)
    print(f"{'world':>5} {'rank':>4} {'ok':>3}  case / details")
    for r in all_results:
        extra = {k: v for k, v in r.items() if k not in ("world", "rank", "ok", "case", "tb")}
        print(
            f"{r.get('world', '-'):>5} {r.get('rank', '-'):>4} {'ok' if r['ok'] else 'NO':>3}  {r['case']} {json.dumps(extra)[:300]}"
        )
    bad = [r for r in all_results if not r["ok"]]
    for r in bad[:3]:
        if "tb" in r:
            print(r["tb"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
