"""Timing experiments on one GPU: copies of the checkout with one source change each, timed by
scripts/kernel_check.py --time-only (a variant's numerics may be wrong: it answers "where does the time go").

    python benchmarks/experiments/gemm_variants.py "qwen3-30b/ep4:8,128" OUT_DIR base,gemm0_only,no_wgmma

Run from the repository root; each variant is built from /tmp/var/<name> (its own JIT cache key).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

SRC = Path.cwd()


def patch(root, rel, old, new):
    f = root / rel
    s = f.read_text()
    assert old in s, (rel, old)
    f.write_text(s.replace(old, new))


VARIANTS = {
    "base": [],
    "l2none": [("csrc/kernel.cu", "CU_TENSOR_MAP_L2_PROMOTION_L2_256B", "CU_TENSOR_MAP_L2_PROMOTION_NONE")],
    "tokens_zero_fill": [
        (
            "csrc/flashmoe/gemm.cuh",
            "cp_async_16(dst, src, row[i] != nullptr);",
            "cp_async_16(dst, src, false);",
        )
    ],
    "no_cp_async": [
        (
            "csrc/flashmoe/gemm.cuh",
            "constexpr int kFullArrivals = 1 + kProducerThreads;",
            "constexpr int kFullArrivals = 1;",
        ),
        (
            "csrc/flashmoe/gemm.cuh",
            "        cp_async_16(dst, src, row[i] != nullptr);",
            "        (void)dst; (void)src;",
        ),
        ("csrc/flashmoe/gemm.cuh", "      mbar_arrive_on_cp_async(full);\n", ""),
    ],
    "gemm0_only": [
        (
            "csrc/flashmoe/scheduler.cuh",
            "  c.total = c.gemm0 + t.tile_offset[p.num_local] * c.feature_tiles[1];",
            "  c.total = c.gemm0;",
        )
    ],
    "gemm1_only": [
        (
            "csrc/flashmoe/tasks.cuh",
            "    if (task.gemm == 0) {\n      trace(kTraceProducerReady);",
            "    if (task.gemm == 0) { continue;\n      trace(kTraceProducerReady);",
        ),
        (
            "csrc/flashmoe/tasks.cuh",
            "const bool ok = step >= k_steps || ld_acquire_gpu(counters + step) >= arrivals;",
            "const bool ok = true;",
        ),
        (
            "csrc/flashmoe/tasks.cuh",
            "    if (task.gemm == 0) {\n      const bf16* staging",
            "    if (task.gemm == 0) { continue;\n      const bf16* staging",
        ),
    ],
    "no_wgmma": [
        (
            "csrc/flashmoe/gemm.cuh",
            "    for (int kk = 0; kk < kTileK / 16; ++kk) Wgmma<N>::mma(acc, a + 2 * kk, b + 2 * kk, ks > 0 || kk > 0);",
            "    if (ks < 0) Wgmma<N>::mma(acc, a, b, 0);",
        )
    ],
    "stages5": [
        (
            "csrc/flashmoe/gemm.cuh",
            "  return fit < kMaxStages ? fit : kMaxStages;",
            "  return fit < 5 ? fit : 5;",
        ),
        (
            "csrc/flashmoe/gemm.cuh",
            "static_assert(stages_for(32) == 10",
            "static_assert(true || stages_for(32) == 10",
        ),
    ],
    # Numerically unsafe (GEMM1 may read activations before they are visible): the cost of the GEMM0 release.
    "no_fence": [
        (
            "csrc/flashmoe/tasks.cuh",
            "    __threadfence();  // the warpgroup's stores (ordered by the barrier) before the count: release\n",
            "",
        )
    ],
}
timings = sys.argv[1]
out = Path(sys.argv[2])
for name in sys.argv[3].split(","):
    root = Path("/tmp/var") / name
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(SRC, root, ignore=shutil.ignore_patterns(".carry", ".git", "benchmarks/results"))
    for rel, a, b in VARIANTS[name]:
        patch(root, rel, a, b)
    env = dict(os.environ, PYTHONPATH=str(root / "plugin"))
    r = subprocess.run(
        [
            sys.executable,
            str(root / "scripts/kernel_check.py"),
            "--time-only",
            "--timings",
            timings,
            "--out",
            str(out / f"var_{name}.json"),
            "--replays",
            "20",
            "--commit",
            "variant-" + name,
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=root,
    )
    lines = [l for l in r.stdout.splitlines() if l.startswith("time") or "Error" in l]
    print(f"== {name} rc {r.returncode}")
    print("\n".join(lines) if lines else r.stdout[-1500:] + r.stderr[-1500:], flush=True)
