"""Where the megakernel's warps stall, per function and per source line, from an ncu source-page export.

On the GPU machine (the device build's SASS must be the one profiled: its NVSHMEM is not this machine's):

    ncu --clock-control none --cache-control none -k regex:moe_layer_kernel --launch-skip 10 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats -o prof python scripts/kernel_check.py --time-only ...
    ncu -i prof.ncu-rep --page source --csv --print-source sass > prof-sass.csv
    cuobjdump -xelf all $FLASHMOE_CACHE_DIR/default-sm_90a-*/kernel.o && \\
        nvdisasm --print-line-info -c kernel.sm_90a.cubin > device.sass

Then, anywhere:

    python benchmarks/experiments/ncu_stalls.py prof-sass.csv --sass device.sass [--function mma_fp8] [--json F]
    python benchmarks/experiments/ncu_stalls.py main-sass.csv --sass main.sass \\
        --against branch-sass.csv --against-sass branch.sass     # what moved between two builds

The CSV holds one table per device function ("Kernel Name" row, then a header row, then one row per SASS
instruction with its warp-stall samples in total and per reason). Samples are taken per SM sub-partition at a
fixed interval from whichever warp is resident, so a function's samples are its share of warp time; idle warps
waiting at a barrier count too (``stall_barrier``), which is why the table also shows the share without them.
Instructions are grouped by how often they ran: in a persistent kernel that separates per-call code (run once
per block), per-tile code and the K loop. ``--sass`` maps each instruction to its CUDA line (nvdisasm's line
info), matched by position and checked by opcode.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import re
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def load_functions(path: Path) -> dict[str, list[dict]]:
    """{function name: one dict per SASS instruction, in address order} from ncu's source-page CSV."""
    functions: dict[str, list[dict]] = {}
    name, header = None, None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                name, header = row[1], None
                functions[name] = []
            elif row[0] == "Address":
                header = row
            elif name is not None and header is not None:
                functions[name].append(dict(zip(header, row, strict=False)))
    return functions


def stall_reasons(row: dict) -> list[str]:
    return [k for k in row if k.startswith("stall_") and "(Not Issued)" not in k]


def sass_line_info(path: Path) -> dict[str, list[tuple[str | None, str]]]:
    """{mangled function: [(file:line or None, instruction text)]} from ``nvdisasm --print-line-info``."""
    out: dict[str, list[tuple[str | None, str]]] = {}
    current, line = None, None
    for text in Path(path).read_text().splitlines():
        if text.startswith(".text."):
            current, line = text[len(".text.") :].rstrip(":"), None
            out[current] = []
            continue
        if current is None:
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', text)
        if m:
            line = f"{Path(m.group(1)).name}:{m.group(2)}"
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", text)
        if m:
            out[current].append((line, m.group(1)))
    return out


def opcode(instruction: str) -> str:
    """The opcode of a SASS instruction, without its predicate (``@!P0 BRA x`` -> ``BRA``)."""
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def match_sass(rows: list[dict], sass: dict[str, list[tuple[str | None, str]]]) -> list[str | None] | None:
    """The CUDA line of each profiled instruction: the disassembled function with the same instruction count
    and opcodes, or None when none matches (another build)."""
    for instructions in sass.values():
        if len(instructions) != len(rows):
            continue
        if all(opcode(r["Source"]) == opcode(t) for r, (_, t) in zip(rows, instructions, strict=True)):
            return [ln for ln, _ in instructions]
    return None


def summarize(rows: list[dict], lines: list[str | None] | None, top: int = 12) -> dict:
    """A function's samples: by reason, by execution count (per-call / per-tile / loop code), by line."""
    reasons = stall_reasons(rows[0]) if rows else []
    total = sum(number(r[SAMPLES]) for r in rows)
    by_reason = collections.Counter()
    by_count: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    by_line: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for i, r in enumerate(rows):
        samples = number(r[SAMPLES])
        executed = int(number(r[EXECUTED]))
        by_count[executed]["instructions"] += 1
        by_count[executed]["samples"] += samples
        line = (lines[i] if lines else None) or "?"
        by_line[line]["samples"] += samples
        by_line[line]["executed"] = max(by_line[line]["executed"], executed)
        for k in reasons:
            v = number(r[k])
            by_reason[k[len("stall_") :]] += v
            by_count[executed][k[len("stall_") :]] += v
            by_line[line][k[len("stall_") :]] += v

    def reasons_of(c: collections.Counter, n: int = 3) -> dict:
        return dict(
            sorted(
                ((k, int(v)) for k, v in c.items() if k not in ("instructions", "samples", "executed") and v),
                key=lambda kv: -kv[1],
            )[:n]
        )

    return {
        "samples": int(total),
        "samples_without_barrier": int(total - by_reason.get("barrier", 0)),
        "by_reason": reasons_of(by_reason, 8),
        "by_execution_count": [
            {
                "executed": e,
                "instructions": c["instructions"],
                "samples": int(c["samples"]),
                "top": reasons_of(c),
            }
            for e, c in sorted(by_count.items(), key=lambda kv: -kv[1]["samples"])
            if c["samples"]
        ][:top],
        "by_line": [
            {"line": ln, "executed": int(c["executed"]), "samples": int(c["samples"]), "top": reasons_of(c)}
            for ln, c in sorted(by_line.items(), key=lambda kv: -kv[1]["samples"])
            if c["samples"]
        ][:top]
        if lines
        else [],
    }


