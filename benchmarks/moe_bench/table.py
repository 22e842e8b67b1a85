"""Tables from benchmark rows: the plain one layer_bench prints last, and the README's markdown.

Cells read ``latency µs (latency / floor)``; a variant that did not run shows its status.
"""

from __future__ import annotations

from collections import defaultdict

VARIANTS = ("flashmoe", "all_to_all", "allgather_rs", "compute_only")
DECODE_MAX_TOKENS = 128  # tokens per rank up to here count as decode, from PREFILL_MIN_TOKENS as prefill
PREFILL_MIN_TOKENS = 512


def by_case(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """{(model, routing, tokens_per_rank): {variant: row}} in first-seen order."""
    cases: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        cases[(r["model"], r["routing"], r["tokens_per_rank"])][r["variant"]] = r
    return cases


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


def text_table(rows: list[dict]) -> str:
    cases = by_case(rows)
    present = [v for v in VARIANTS if any(v in c for c in cases.values())]
    header = ["model", "routing", "T/rank", "floor us"] + [f"{v} us (x floor)" for v in present]
    lines = [header]
    for (model, routing, tokens), variants in cases.items():
        lines.append(
            [model, routing, str(tokens), _floor_cell(variants)] + [_cell(variants.get(v)) for v in present]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in lines
    )


def speedup(variants: dict[str, dict], baseline: str) -> float | None:
    fm, base = variants.get("flashmoe"), variants.get(baseline)
    if not fm or not base or fm["status"] != "ok" or base["status"] != "ok" or fm["backend"] != "megakernel":
        return None
    return base["latency_us"] / fm["latency_us"]


def markdown_table(rows: list[dict], tokens=(1, 128, 4096), routing: str = "uniform") -> str:
    out = [
        "| model | T/rank | floor µs (bound) | flashmoe µs (×floor) | all_to_all µs (×floor) | allgather_rs µs (×floor) | compute_only µs | flashmoe speedup vs a2a / ag-rs |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (model, rt, t), variants in by_case(rows).items():
        if rt != routing or t not in tokens:
            continue
        co = variants.get("compute_only")
        co_cell = f"{co['latency_us']:.1f}" if co and co["status"] == "ok" else (co["status"] if co else "-")
        sp = [speedup(variants, b) for b in ("all_to_all", "allgather_rs")]
        sp_cell = " / ".join(f"{s:.2f}×" if s else "-" for s in sp)
        cells = [
            _cell(variants.get(v)).replace("x)", "×)") for v in ("flashmoe", "all_to_all", "allgather_rs")
        ]
        out.append(
            f"| {model} | {t} | {_floor_cell(variants)} | "
            + " | ".join(cells)
            + f" | {co_cell} | {sp_cell} |"
        )
    return "\n".join(out)


def target_lines(rows: list[dict], routing: str = "uniform") -> list[str]:
    """Where flashmoe stands against the issue's targets, per model (worst case over the sizes)."""
    lines = []
    cases = by_case(rows)
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


def metrics_overhead_lines(rows: list[dict]) -> list[str]:
    """The in-kernel metrics' cost (``--metrics-overhead`` rows), per model: median and worst case."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        got = sorted(
            (r["metrics_overhead"], r["tokens_per_rank"], r["routing"])
            for r in rows
            if r["model"] == model and r.get("metrics_overhead") is not None
        )
        if got:
            median = got[len(got) // 2][0]
            worst = got[-1]
            lines.append(
                f"- **{model}**: median {median * 100:+.2f}% of layer time over {len(got)} cases; "
                f"largest {worst[0] * 100:+.2f}% (T={worst[1]}, {worst[2]}) (goal < 1%)"
            )
    return lines
