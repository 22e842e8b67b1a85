#!/usr/bin/env python3
"""The megakernel correctness matrix as one command: every world size, every check, one JSON file.

    python tests/megakernel_matrix.py --worlds 1,2,4 --configs 60 --out $OUT/matrix.json
    python tests/megakernel_matrix.py --worlds 1,2,4 --dtype fp8 --out $OUT/matrix-fp8.json

Per world size it spawns one process group (ranks = GPUs 0..W-1) that runs all configurations and the
selected checks, then the timeout check in fresh processes (W >= 2). Configurations are drawn with a
fixed ``--seed`` from issue 3's grid, biased toward small shapes (see
``megakernel_cases.draw_configs``: E=256/H=7168/I=2048 layers are rare), and the same list runs on every
world size. A failing configuration is recorded and the rest continue; a kernel timeout or a hang
ends that world size (recorded) and the next one starts. The JSON has the machine, commit, command,
and per record: weight dtype, pass/fail, relative errors vs the same-rounding reference and vs the fp64
oracle, max abs error, seconds. A short table is printed last. Exit status 0 only if everything passed.

``--dtype`` picks the expert weights: ``bf16``, ``fp8`` (block-fp8: e4m3 with one fp32 scale per 128 x 128
block, checked against ``flashmoe.reference_fp8`` under the fp8 budgets of ``tolerances.py``), or both
(``bf16,fp8``: one process group per world runs both). Every check runs per dtype. fp8 draws from the
same grid and seed (every H and I of it is a multiple of 128), ``--fp8-configs`` configurations (default
24: from 16 on, every grid value appears) unless ``--configs`` is given: the fp8 reference computes each
128-K block's partial sum in float64, the slowest part of an fp8 world.

``--device cpu --tiny`` runs the same harness over gloo with the reference backend (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from megakernel_cases import CHECKS, draw_configs, run_timeout_check, run_world  # noqa: E402
from tolerances import (  # noqa: E402
    FP8_ORACLE_REL_FRO,
    FP8_ROW_FLIP_COEFF,
    FP8_SAME_ROUNDING_REL_FRO,
    ORACLE_REL_FRO,
    SAME_ROUNDING_REL_FRO,
    WEIGHT_DTYPES,
)

GPU_ONLY_CHECKS = ("graph", "timeout")
BF16_CONFIGS = 60
FP8_CONFIGS = 24  # >= 16: the draw covers every grid value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--worlds",
        default="1,2,4",
        help="comma-separated EP sizes; sizes above the GPU count are skipped (default 1,2,4)",
    )
    p.add_argument(
        "--configs",
        type=int,
        default=None,
        help="random configurations per world size and dtype (default: 60 bf16, --fp8-configs fp8)",
    )
    p.add_argument(
        "--dtype",
        default="bf16",
        help=f"comma-separated expert weight dtypes, of {','.join(WEIGHT_DTYPES)} (default bf16)",
    )
    p.add_argument(
        "--fp8-configs",
        type=int,
        default=FP8_CONFIGS,
        help=f"fp8 configurations when --configs is not given (default {FP8_CONFIGS})",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the configuration draw and all inputs (default 0)"
    )
    p.add_argument(
        "--checks",
        default=",".join(CHECKS),
        help=f"comma-separated subset of {','.join(CHECKS)} (default: all)",
    )
    p.add_argument("--graph-replays", type=int, default=1000, help="CUDA graph replays (default 1000)")
    p.add_argument(
        "--stress-delay-ns",
        type=int,
        default=2000,
        help="FLASHMOE_STRESS_DELAY_NS of the stress variant (default 2000)",
    )
    p.add_argument(
        "--timeout-ms", type=int, default=2000, help="FLASHMOE_TIMEOUT_MS of the timeout check (default 2000)"
    )
    p.add_argument(
        "--world-limit-s", type=float, default=900, help="hard limit per world size in seconds (default 900)"
    )
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="cpu: gloo + reference backend (harness test)",
    )
    p.add_argument("--tiny", action="store_true", help="draw from a tiny shape grid (for --device cpu)")
    p.add_argument("--out", type=Path, default=None, help="JSON report path (default: print only)")
    return p.parse_args(argv)


def machine(device: str) -> dict:
    import torch

    if device == "cuda":
        return {
            "gpu": torch.cuda.get_device_name(0),
            "gpu_count": torch.cuda.device_count(),
            "torch": torch.__version__,
        }
    return {"gpu": None, "gpu_count": 0, "cpu_count": os.cpu_count(), "torch": torch.__version__}


def commit() -> str:
    if os.environ.get("FLASHMOE_COMMIT"):
        return os.environ["FLASHMOE_COMMIT"]
    try:
        root = Path(__file__).resolve().parent.parent
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def table(report: dict) -> str:
    """Per (world, check, dtype): passed/total, worst errors, seconds; then every failure on one line."""
    rows = [
        f"{'world':>5} {'check':<12} {'dtype':<5} {'pass':>7} {'worst rel vs ref':>17} {'worst rel vs fp64':>18} "
        f"{'seconds':>8}"
    ]
    failures = []
    for w in report["worlds"]:
        groups: dict[tuple[str, str], list[dict]] = {}
        for r in w["records"]:
            groups.setdefault((r["check"], r.get("dtype") or "bf16"), []).append(r)
        for (check, dtype), recs in groups.items():
            ok = sum(r["passed"] for r in recs)
            ref = max((r.get("rel_err_ref", 0.0) for r in recs), default=0.0)
            orc = max((r.get("rel_err_oracle", 0.0) for r in recs), default=0.0)
            secs = sum(r.get("seconds", 0.0) for r in recs)
            rows.append(
                f"{w['world']:>5} {check:<12} {dtype:<5} {ok:>3}/{len(recs):<3} {ref:>17.2e} {orc:>18.2e} {secs:>8.1f}"
            )
            for r in recs:
                if not r["passed"]:
                    why = r.get("error") or "; ".join(
                        f"rank {k}: {v.splitlines()[0]}" for k, v in r.get("errors", {}).items()
                    )
                    failures.append(
                        f"  FAIL world {w['world']} {check} {dtype} #{r.get('index')} {r.get('label', '')}: "
                        f"{why or 'over budget'}"
                    )
        if w.get("error"):
            failures.append(f"  ABORTED world {w['world']}: {w['error'].splitlines()[0]}")
    dtypes = report.get("dtypes", ["bf16"])
    if "bf16" in dtypes:
        rows.append(
            f"bf16 budgets: rel Frobenius vs same-rounding reference <= {SAME_ROUNDING_REL_FRO:.2e}, "
            f"vs fp64 oracle <= {ORACLE_REL_FRO:.2e}"
        )
    if "fp8" in dtypes:
        rows.append(
            f"fp8 budgets: rel Frobenius vs same-rounding reference <= {FP8_SAME_ROUNDING_REL_FRO:.2e}, "
            f"vs fp64 oracle <= {FP8_ORACLE_REL_FRO:.2e}, rows <= max(those, {FP8_ROW_FLIP_COEFF} / sqrt(I))"
        )
    return "\n".join(rows + failures)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise SystemExit(f"unknown checks {unknown}; choose from {CHECKS}")
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    if not dtypes or set(dtypes) - set(WEIGHT_DTYPES):
        raise SystemExit(f"--dtype {args.dtype!r}: choose from {WEIGHT_DTYPES}")
    if device == "cpu":
        checks = [c for c in checks if c not in GPU_ONLY_CHECKS]
    available = torch.cuda.device_count() if device == "cuda" else 64  # gloo ranks need no cores of their own
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    skipped = [w for w in worlds if w > available]
    worlds = [w for w in worlds if w <= available]
    default = {"bf16": BF16_CONFIGS, "fp8": args.fp8_configs}
    counts = {d: default[d] if args.configs is None else args.configs for d in dtypes}
    configs = [c for d in dtypes for c in draw_configs(counts[d], args.seed, tiny=args.tiny, dtype=d)]
    task = {
        "device": device,
        "checks": [c for c in checks if c != "timeout"],
        "configs": [vars(c) | {"tokens": list(c.tokens)} for c in configs],
        "dtypes": dtypes,
        "seed": args.seed,
        "tiny": args.tiny,
        "graph_replays": args.graph_replays,
        "stress_delay_ns": args.stress_delay_ns,
        "timeout_ms": args.timeout_ms,
    }
    report = {
        "machine": machine(device),
        "commit": commit(),
        "command": " ".join([sys.executable, *sys.argv]),
        "seed": args.seed,
        "checks": checks,
        "dtypes": dtypes,
        "configs_per_dtype": {d: counts[d] for d in dtypes},
        "skipped_worlds": skipped,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "worlds": [],
    }
    with tempfile.TemporaryDirectory(prefix="flashmoe-matrix-") as tmp:
        for world in worlds:
            print(
                f"world {world}: {len(configs)} configs ({', '.join(f'{counts[d]} {d}' for d in dtypes)}), "
                f"checks {','.join(checks)}",
                flush=True,
            )
            result = run_world(world, task, Path(tmp) / f"world{world}", args.world_limit_s)
            if "timeout" in checks and world >= 2:
                for dtype in dtypes:
                    task_t = task | {"timeout_dtype": dtype}
                    result["records"].append(
                        run_timeout_check(world, task_t, Path(tmp) / f"timeout{world}_{dtype}")
                    )
            report["worlds"].append(result)
            if args.out:  # after every world, so a later crash keeps what finished
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(report, indent=1))
    report["passed"] = all(
        w["error"] is None and all(r["passed"] for r in w["records"]) for w in report["worlds"]
    )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    if skipped:
        print(f"skipped worlds {skipped}: only {available} {'GPUs' if device == 'cuda' else 'CPUs'}")
    print(table(report))
    print("PASSED" if report["passed"] else "FAILED")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
