"""Tables from benchmark rows: the plain one layer_bench prints last, and the README's markdown.

Cells read ``p50 µs (p50 / floor)``, in the printed table followed by the spread p90/p10; a variant
that did not run shows its status. Rows of the two modes (flushed, serving) are tabled separately, and
so are rows of the two weight formats (bf16, fp8). A model with a published number of another system
(:data:`moe_bench.shapes.ANCHORS`, e.g. DeepGEMM's Mega MoE for ``dsv4-flash``) gets an anchor column in
its format's tables: the published latency at that token count and the EP size it was measured at, and
flashmoe's latency over it only where a rank holds as many experts as the anchor's ranks did.
"""

from __future__ import annotations

from collections import defaultdict

from .shapes import ANCHORS

VARIANTS = (
    "flashmoe",
    "all_to_all",
    "allgather_rs",
    "vllm_fused",
    "deepep_ll",
    "deepep_ll_fp8",
    "deepep_ll_comm",
    "compute_only",
)
BASELINES = ("all_to_all", "allgather_rs", "vllm_fused", "deepep_ll", "deepep_ll_fp8")
DECODE_MAX_TOKENS = 128  # tokens per rank up to here count as decode, from PREFILL_MIN_TOKENS as prefill
PREFILL_MIN_TOKENS = 512


def mode_of(row: dict) -> str:
    return row.get("mode") or "flushed"  # files from before serving mode hold flushed rows only


def dtype_of(row: dict) -> str:
    return row.get("dtype") or "bf16"  # files from before --dtype hold bf16 rows only


def by_case(rows: list[dict], mode: str = "flushed", dtype: str = "bf16") -> dict[tuple, dict[str, dict]]:
    """{(model, routing, tokens_per_rank): {variant: row}} of one mode and weight format, in first-seen order."""
    cases: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        if mode_of(r) == mode and dtype_of(r) == dtype:
            cases[(r["model"], r["routing"], r["tokens_per_rank"])][r["variant"]] = r
    return cases


def modes(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(mode_of(r) for r in rows))


def dtypes(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(dtype_of(r) for r in rows))


def _anchor_for(model: str, dtype: str):
    a = ANCHORS.get(model)
    return a if a is not None and a.dtype == dtype else None


def anchor_cell(model: str, tokens: int, variants: dict[str, dict], dtype: str, times: str = "x") -> str:
    """The published latency at this token count and its EP size; with flashmoe's ratio to it only where a
    rank does the anchor's per-rank work (same experts per rank: the anchor's EP, or world 1 with
    ``--per-rank-of-ep`` at it)."""
    a = _anchor_for(model, dtype)
    lat = a.latency_us.get(tokens) if a else None
    if lat is None:
        return "-"
    cell = f"{lat:.0f} (EP{a.ep})"
    fm = variants.get("flashmoe")
    if (
        fm
        and fm["status"] == "ok"
        and fm["backend"] == "megakernel"
        and a.comparable(fm["num_experts"], fm["world_size"], dtype)
    ):
        cell += f" flashmoe {fm['latency_us'] / lat:.2f}{times}"
    return cell


def anchor_lines(models, dtype: str) -> list[str]:
    """One line per anchor shown for ``models``: what it is, and when a ratio is printed."""
    lines = []
    for model in dict.fromkeys(models):
        a = _anchor_for(model, dtype)
        if a:
            lines.append(
                f"anchor for {model}: {a.label} ({a.source}), µs per layer at "
                + ", ".join(f"{t}: {v:g}" for t, v in sorted(a.latency_us.items()))
                + f" tokens per rank; a rank there holds {a.experts_per_rank:g} experts. flashmoe's ratio to it is "
                f"shown only where a rank holds as many (EP{a.ep}, or world 1 with --per-rank-of-ep {a.ep}, which "
                "moves no tokens between GPUs); at other EP sizes compare x floor (see benchmarks/README.md)"
            )
    return lines


def _groups(rows: list[dict]) -> list[tuple[str, str]]:
    """(mode, dtype) pairs present, modes first."""
    present = {(mode_of(r), dtype_of(r)) for r in rows}
    return [(m, d) for m in modes(rows) for d in dtypes(rows) if (m, d) in present]


def spread(row: dict) -> float | None:
    """p90 / p10 of the slowest rank's calls."""
    p10, p90 = row.get("latency_p10_us"), row.get("latency_p90_us")
    return p90 / p10 if p10 and p90 is not None else None


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row["status"] != "ok":
        return row["status"]
    return f"{row['latency_us']:.1f} ({row['x_floor']:.2f}x)"


def _floor_cell(variants: dict[str, dict]) -> str:
    any_row = next(iter(variants.values()))
    if any_row["floor_us"] is None:
        return "-"
    return f"{any_row['floor_us']:.1f} {any_row['bound']}"


