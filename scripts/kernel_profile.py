"""One GPU, world 1: run one megakernel configuration a few times so a profiler can capture a single launch.

    ncu --clock-control none -k regex:moe_layer_kernel --launch-skip 3 --launch-count 1 --set full \
        python scripts/kernel_profile.py --shape qwen3-30b/ep4 --tokens 8

Inputs are fresh random values (uniform routing); the launch is checked against the same-rounding reference
after the profiled launches, so a profile of a wrong kernel is flagged.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flashmoe.reference import moe_reference  # noqa: E402
from kernel_check import SHAPES, layer, routing, weights  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b/ep4", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    gen = torch.Generator().manual_seed(args.seed)
    E, k, H, I = SHAPES[args.shape]
    moe = layer(args.shape)
    w13, w2 = weights(E, H, I, gen, device)
    x = torch.randn(args.tokens, H, generator=gen).to(torch.bfloat16).to(device)
    ids, w = routing(E, k, args.tokens, "uniform", gen, device)
    out = torch.full_like(x, float("nan"))
    for _ in range(args.launches):
        moe(x, ids, w, w13, w2, out=out)
    torch.cuda.synchronize()
    ref = moe_reference(x, ids, w, w13, w2).float()
    err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    print(
        f"{args.shape} T={args.tokens}: {args.launches} launches, rel err vs same-rounding reference {err:.2e}"
    )
    sys.exit(0 if err < 2e-3 else 1)


if __name__ == "__main__":
    main()