def report(csv_path: Path, sass_path: Path | None, only: str | None = None, top: int = 12) -> dict:
    """Every sampled function of an export, summarised (:func:`summarize`, ``top`` rows per table)."""
    functions = load_functions(csv_path)
    sass = sass_line_info(sass_path) if sass_path else {}
    grand = sum(number(r[SAMPLES]) for rows in functions.values() for r in rows)
    out = {"csv": str(csv_path), "samples": int(grand), "functions": {}}
    for name, rows in functions.items():
        if only and only not in name:
            continue
        if not rows or not sum(number(r[SAMPLES]) for r in rows):
            continue
        lines = match_sass(rows, sass) if sass else None
        s = summarize(rows, lines, top)
        s["share"] = round(s["samples"] / grand, 4) if grand else 0.0
        s["lines_matched"] = lines is not None
        out["functions"][name] = s
    return out


def short_name(function: str) -> str:
    """A device function's name without its parameter list (ncu prints the whole signature)."""
    return re.sub(r"\(const .*|\(flashmoe::Params\)", "", function)


def print_report(rep: dict) -> None:
    print(f"{rep['csv']}: {rep['samples']} samples")
    for name, s in rep["functions"].items():
        short = short_name(name)
        print(
            f"\n{s['share'] * 100:5.1f}%  {short}  ({s['samples']} samples, {s['samples_without_barrier']} not at a barrier)"
        )
        print("   by reason: " + ", ".join(f"{k} {v}" for k, v in s["by_reason"].items()))
        for c in s["by_execution_count"][:5]:
            top = ", ".join(f"{k} {v}" for k, v in c["top"].items())
            print(
                f"   ran {c['executed']:8d}x: {c['instructions']:4d} instructions, {c['samples']:5d} samples ({top})"
            )
        for c in s["by_line"][:8]:
            top = ", ".join(f"{k} {v}" for k, v in c["top"].items())
            print(f"     {c['line']:32s} ran {c['executed']:8d}x {c['samples']:5d} samples ({top})")


def compare(a: dict, b: dict, top: int = 10) -> dict:
    """Two reports of the same kernel (e.g. main and a branch, one launch each): per function, the samples and
    their reasons in each and the difference; per CUDA line, the lines whose samples changed most. Lines are
    matched by file:line, so a line-shifting edit in a file makes its lines incomparable (functions still are)."""
    out = {"samples": [a["samples"], b["samples"]], "functions": {}}
    for name in [n for n in a["functions"] if n in b["functions"]]:
        fa, fb = a["functions"][name], b["functions"][name]
        reasons = sorted(set(fa["by_reason"]) | set(fb["by_reason"]))
        lines_a = {c["line"]: c["samples"] for c in fa["by_line"]}
        lines_b = {c["line"]: c["samples"] for c in fb["by_line"]}
        deltas = {ln: lines_b.get(ln, 0) - lines_a.get(ln, 0) for ln in set(lines_a) | set(lines_b)}
        out["functions"][name] = {
            "samples": [fa["samples"], fb["samples"]],
            "samples_without_barrier": [fa["samples_without_barrier"], fb["samples_without_barrier"]],
            "by_reason": {r: [fa["by_reason"].get(r, 0), fb["by_reason"].get(r, 0)] for r in reasons},
            "lines_changed": [
                {"line": ln, "samples": [lines_a.get(ln, 0), lines_b.get(ln, 0)], "delta": d}
                for ln, d in sorted(deltas.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:top]
                if d
            ],
        }
    return out


def print_compare(cmp: dict) -> None:
    print(f"samples: {cmp['samples'][0]} -> {cmp['samples'][1]}")
    for name, f in cmp["functions"].items():
        short = short_name(name)
        (a, b), (na, nb) = f["samples"], f["samples_without_barrier"]
        print(f"\n{short}: {a} -> {b} samples ({na} -> {nb} not at a barrier)")
        moved = sorted(f["by_reason"].items(), key=lambda kv: -abs(kv[1][1] - kv[1][0]))[:4]
        print("   reasons: " + ", ".join(f"{r} {x} -> {y}" for r, (x, y) in moved if x != y))
        for c in f["lines_changed"][:6]:
            print(f"     {c['line']:32s} {c['samples'][0]:5d} -> {c['samples'][1]:5d}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", type=Path, help="ncu -i REP --page source --csv --print-source sass")
    ap.add_argument(
        "--sass", type=Path, default=None, help="nvdisasm --print-line-info of the profiled build"
    )
    ap.add_argument("--function", default=None, help="only functions whose name contains this")
    ap.add_argument(
        "--against", type=Path, default=None, help="a second export (e.g. a branch's): compare the two"
    )
    ap.add_argument(
        "--against-sass", type=Path, default=None, help="nvdisasm line info of the --against build"
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.against is not None:  # every line of both, so a line outside one side's top rows still compares
        every = 1 << 30
        rep = compare(
            report(args.csv, args.sass, args.function, every),
            report(args.against, args.against_sass, args.function, every),
        )
        print_compare(rep)
    else:
        rep = report(args.csv, args.sass, args.function)
        print_report(rep)
    if args.json:
        args.json.write_text(json.dumps(rep, indent=1) + "\n")


if __name__ == "__main__":
    main()