def _spread_cell(row: dict | None) -> str:
    cell = _cell(row)
    s = spread(row) if row and row["status"] == "ok" else None
    return f"{cell} {s:.2f}" if s is not None else cell


def _aligned(lines: list[list[str]], left: int) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join(
            c.rjust(w) if i >= left else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in lines
    )


def text_table(rows: list[dict], expert_gemm: str | None = None) -> str:
    """One table per mode and weight format; cells: p50 µs (x floor) and p90/p10. ``expert_gemm``: the fp8
    baselines' expert stage, named in the fp8 tables' titles."""
    parts = []
    for mode, dtype in _groups(rows):
        cases = by_case(rows, mode, dtype)
        present = [v for v in VARIANTS if any(v in c for c in cases.values())]
        layers = sorted({r["layers"] for c in cases.values() for r in c.values() if r.get("layers")})
        title = f"{mode}" + (
            f" (per layer of a {'/'.join(map(str, layers))}-layer step)" if mode == "serving" else ""
        )
        if dtype != "bf16":
            title += f" · {dtype} weights" + (
                f" · baselines' expert GEMM: {expert_gemm}" if expert_gemm else ""
            )
        anchored = [m for m, _, _ in cases if _anchor_for(m, dtype)]
        header = (
            ["model", "routing", "T/rank", "floor us"]
            + (["anchor us"] if anchored else [])
            + [f"{v} p50 us (x floor) p90/p10" for v in present]
        )
        lines = [header]
        for (model, routing, tokens), variants in cases.items():
            lines.append(
                [model, routing, str(tokens), _floor_cell(variants)]
                + ([anchor_cell(model, tokens, variants, dtype)] if anchored else [])
                + [_spread_cell(variants.get(v)) for v in present]
            )
        notes = "".join(f"\n  {line}" for line in anchor_lines(anchored, dtype))
        parts.append(f"[{title}]\n" + _aligned(lines, 2) + notes)
    compute = compute_text_table(rows)
    if compute:
        parts.append(compute)
    return "\n\n".join(parts)


def _tflops(row: dict | None) -> float | None:
    return row["tflops"] if row and row["status"] == "ok" and row.get("tflops") else None


def compute_text_table(rows: list[dict]) -> str:
    """Achieved TFLOP/s of the expert GEMMs at world 1 (flashmoe's dispatch and combine are local
    copies there): flashmoe against compute_only on the same rows, per mode and case; empty when no
    world-1 case has both."""
    lines = [
        [
            "mode",
            "dtype",
            "model",
            "routing",
            "T/rank",
            "rows",
            "flashmoe TFLOP/s",
            "compute_only TFLOP/s",
            "ratio",
        ]
    ]
    for mode, dtype in _groups(rows):
        for (model, routing, tokens), variants in by_case(rows, mode, dtype).items():
            fm, co = variants.get("flashmoe"), variants.get("compute_only")
            if _tflops(fm) is None or _tflops(co) is None or fm["world_size"] != 1:
                continue
            lines.append(
                [
                    mode,
                    dtype,
                    model,
                    routing,
                    str(tokens),
                    f"{fm['gemm_rows']:.0f}",
                    _rate(fm["tflops"]),
                    _rate(co["tflops"]),
                    f"{fm['tflops_vs_compute_only']:.2f}x",
                ]
            )
    if len(lines) == 1:
        return ""
    return "[world 1: expert GEMM throughput, 6·rows·H·I flops per layer]\n" + _aligned(lines, 4)


def speedup(variants: dict[str, dict], baseline: str) -> float | None:
    fm, base = variants.get("flashmoe"), variants.get(baseline)
    if not fm or not base or fm["status"] != "ok" or base["status"] != "ok" or fm["backend"] != "megakernel":
        return None
    return base["latency_us"] / fm["latency_us"]


SHORT = {
    "all_to_all": "a2a",
    "allgather_rs": "ag-rs",
    "vllm_fused": "vllm",
    "deepep_ll": "deepep",
    "deepep_ll_fp8": "deepep-fp8",
}


def _rate(tflops: float) -> str:
    return f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.3g}"  # CPU smoke runs reach milli-TFLOP/s


