"""One GPU, world 1: a tile-level timeline of one megakernel launch per token count (the trace build).

    python scripts/kernel_trace.py --shape qwen3-30b/ep4 --tokens 1,8,128,4096 --out /tmp/trace.json
    torchrun --nproc-per-node 4 scripts/kernel_trace.py --tokens 8 --out /tmp/trace.json   # EP4: one JSON per rank
    python scripts/kernel_trace.py --reanalyse /tmp/trace.json   # a --raw trace printed again, no GPU needed

`--dtype fp8` traces the block-fp8 kernel (e4m3 weights with 128 x 128 block scales) the same way.

Builds and loads the `trace` variant (FLASHMOE_TRACE=1, csrc/flashmoe/trace.cuh): thread 0 of every block
records its phase boundaries and, as the GEMM producer, each task it takes, when the task's rows were located
(GEMM1: its expert's GEMM0 tiles counted), when its first and last stage were issued and how long it waited
for free stages; each consumer warpgroup's leader records each task, when its first stage landed, when its
mainloop finished (with the time spent waiting for stages), when its sums were staged, (GEMM1) when its rows'
destinations were known, when the rows were stored and counted, and when its epilogue finished.

Under torchrun (WORLD_SIZE > 1) the layer is expert-parallel over all ranks with the shape's per-rank expert
count on each rank (so `qwen3-30b/ep4` on 4 GPUs is the real Qwen3-30B layer), every rank traces its own
launch, writes `<out>.rank<r>.json`, and rank 0 prints; the output is not checked there (the correctness
matrix covers EP). Each launch reads weights no earlier launch of the run touched recently (several weight sets, rotated), so the
traced launch streams from HBM as in serving. The traced launch is checked against the same-rounding
reference. Printed per token count: the phase ends over blocks, and per kind of tile (GEMM, token width)
the median time of each part of a tile and the bytes per SM per microsecond it streamed, then the streaming
timeline (per 2 us: weight bytes issued and how many SMs were issuing GEMM0 and GEMM1 tiles), and per pair of
consecutive tiles of a consumer (`handover gemmA->gemmB`) where the time from one tile's last wgmma to the next
one's first landed stage went, on the consumer's side and on the producer's; with --raw the
JSON keeps every event. The trace build reads timers around every pipeline wait, so its times are a little
longer than the plain build's; compare parts within one trace, and totals with kernel_check.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from flashmoe.reference import moe_reference  # noqa: E402
from flashmoe.reference_fp8 import moe_reference_fp8  # noqa: E402
from kernel_check import SHAPES, draw_layer, l2_bytes, layer, routing  # noqa: E402
from moe_inputs import random_grouped_hidden  # noqa: E402
from tolerances import error_stats, within_kernel_budgets  # noqa: E402

# Event kinds (csrc/flashmoe/trace.cuh).
PHASES = {
    0: "start",
    1: "dispatch",
    2: "barrier1",
    3: "receive_wait",
    4: "receive",
    5: "barrier2",
    6: "gemm_start",
    7: "gemm",
    8: "gemm_counted",
    9: "combine_wait",
    10: "end",
}
PRODUCER_TASK, PRODUCER_READY, PRODUCER_FIRST, PRODUCER_LAST = 20, 21, 22, 23
PRODUCER_SLOT_FREE, PRODUCER_INDEX = 24, 25
PRODUCER_PUBLISHED, PRODUCER_DECODING, PRODUCER_ROWS_LOCATED, PRODUCER_FIRST_SLOT = 26, 27, 28, 29
CONSUMER_TASK, CONSUMER_FIRST_FULL, CONSUMER_MMA, CONSUMER_EPILOGUE = 30, 31, 32, 33
CONSUMER_SLOT_READ, CONSUMER_COUNTED = 34, 35
CONSUMER_STAGED, CONSUMER_PLACED, CONSUMER_STORED = 36, 37, 38
TILE_WEIGHT_ROWS = 128
KIND_NAMES = {
    PRODUCER_TASK: "task",
    PRODUCER_READY: "rows_ready",
    PRODUCER_FIRST: "first_issue",
    PRODUCER_LAST: "last_issue",
    PRODUCER_SLOT_FREE: "slot_free",
    PRODUCER_INDEX: "index_known",
    PRODUCER_PUBLISHED: "published",
    PRODUCER_DECODING: "decoding",
    PRODUCER_ROWS_LOCATED: "rows_located",
    PRODUCER_FIRST_SLOT: "first_slot",
    CONSUMER_TASK: "task",
    CONSUMER_MMA: "mainloop_done",
    CONSUMER_EPILOGUE: "epilogue_done",
    CONSUMER_SLOT_READ: "slot_read",
    CONSUMER_COUNTED: "counted",
    CONSUMER_STAGED: "staged",
    CONSUMER_PLACED: "placed",
    CONSUMER_STORED: "stored",
}
ROLES = ("thread0", "consumer0", "consumer1")


def decode(counts: torch.Tensor, events: torch.Tensor, blocks: int) -> list[list[list[tuple]]]:
    """[block][role] -> [(global_ns, clock, kind, a, b, c)] of the last launch."""
    out = []
    for blk in range(blocks):
        roles = []
        for role in range(counts.shape[1]):
            n = int(counts[blk, role])
            ev = events[blk, role, :n].tolist()
            roles.append(
                [
                    (g, c, w0 & 0xFFFFFFFF, w0 >> 32 & 0xFFFFFFFF, w1 & 0xFFFFFFFF, w1 >> 32 & 0xFFFFFFFF)
                    for g, c, w0, w1 in ev
                ]
            )
        out.append(roles)
    return out


def clock_rate(lists: list[list[tuple]]) -> tuple[float, int, int]:
    """(cycles per ns, clock, ns) of a block: a straight line through its first and last events."""
    ev = sorted((e for role in lists for e in role if e[2] != CONSUMER_FIRST_FULL), key=lambda e: e[1])
    if len(ev) < 2 or ev[-1][0] == ev[0][0]:
        return 1.98, ev[0][1] if ev else 0, ev[0][0] if ev else 0
    return (ev[-1][1] - ev[0][1]) / (ev[-1][0] - ev[0][0]), ev[0][1], ev[0][0]


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def tile_weight_bytes(gemm: int, H: int, I: int, fp8: bool, splits: int = 1, boxes: int = 1) -> int:
    """Weight bytes one task streams: 128 rows of K (GEMM0: H, GEMM1: I) per box, over its share of a split tile. An
    fp8 GEMM0 task is two passes of 128 one-byte rows (its 128 features' gate and up rows), the bytes of a bf16 one; a
    wide bf16 task (gemm.cuh) streams two boxes a stage."""
    if gemm == 0:
        return boxes * TILE_WEIGHT_ROWS * H * 2 // splits
    return boxes * TILE_WEIGHT_ROWS * I * (1 if fp8 else 2)


def wide_gemms(producer: list[dict], H: int, I: int, fp8: bool) -> set[int]:
    """The GEMMs whose tasks were wide (bf16 prefill, scheduler.cuh wide_call): the trace does not flag them, but a
    call runs every feature tile of each GEMM, and wide ones are twice as wide (GEMM0 128 features, GEMM1 256)."""
    if fp8:
        return set()
    narrow = {0: I // 64, 1: H // 128}
    wide = set()
    for gemm, tiles in narrow.items():
        seen = [p["feature_tile"] for p in producer if p["gemm"] == gemm]
        if seen and tiles % 2 == 0 and max(seen) + 1 == tiles // 2:
            wide.add(gemm)
    return wide


def streaming_timeline(producer: list[dict], H: int, I: int, fp8: bool, bin_us: float = 2.0) -> list[dict]:
    """Per `bin_us` of the launch: the weight bytes the producers issued (each task's bytes spread evenly over its
    first-to-last stage issue; TMA requests, so a stage lands some microseconds later) as TB/s, and how many SMs
    were issuing GEMM0 and GEMM1 tiles (fractions of a bin count). Shows where the GEMM phase streams at HBM rate
    and where few SMs stream: a partial last wave, short tasks whose set-up outlasts their issue. A GEMM1 tile that
    waits for its rows requests its first stage's weights and prefetches the rest into L2 at its first slot, before
    the first issue counted here, so where GEMM1 tiles wait (a decode call's hand-over from GEMM0) HBM is busier
    than these bins show (fp8 T = 8, 2026-11-24: 84 tiles, ~8 MiB, in a 4 us "dip")."""
    bins: dict[int, list[float]] = {}
    for p in producer:
        if "first_issue" not in p:
            continue
        start = p["first_issue"]
        end = max(p.get("last_issue", start), start + 1e-3)
        size = tile_weight_bytes(p["gemm"], H, I, fp8, p["splits"], p.get("boxes", 1))
        i = int(start // bin_us)
        while i * bin_us < end:
            lo, hi = max(start, i * bin_us), min(end, (i + 1) * bin_us)
            row = bins.setdefault(i, [0.0, 0.0, 0.0])
            row[0] += size * (hi - lo) / (end - start)
            row[1 + p["gemm"]] += (hi - lo) / bin_us
            i += 1
    return [
        {
            "t_us": round(i * bin_us, 2),
            "tb_per_s": round(b / bin_us / 1e6, 3),
            "sms_issuing": [round(g0, 1), round(g1, 1)],
        }
        for i, (b, g0, g1) in sorted(bins.items())
    ]


# per_sm_rates' bins: "full" where at least FULL_WAVE_SMS SMs issue, "sparse" where MIN_SPARSE_SMS to FEW_SMS - 1 do.
FULL_WAVE_SMS, FEW_SMS, MIN_SPARSE_SMS = 120, 100, 8


def per_sm_rates(timeline: list[dict]) -> dict:
    """Weight GB/s per issuing SM, median over the timeline's full-wave bins and over its sparse bins (a bin with
    under MIN_SPARSE_SMS issuing SMs says little). If the rate where few SMs issue is no higher
    than where all do, something per SM bounds the stream, not HBM: a partial wave then streams at (its SMs x that
    rate) however idle HBM is."""

    def rate(b):
        return b["tb_per_s"] * 1e3 / sum(b["sms_issuing"])

    busy = [rate(b) for b in timeline if sum(b["sms_issuing"]) >= FULL_WAVE_SMS]
    sparse = [rate(b) for b in timeline if MIN_SPARSE_SMS <= sum(b["sms_issuing"]) < FEW_SMS]
    return {
        "full_gb_per_s_per_sm": round(median(busy), 1) if busy else None,
        "full_bins": len(busy),
        "sparse_gb_per_s_per_sm": round(median(sparse), 1) if sparse else None,
        "sparse_bins": len(sparse),
    }


def handovers(by_consumer: dict[tuple[int, int], list[dict]], producer: list[dict]) -> dict[str, dict]:
    """Per pair of GEMMs (tile i -> the consumer's next tile j, same block and consumer warpgroup: `by_consumer`'s
    lists, in the order each consumer took its tiles), the medians of where the time between tile i's last wgmma
    and tile j's first landed stage goes: the consumer's epilogue steps (the events it records: staged, placed,
    stored, counted, epilogue_done) and the producer's way to tile j's first stage (from its last issue of tile i:
    the task, its rows located, the first slot free, the first issue), with the first issue and the first stage's
    landing measured from tile i's mainloop end."""
    by_task = {(p["block"], p["index"]): p for p in producer}
    steps = ("mma_done", "staged", "placed", "stored", "counted", "epilogue_done")
    parts: dict[str, dict[str, list[float]]] = {}
    counts: dict[str, int] = {}
    for (blk, _), lst in by_consumer.items():
        for prev, t in zip(lst, lst[1:], strict=False):
            if prev.get("gemm") is None or t.get("gemm") is None or "mma_done" not in prev:
                continue
            key = f"gemm{prev['gemm']}->gemm{t['gemm']}"
            counts[key] = counts.get(key, 0) + 1
            d = parts.setdefault(key, {})

            def add(name, value, d=d):
                d.setdefault(name, []).append(value)

            seen = [(n, prev[n]) for n in steps if n in prev]
            for (n1, v1), (n2, v2) in zip(seen, seen[1:], strict=False):
                add(f"{n1}->{n2}", v2 - v1)
            end = prev["mma_done"]
            if "epilogue_done" in prev:
                add("epilogue_done->next_task", t["taken"] - prev["epilogue_done"])
            if "first_full" in t:
                add("next_task->first_full", t["first_full"] - t["taken"])
                add("mma_done->first_full", t["first_full"] - end)
            pi, pj = by_task.get((blk, prev["index"])), by_task.get((blk, t["index"]))
            if pi is None or pj is None or "first_issue" not in pj:
                continue
            if "last_issue" in pi:
                add("producer: last_issue->next task", pj["taken"] - pi["last_issue"])
                add("producer: last_issue (from mma_done)", pi["last_issue"] - end)
            mark = pj["taken"]
            for n in ("rows_located", "first_slot", "first_issue"):
                if n in pj:
                    add(f"producer: ->{n}", pj[n] - mark)
                    mark = pj[n]
            add("producer: first_issue (from mma_done)", pj["first_issue"] - end)
            if "first_full" in t:
                add("first stage: issue->landed", t["first_full"] - pj["first_issue"])
    return {
        k: {"count": counts[k], "median_us": {n: round(median(v), 3) for n, v in d.items()}}
        for k, d in sorted(parts.items())
    }


def analyse(trace: list[list[list[tuple]]], H: int, I: int, fp8: bool = False) -> dict:
    t0 = min(role[0][0] for blk in trace for role in blk if role)
    phases: dict[str, list[float]] = {name: [] for name in PHASES.values()}
    tiles = []
    producer = []
    for blk, lists in enumerate(trace):
        rate, clk0, ns0 = clock_rate(lists)

        def at_clock(c, rate=rate, clk0=clk0, ns0=ns0):
            return ns0 + (c - clk0) / rate - t0

        for g, _, kind, *_ in lists[0]:
            if kind in PHASES:
                phases[PHASES[kind]].append((g - t0) / 1e3)
        # Producer: one record per task.
        cur = None
        for g, _, kind, a, b, cc in lists[0]:
            if kind == PRODUCER_TASK:
                cur = {
                    "block": blk,
                    "index": a,
                    "gemm": b >> 24,
                    "expert": b & 0xFFFFFF,
                    "feature_tile": cc >> 16 & 0xFFF,
                    "splits": cc >> 28 or 1,
                    "n": cc >> 8 & 0xFF,
                    "rows": cc & 0xFF,
                    "taken": (g - t0) / 1e3,
                }
                producer.append(cur)
            elif cur is not None and kind == PRODUCER_READY:
                cur["ready"] = (g - t0) / 1e3
            # A task of several passes (fp8 GEMM0: two 64-feature weight tiles) issues each pass's stages in
            # turn: its first issue is the first pass's, its last the last pass's, its empty-slot waits their sum.
            elif cur is not None and kind == PRODUCER_FIRST:
                cur.setdefault("first_issue", (g - t0) / 1e3)
            elif cur is not None and kind == PRODUCER_ROWS_LOCATED:
                cur.setdefault("rows_located", (g - t0) / 1e3)
            elif cur is not None and kind == PRODUCER_FIRST_SLOT:
                cur.setdefault("first_slot", (g - t0) / 1e3)
            elif cur is not None and kind == PRODUCER_LAST:
                cur["last_issue"] = (g - t0) / 1e3
                cur["empty_wait"] = cur.get("empty_wait", 0.0) + a / rate / 1e3
        # Each consumer warpgroup's view of the tiles it computed: both for a split tile, one (its owner) for a
        # ping-pong tile.
        by_index = {p["index"]: p for p in producer if p["block"] == blk}
        for role in (1, 2):
            cur = None
            for g, c, kind, a, b, _ in lists[role]:
                if kind == CONSUMER_TASK:
                    cur = {"block": blk, "role": role, "index": a, "taken": (g - t0) / 1e3}
                    tiles.append(cur)
                    cur.update(
                        {k: by_index.get(a, {}).get(k) for k in ("gemm", "n", "rows", "expert", "splits")}
                    )
                elif cur is not None and kind == CONSUMER_FIRST_FULL:
                    # Its global time where the build records it (a | b << 32), else from the clock: the
                    # clock's rate moves under load, so a straight line through the block's events can be us off.
                    landed_ns = a | b << 32
                    cur["first_full"] = (landed_ns - t0) / 1e3 if landed_ns else at_clock(c) / 1e3
                elif cur is not None and kind == CONSUMER_MMA:
                    cur["mma_done"] = (g - t0) / 1e3
                    cur["full_wait"] = a / rate / 1e3
                elif cur is not None and kind == CONSUMER_EPILOGUE:
                    cur["epilogue_done"] = (g - t0) / 1e3
                elif cur is not None and kind in (
                    CONSUMER_STAGED,
                    CONSUMER_PLACED,
                    CONSUMER_STORED,
                    CONSUMER_COUNTED,
                ):
                    cur[KIND_NAMES[kind]] = (g - t0) / 1e3
    wide = wide_gemms(producer, H, I, fp8)
    for p in producer:
        p["boxes"] = 2 if p["gemm"] in wide else 1
    for t in tiles:
        t["boxes"] = 2 if t.get("gemm") in wide else 1
    # Per consumer warpgroup: the gap between its tile's epilogue and its next tile's first landed stage.
    by_consumer: dict[tuple[int, int], list[dict]] = {}
    for t in tiles:
        by_consumer.setdefault((t["block"], t["role"]), []).append(t)
    for lst in by_consumer.values():
        for prev, t in zip(lst, lst[1:], strict=False):
            if "epilogue_done" in prev and "first_full" in t:
                t["gap_before"] = t["first_full"] - prev["epilogue_done"]
    groups: dict[str, dict] = {}
    for t in tiles:
        if t.get("gemm") is None or "epilogue_done" not in t or "first_full" not in t:
            continue
        splits = t.get("splits") or 1
        key = f"gemm{t['gemm']}/N{t['n']}" + (f"/k{splits}" if splits > 1 else "")
        # "tiles": consumer views (a split-width tile counts twice, a ping-pong tile once); /kS: one of S
        # tasks over a GEMM0 tile's K.
        g = groups.setdefault(
            key,
            {
                "tiles": 0,
                "weight_bytes_per_tile": tile_weight_bytes(t["gemm"], H, I, fp8, splits, t["boxes"]),
                "parts": {},
            },
        )
        g["tiles"] += 1
        for name, value in (
            ("wait_first_stage", t["first_full"] - t["taken"]),
            ("mainloop", t["mma_done"] - t["first_full"]),
            ("full_wait_in_mainloop", t["full_wait"]),
            ("epilogue", t["epilogue_done"] - t["mma_done"]),
            ("gap_before", t.get("gap_before")),
            ("tile_total", t["epilogue_done"] - t["taken"]),
        ):
            if value is not None:
                g["parts"].setdefault(name, []).append(value)
    for g in groups.values():
        parts = g.pop("parts")
        g["median_us"] = {k: round(median(v), 3) for k, v in parts.items()}
        g["sum_us"] = {k: round(sum(v), 1) for k, v in parts.items()}
        ml = g["median_us"].get("mainloop")
        g["mainloop_gb_per_s_per_sm"] = round(g["weight_bytes_per_tile"] / ml / 1e3, 1) if ml else None
    prod = {}
    for p in producer:
        if "first_issue" not in p:
            continue
        key = f"gemm{p['gemm']}/N{p['n']}" + (f"/k{p['splits']}" if p["splits"] > 1 else "")
        d = prod.setdefault(key, {})
        for name, value in (
            ("taken_to_ready", p.get("ready", p["taken"]) - p["taken"]),
            ("ready_to_first_issue", p["first_issue"] - p.get("ready", p["taken"])),
            ("issue_span", p.get("last_issue", p["first_issue"]) - p["first_issue"]),
            ("empty_wait", p.get("empty_wait", 0.0)),
        ):
            d.setdefault(name, []).append(value)
    producer_summary = {k: {n: round(median(v), 3) for n, v in d.items()} for k, d in prod.items()}
    # Every pair of consecutive events of one thread: how often, and the median time between them.
    names = {**PHASES, **KIND_NAMES}
    steps: dict[str, list[float]] = {}
    for lists in trace:
        for role, events in enumerate(lists):
            for (g1, _, k1, *_), (g2, _, k2, *_) in zip(events, events[1:], strict=False):
                if k1 == CONSUMER_FIRST_FULL or k2 == CONSUMER_FIRST_FULL:
                    continue  # recorded late (its time is the clock it carries)
                key = f"{ROLES[role]}: {names.get(k1, k1)} -> {names.get(k2, k2)}"
                steps.setdefault(key, []).append((g2 - g1) / 1e3)
    transitions = {k: [len(v), round(median(v), 3)] for k, v in sorted(steps.items())}
    gemm_start = phases["gemm_start"]
    gemm_end = phases["gemm"]
    # Every task streams its weight tile once, whichever consumers computed it: count the producer's tasks.
    weight_bytes = sum(tile_weight_bytes(p["gemm"], H, I, fp8, p["splits"], p["boxes"]) for p in producer)
    tasks_per_block = [sum(1 for p in producer if p["block"] == blk) for blk in range(len(trace))]
    span = (max(gemm_end) - min(gemm_start)) if gemm_end and gemm_start else float("nan")
    timeline = streaming_timeline(producer, H, I, fp8)
    return {
        "phase_end_us": {
            k: {"min": round(min(v), 2), "median": round(median(v), 2), "max": round(max(v), 2)}
            for k, v in phases.items()
            if v
        },
        "gemm_phase_us": round(span, 2),
        "gemm_weight_bytes": weight_bytes,
        "gemm_tb_per_s": round(weight_bytes / span / 1e6, 3) if span == span and span > 0 else None,
        "blocks_gemm_end_spread_us": round(max(gemm_end) - median(gemm_end), 2) if gemm_end else None,
        "tiles_per_block": {"min": min(tasks_per_block), "max": max(tasks_per_block)}
        if tasks_per_block
        else {},
        "consumer_tiles": groups,
        "producer_tiles": producer_summary,
        "transitions": transitions,
        "handovers": handovers(by_consumer, producer),
        "streaming_timeline": timeline,
        "per_sm_rates": per_sm_rates(timeline),
    }


def print_case(shape: str, T: int, blocks: int, err: float, summary: dict) -> None:
    """One token count's summary, as read by a person: phase ends, per-tile medians, steps, the streaming timeline."""
    print(
        f"\n== {shape} T={T}: {blocks} blocks, rel err {err:.1e}, GEMM phase {summary['gemm_phase_us']} us "
        f"({summary['gemm_tb_per_s']} TB/s of weights), block GEMM ends spread {summary['blocks_gemm_end_spread_us']} us,"
        f" tiles/block {summary['tiles_per_block']}",
        flush=True,
    )
    print(
        "phase ends (us from first start, min/median/max over blocks): "
        + ", ".join(f"{p} {v['min']}/{v['median']}/{v['max']}" for p, v in summary["phase_end_us"].items())
    )
    for key, g in sorted(summary["consumer_tiles"].items()):
        m = g["median_us"]
        print(
            f"  consumer {key}: {g['tiles']} tiles, median us: "
            + ", ".join(f"{n} {v}" for n, v in m.items())
            + f"; mainloop {g['mainloop_gb_per_s_per_sm']} GB/s/SM"
        )
    for key, m in sorted(summary["producer_tiles"].items()):
        print(f"  producer {key}: median us: " + ", ".join(f"{n} {v}" for n, v in m.items()))
    for key, h in summary.get("handovers", {}).items():
        print(
            f"  handover {key} ({h['count']}x), median us: "
            + ", ".join(f"{n} {v}" for n, v in h["median_us"].items())
        )
    print("  steps (count, median us):")
    for key, (n, v) in summary["transitions"].items():
        if n >= 10 and not key.startswith("consumer1"):
            print(f"    {key}: {n}x {v}")
    timeline = summary.get("streaming_timeline") or []
    if timeline:
        print("  streaming (us: TB/s issued, SMs issuing GEMM0/GEMM1):")
        cells = [
            f"{b['t_us']:g}: {b['tb_per_s']:.2f} {b['sms_issuing'][0]:g}/{b['sms_issuing'][1]:g}"
            for b in timeline
        ]
        for i in range(0, len(cells), 6):
            print("    " + " | ".join(cells[i : i + 6]))
        r = summary.get("per_sm_rates") or {}
        if r.get("full_gb_per_s_per_sm") or r.get("sparse_gb_per_s_per_sm"):
            print(
                f"  per issuing SM: {r['full_gb_per_s_per_sm']} GB/s where >= {FULL_WAVE_SMS} SMs issue "
                f"({r['full_bins']} bins), {r['sparse_gb_per_s_per_sm']} GB/s where {MIN_SPARSE_SMS}-{FEW_SMS - 1} "
                f"do ({r['sparse_bins']} bins)"
            )


def analyse_raw(path: Path) -> tuple[dict, dict[str, dict]]:
    """A raw trace file (--raw): the file's document and, per token count, analyse()'s summary of its events."""
    doc = json.loads(path.read_text())
    summaries = {}
    for T, case in doc["cases"].items():
        events = case.get("events")
        if not events:
            raise SystemExit(f"kernel_trace: {path} case T={T} has no events (trace it with --raw)")
        trace = [[[tuple(e) for e in role] for role in block] for block in events]
        summaries[T] = analyse(trace, doc["H"], doc["I"], doc.get("dtype") == "fp8")
    return doc, summaries


def reanalyse(path: Path) -> None:
    """Print the analysis of a raw trace file (--raw) again, with no GPU: for traces taken before an analysis
    was added, or to look again."""
    doc, summaries = analyse_raw(path)
    for T, summary in summaries.items():
        case = doc["cases"][T]
        blocks = len(case["events"])
        print_case(doc["shape"], int(T), blocks, case.get("rel_err_vs_reference", float("nan")), summary)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b/ep4", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="1,8,128,4096")
    ap.add_argument("--launches", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="kernel_trace.json")
    ap.add_argument("--raw", action="store_true", help="keep every event in the JSON")
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="weight format (fp8: block-fp8)")
    ap.add_argument(
        "--reanalyse", type=Path, help="print the analysis of this --raw trace file (no GPU) and exit"
    )
    args = ap.parse_args()
    if args.reanalyse:
        reanalyse(args.reanalyse)
        return
    # The trace build: read when the first layer builds or loads the library, not at import.
    os.environ["FLASHMOE_TRACE"] = "1"
    fp8 = args.dtype == "fp8"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    E, k, H, I = SHAPES[args.shape]
    rank = 0
    if world > 1:
        import torch.distributed as dist
        from flashmoe import ExpertPlacement, FlashMoE, MoELayerSpec

        dist.init_process_group("nccl", device_id=device)
        rank = dist.get_rank()
        cpu_group = dist.new_group(backend="gloo")
        moe = FlashMoE(
            MoELayerSpec(E * world, k, H, I, 8192, weight_dtype=torch.float8_e4m3fn if fp8 else None),
            ExpertPlacement.contiguous(E * world, world),
            None,
            cpu_group=cpu_group,
        )
    else:
        moe = layer(args.shape, fp8)
    gen = torch.Generator().manual_seed(args.seed + rank)
    set_bytes = E * 3 * H * I * (1 if fp8 else 2)
    sets = max(2, min(8, -(-4 * l2_bytes(device) // set_bytes)))
    # (w13, w2, scale keywords) per set; tokens are drawn per token count below.
    weight_sets = [draw_layer(E, H, I, 1, gen, device, fp8)[1:] for _ in range(sets)]
    results = {
        "shape": args.shape,
        "dtype": args.dtype,
        "E": E,
        "k": k,
        "H": H,
        "I": I,
        "weight_sets": sets,
        "cases": {},
    }
    for T in (int(t) for t in args.tokens.split(",")):
        x = random_grouped_hidden(T, H, gen) if fp8 else torch.randn(T, H, generator=gen).to(torch.bfloat16)
        x = x.to(device)
        ids, w = routing(E * world, k, T, "uniform", gen, device)
        out = torch.full_like(x, float("nan"))
        for i in range(args.launches):
            w13, w2, scales = weight_sets[i % sets]
            moe(x, ids, w, w13, w2, out=out, **scales)
        torch.cuda.synchronize()
        counts, events = _ops().trace_dump()
        ok = True
        if world == 1:
            if fp8:
                ref = moe_reference_fp8(x, ids, w, w13, scales["w13_scale_inv"], w2, scales["w2_scale_inv"])
            else:
                ref = moe_reference(x, ids, w, w13, w2)
            stats = error_stats(out, ref)
            err = stats.rel_fro
            ok = within_kernel_budgets({"ref": stats}, args.dtype, I)
        else:
            err = 0.0 if bool(torch.isfinite(out).all()) else float("nan")
        blocks = int((counts.sum(1) > 0).sum())
        trace = decode(counts, events, blocks)
        summary = analyse(trace, H, I, fp8)
        summary["rel_err_vs_reference"] = err
        if args.raw:
            summary["events"] = trace
        results["cases"][str(T)] = summary
        if rank != 0:
            continue
        print_case(args.shape, T, blocks, err, summary)
        if not ok or err != err:
            print(f"WRONG: rel err {err:.2e} against the same-rounding reference", flush=True)
    out_path = Path(args.out) if world == 1 else Path(f"{args.out}.rank{rank}.json")
    results["world_size"], results["rank"] = world, rank
    out_path.write_text(json.dumps(results))
    print(f"\nrank {rank}: wrote {out_path}")


def _ops():
    from flashmoe import build

    return build.load()


if __name__ == "__main__":
    main()
