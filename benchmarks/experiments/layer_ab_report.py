"""Table and results file from an A/B of layer_bench runs (benchmarks/layer_bench.py --out files): NAME=FILE
pairs in the order the runs were made, each case's p50 per run and its ratio to the base's first run of it.

    python benchmarks/experiments/layer_ab_report.py base=b1.json v2=v.json base=b2.json --base base \\
        --json benchmarks/results/<date>-<machine>-<what>.json --machine nvidia-h200-x2 --commit <sha> \\
        --what "..." --command "..."

A name given twice (a base run bracketing the others) is kept as <name>.run2, so the drift between the two
shows beside the runs made between them. The results file holds every run's whole layer_bench output.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from variants_report import cell  # the same table cells as the kernel_check variants' report


def load_runs(pairs: list[str]) -> list[tuple[str, dict]]:
    """(run name, layer_bench output) per NAME=FILE, in the order given; repeated names get .runN."""
    runs, seen = [], {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"layer_ab_report: {pair!r} is not NAME=FILE")
        seen[name] = seen.get(name, 0) + 1
        runs.append(
            (name if seen[name] == 1 else f"{name}.run{seen[name]}", json.loads(Path(path).read_text()))
        )
    return runs


def case_key(row: dict) -> tuple:
    """What a row measured, apart from the tree: model, weights, routing, tokens per rank, padding ranks, mode."""
    return (
        row["model"],
        row["dtype"],
        row["routing"],
        int(row["tokens_per_rank"]),
        int(row.get("padding_ranks") or 0),
        row["mode"],
        row["variant"],
    )


def table(runs: list[tuple[str, dict]], base: str) -> tuple[list[str], list[dict]]:
    """Header and one row per case: each run's p50 (and p10, p90, x floor), and base p50 / run p50 (above 1 =
    faster), the base being the first of the base's runs that measured the case (a bf16 pass and an fp8 pass of
    the same trees each get theirs). Cases a run did not measure, or measured without a latency, stay empty."""
    names = [name for name, _ in runs]
    if base not in names:
        raise SystemExit(f"layer_ab_report: no run named {base!r} among {names}")
    per_run = {
        name: {case_key(r): r for r in result.get("rows", []) if r.get("latency_p50_us") is not None}
        for name, result in runs
    }
    cases = sorted({case for rows in per_run.values() for case in rows})
    base_runs = [name for name in names if name == base or name.startswith(base + ".run")]
    out = []
    for case in cases:
        model, dtype, routing, tokens, padding, mode, variant = case
        row = {
            "model": model,
            "dtype": dtype,
            "routing": routing,
            "tokens_per_rank": tokens,
            "padding_ranks": padding,
            "mode": mode,
            "variant": variant,
            "p50_us": {},
            "p10_p90_us": {},
            "x_floor": {},
            "speedup_vs_base": {},
        }
        ref = next((per_run[n][case] for n in base_runs if case in per_run[n]), None)
        for name in names:
            r = per_run[name].get(case)
            if r is None:
                continue
            row["p50_us"][name] = round(r["latency_p50_us"], 2)
            row["p10_p90_us"][name] = [round(r["latency_p10_us"], 2), round(r["latency_p90_us"], 2)]
            if r.get("x_floor") is not None:
                row["x_floor"][name] = round(r["x_floor"], 3)
            if ref is not None:
                row["speedup_vs_base"][name] = round(ref["latency_p50_us"] / r["latency_p50_us"], 3)
        out.append(row)
    return names, out


def markdown(names: list[str], rows: list[dict]) -> str:
    lines = ["| case | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    for row in rows:
        case = f"{row['model']} {row['dtype']} {row['routing']} T={row['tokens_per_rank']}"
        if row["padding_ranks"]:
            case += f" +{row['padding_ranks']} padding"
        cells = [cell(row["p50_us"].get(name), row["speedup_vs_base"].get(name)) for name in names]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="NAME=FILE, in the order the runs were made")
    ap.add_argument("--base", default="base", help="run the ratios are taken against (its first run)")
    ap.add_argument("--json", type=Path, help="write the results file here")
    ap.add_argument("--machine", default="", help="the device kind, e.g. nvidia-h200-x2")
    ap.add_argument("--commit", default="", help="commit(s) of the trees, and what each name stands for")
    ap.add_argument("--what", default="", help="one sentence: what the runs compare")
    ap.add_argument("--command", default="", help="the command lines that made the files")
    args = ap.parse_args()
    runs = load_runs(args.runs)
    names, rows = table(runs, args.base)
    print(markdown(names, rows))
    if args.json:
        doc = {
            "machine": args.machine,
            "commit": args.commit,
            "what": args.what,
            "command": args.command,
            "base": args.base,
            "rows": rows,
            "runs": dict(runs),
        }
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