def markdown_table(
    rows: list[dict],
    tokens=(1, 128, 4096),
    routing: str = "uniform",
    mode: str = "flushed",
    dtype: str = "bf16",
) -> str:
    cases = {c: v for c, v in by_case(rows, mode, dtype).items() if c[1] == routing and c[2] in tokens}
    if not cases:
        return ""
    anchored = any(_anchor_for(m, dtype) for m, _, _ in cases)
    baselines = [b for b in BASELINES if any(b in v for v in cases.values())]
    if not baselines:
        baselines = ["all_to_all", "allgather_rs"]
    # Parts of a layer, not layers: the GEMMs alone, and DeepEP's dispatch + combine alone (where run).
    parts = ["compute_only"] + [p for p in ("deepep_ll_comm",) if any(p in v for v in cases.values())]
    out = [
        "| model | T/rank | floor µs (bound) | "
        + ("anchor µs | " if anchored else "")
        + "flashmoe µs (×floor) | "
        + " | ".join(f"{b} µs (×floor)" for b in baselines)
        + "".join(f" | {p} µs" for p in parts)
        + " | flashmoe speedup vs "
        + " / ".join(SHORT[b] for b in baselines)
        + " |",
        "| --- | ---: | ---: | "
        + ("---: | " if anchored else "")
        + "---: | "
        + "---: | " * (len(baselines) + len(parts))
        + "---: |",
    ]
    for (model, _, t), variants in cases.items():
        part_cells = "".join(f" | {_latency_cell(variants.get(p))}" for p in parts)
        sp = [speedup(variants, b) for b in baselines]
        sp_cell = " / ".join(f"{s:.2f}×" if s else "-" for s in sp)
        cells = [_cell(variants.get(v)).replace("x)", "×)") for v in ("flashmoe", *baselines)]
        anchor = f"{anchor_cell(model, t, variants, dtype, '×')} | " if anchored else ""
        out.append(
            f"| {model} | {t} | {_floor_cell(variants)} | {anchor}"
            + " | ".join(cells)
            + f"{part_cells} | {sp_cell} |"
        )
    return "\n".join(out)


def _latency_cell(row: dict | None) -> str:
    if row is None:
        return "-"
    return f"{row['latency_us']:.1f}" if row["status"] == "ok" else row["status"]


def compute_markdown_table(
    rows: list[dict], mode: str = "serving", gemm: str = "torch._grouped_mm", dtype: str = "bf16"
) -> str:
    """Expert GEMM TFLOP/s of flashmoe and compute_only (``gemm``) on the same rows (world-1 runs);
    empty if none."""
    out = [
        f"| model | T/rank | routing | rows | flashmoe TFLOP/s | {gemm} TFLOP/s | flashmoe / {gemm} |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for (model, routing, t), variants in by_case(rows, mode, dtype).items():
        fm, co = variants.get("flashmoe"), variants.get("compute_only")
        if _tflops(fm) is None or _tflops(co) is None or fm["world_size"] != 1:
            continue
        out.append(
            f"| {model} | {t} | {routing} | {fm['gemm_rows']:.0f} | {_rate(fm['tflops'])} | {_rate(co['tflops'])} | "
            f"{fm['tflops_vs_compute_only']:.2f}× |"
        )
    return "\n".join(out) if len(out) > 2 else ""


def target_lines(rows: list[dict], routing: str = "uniform") -> list[str]:
    """Where flashmoe stands against the issue's targets, per model (worst case over the sizes)."""
    lines = []
    cases = by_case(rows, "flushed")
    for model in dict.fromkeys(m for m, _, _ in cases):
        mine = {t: v for (m, rt, t), v in cases.items() if m == model and rt == routing}
        parts = []
        for t in (128, 4096):
            fm = mine.get(t, {}).get("flashmoe")
            if fm and fm["status"] == "ok" and fm["backend"] == "megakernel":
                parts.append(f"{fm['x_floor']:.2f}× floor at {t} (target ≤ 1.3×)")
        for baseline, label, sizes, goal in (
            ("all_to_all", "all_to_all, decode", [t for t in mine if t <= DECODE_MAX_TOKENS], 3.0),
            ("all_to_all", "all_to_all, prefill", [t for t in mine if t >= PREFILL_MIN_TOKENS], 1.5),
            ("allgather_rs", "allgather_rs, decode", [t for t in mine if t <= DECODE_MAX_TOKENS], 2.0),
        ):
            got = [(speedup(mine[t], baseline), t) for t in sizes]
            got = [(s, t) for s, t in got if s is not None]
            if got:
                worst, at = min(got)
                parts.append(f"vs {label}: worst {worst:.2f}× at T={at} (target ≥ {goal:g}×)")
        lines.append(f"- **{model}**: " + ("; ".join(parts) if parts else "no megakernel rows"))
    return lines


def metrics_overhead_lines(rows: list[dict], dtype: str = "bf16") -> list[str]:
    """The in-kernel metrics' cost (``--metrics-overhead`` rows), per model: median and worst case."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        got = sorted(
            (r["metrics_overhead"], r["tokens_per_rank"], r["routing"])
            for r in rows
            if r["model"] == model
            and r.get("metrics_overhead") is not None
            and mode_of(r) == "flushed"
            and dtype_of(r) == dtype
        )
        if got:
            median = got[len(got) // 2][0]
            worst = got[-1]
            lines.append(
                f"- **{model}**: median {median * 100:+.2f}% of layer time over {len(got)} cases; "
                f"largest {worst[0] * 100:+.2f}% (T={worst[1]}, {worst[2]}) (goal < 1%)"
            )
    return lines
