"""Table and results file from a gemm_variants.py run: every var_*.json (kernel_check.py --time-only) in a
directory, the median per (shape, tokens) for each variant run, and each run against the first run of a base.

    python benchmarks/experiments/variants_report.py OUT_DIR --base base \\
        --json benchmarks/results/<date>-<machine>-<what>.json --commit <sha> --what "..." --command "..."

Runs keep their order of execution (file modification time), so a base run twice shows the drift between its
two runs beside the variants timed between them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_runs(directory: Path) -> list[tuple[str, dict]]:
    """(run name, kernel_check result) for every var_*.json, oldest first."""
    files = sorted(directory.glob("var_*.json"), key=lambda f: f.stat().st_mtime)
    return [(f.name.removeprefix("var_").removesuffix(".json"), json.loads(f.read_text())) for f in files]


def trace_summaries(directory: Path) -> dict[str, dict]:
    """Each trace_<run>.json (gemm_variants --trace, raw events) analysed as scripts/kernel_trace.py does, per token
    count: GEMM phase, per-tile medians, per-SM rates and the streaming timeline (the steps table left out)."""
    files = sorted(directory.glob("trace_*.json"))
    if not files:
        return {}
    repo = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(repo / "scripts"), str(repo / "plugin")]
    import kernel_trace  # torch at import: only when there are traces

    out = {}
    for f in files:
        doc, summaries = kernel_trace.analyse_raw(f)
        cases = {}
        for T, summary in summaries.items():
            summary.pop("transitions", None)
            cases[T] = {"rel_err_vs_reference": doc["cases"][T].get("rel_err_vs_reference"), **summary}
        out[f.name.removeprefix("trace_").removesuffix(".json")] = {
            "shape": doc["shape"],
            "dtype": doc.get("dtype"),
            "cases": cases,
        }
    return out


def medians(result: dict) -> dict[tuple[str, int], float]:
    """(shape, tokens) -> the layer's median time in us (kernel_check's flashmoe_us is p10, p50, p90)."""
    return {
        (t["shape"], int(t["tokens"])): float(t["flashmoe_us"][1])
        for t in result.get("timings", [])
        if t.get("flashmoe_us")  # a case that failed to time has none
    }


def table(runs: list[tuple[str, dict]], base: str) -> tuple[list[str], list[dict]]:
    """Header and one row per case: each run's median, and its ratio to the base's first run (base / run:
    above 1 = faster than the base)."""
    names = [name for name, _ in runs]
    if base not in names:
        raise SystemExit(f"variants_report: no run named {base!r} among {names}")
    per_run = {name: medians(result) for name, result in runs}
    cases = sorted({case for m in per_run.values() for case in m})
    rows = []
    for shape, tokens in cases:
        row = {"shape": shape, "tokens": tokens, "us": {}, "speedup_vs_base": {}}
        ref = per_run[base].get((shape, tokens))
        for name in names:
            value = per_run[name].get((shape, tokens))
            if value is None:
                continue
            row["us"][name] = round(value, 2)
            if ref is not None:
                row["speedup_vs_base"][name] = round(ref / value, 3)
        rows.append(row)
    return names, rows


def cell(us: float | None, ratio: float | None) -> str:
    """A table cell: a run's time and its ratio to the base ('-' where the run did not time the case)."""
    return "-" if us is None else f"{us:.1f}" + ("" if ratio is None else f" ({ratio:.2f}x)")


def markdown(names: list[str], rows: list[dict]) -> str:
    lines = ["| shape | T | " + " | ".join(names) + " |", "| --- | ---: |" + " ---: |" * len(names)]
    for row in rows:
        cells = [cell(row["us"].get(name), row["speedup_vs_base"].get(name)) for name in names]
        lines.append(f"| {row['shape']} | {row['tokens']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", type=Path)
    ap.add_argument("--base", default="base", help="run the ratios are taken against (its first run)")
    ap.add_argument("--json", type=Path, help="write the results file here")
    ap.add_argument("--commit", default="", help="commit of the tree the variants were made from")
    ap.add_argument("--what", default="", help="one sentence: what the variants test")
    ap.add_argument("--command", default="", help="the gemm_variants.py command line that made the files")
    args = ap.parse_args()
    runs = load_runs(args.directory)
    if not runs:
        raise SystemExit(f"variants_report: no var_*.json in {args.directory}")
    names, rows = table(runs, args.base)
    print(markdown(names, rows))
    if args.json:
        first = runs[0][1]
        doc = {
            "commit": args.commit,
            "machine": first.get("device", ""),
            "torch": first.get("torch", ""),
            "what": args.what,
            "command": args.command,
            "base": args.base,
            "runs": [
                {"name": name, "build": result.get("build", ""), "seed": result.get("seed")}
                for name, result in runs
            ],
            "rows": rows,
        }
        traces = trace_summaries(args.directory)
        if traces:
            doc["traces"] = traces
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
