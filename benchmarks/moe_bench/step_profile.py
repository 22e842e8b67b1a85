"""Where a served decode step's GPU time goes, from torch-profiler Chrome traces (one file per worker).

    python benchmarks/moe_bench/step_profile.py TRACE_DIR [--json OUT]

vLLM's ``--profiler-config '{"profiler": "torch", ...}'`` makes every worker write
``<worker>.<time_ns>.pt.trace.json[.gz]`` (worker = ``dp0_pp0_tp0_dcp0_ep0_rank0`` in 0.26 and 0.32) when
``/stop_profile`` is posted. Per worker this module finds the steady decode steps and splits their GPU time:

- GPU kernels: events of category ``kernel``. Kernels replayed from a CUDA graph are reported by CUPTI one
  by one, each carrying the ``correlation`` id of the ``cudaGraphLaunch`` that replayed it.
- Decode steps: vLLM replays one FULL CUDA graph per decode step (the whole forward pass; piecewise graphs
  of mixed/prefill steps hold one piece each, eager steps none), so a decode step starts where the first
  kernel of a full-graph launch starts and ends where the next one starts; that interval holds the
  step's graph, its eager kernels (sampling, input preparation) and the host's share (idle). A launch is
  "full" when it replays at least half as many kernels as the largest launch in the trace. The window is
  the longest run of consecutive full launches with no other graph launch and no eager step between
  them (an eager prefill shows up as more eager kernels than half a full graph); n launches, n - 1 steps.
  This counts ``cudaGraphLaunch`` runtime events, but only those that replay a decode step, and it needs
  no vLLM annotation: DP ranks without requests run unannotated dummy steps in lockstep. Should no
  kernel carry a graph launch's correlation id, the fallback is the whole kernel span over the number of
  launches (``step_marker`` says so; prefill included, no step boundaries).
- Busy: the union of kernel intervals; idle = window - busy. Busy is split into categories
  (:data:`CATEGORIES`) exactly: where k kernels overlap, each gets 1/k of that time, so the categories
  add up to busy. ``kernel_time_ms`` is the plain sum of kernel durations (overlap counted twice).
- Gaps: kernels in start order; a kernel's gap is its start minus the latest end of the kernels before
  it (0 when they overlap). Each gap in the window falls in exactly one class: ``step_boundary`` (before
  the first kernel of a step), ``inside_moe`` (moe kernel after a moe kernel), ``before_moe`` (a moe
  kernel after another kernel), ``after_moe`` (a kernel after a moe kernel), ``other``. The classes'
  per-step totals add up to idle. A persistent kernel that needs every SM cannot start until the previous
  kernel's last block has left, which ``before_moe`` would show.
- ``first_in_step``: the first moe (and comm) kernel of each step against the others of its category:
  DP ranks out of step wait in the first collective of the step (layer 0's MoE or all-gather).
- Copies (``gpu_memcpy``/``gpu_memset``) run on copy engines, not SMs: reported as ``copy_ms``, not busy.

A trace without GPU kernels (vLLM on CPU records CPU activity only) gives ``kernels: 0`` and a ``note``;
vLLM's own step annotations (``execute_context_<n>(..)_generation_<m>(..)``) are counted either way.
Stdlib only: the summary runs wherever the JSON is read.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import statistics
import sys
import time
import zlib
from collections import Counter, defaultdict
from pathlib import Path

# Checked in this order, case-insensitive, on the kernel's (demangled) name; the first match wins.
CATEGORIES: tuple[tuple[str, re.Pattern], ...] = (
    # flashmoe's megakernel (csrc/kernel.cu: flashmoe::moe_layer_kernel<bool>) and vLLM's Triton expert path:
    # fused_moe_kernel (batched_triton_kernel with DeepEP low-latency's per-expert layout),
    # moe_align_block_size, the SwiGLU act_and_mul (Qwen3-30B has no dense MLP, so every silu is an
    # expert's), moe_sum.
    (
        "moe",
        re.compile(
            r"moe_layer_kernel|fused_moe|batched_triton|moe_align|count_and_sort_expert|act_and_mul|silu|moe_sum"
        ),
    ),
    # vLLM's router top-k (topkGatingSoftmax, moeSoftmax, moeTopK, grouped_topk); both paths run it.
    ("routing", re.compile(r"topk|top_k|gating|moesoftmax|moe_softmax")),
    # DeepEP's dispatch/combine kernels (deep_ep::internode_ll::dispatch, ...) are communication too.
    ("comm", re.compile(r"nccl|cross_device_reduce|all_?reduce|all_?gather|reduce_?scatter|nvshmem|deep_ep")),
    (
        "attention",
        re.compile(r"attn|attention|flash_fwd|fmha|flashinfer|reshape_and_cache|concat_and_cache|_mla|mla_"),
    ),
    ("gemm", re.compile(r"gemm|gemv|cutlass|cublas|nvjet|xmma|wgmma|matmul|splitk|triton_tem_fused")),
)
CATEGORY_NAMES = tuple(name for name, _ in CATEGORIES) + ("other",)
GAP_CLASSES = ("before_moe", "after_moe", "inside_moe", "step_boundary", "other")
# A launch replaying at least this share of the largest launch's kernels replays a whole decode step.
FULL_GRAPH_SHARE = 0.5
TOP_KERNELS = 15
STALL_US = 500.0  # a host gap between decode steps longer than this counts as a stall
TRACE_GLOB = "*.pt.trace.json*"
_STEP_ANNOTATION = re.compile(r"execute_(?:\d+_)?context_(\d+)\(.*?\)_generation_(\d+)\(")


def category(kernel_name: str) -> str:
    low = kernel_name.lower()
    return next((name for name, pat in CATEGORIES if pat.search(low)), "other")


def load_trace(path: str | Path) -> dict:
    """A Chrome trace as JSON (gzip or plain; either way by content, not by name)."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    doc = json.loads(raw)
    if isinstance(doc, list):  # the JSON-array form of the format
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    return doc


def worker_name(path: str | Path) -> str:
    """``dp0_pp0_tp0_dcp0_ep0_rank0`` from ``dp0_pp0_tp0_dcp0_ep0_rank0.<time_ns>.pt.trace.json.gz``."""
    return Path(path).name.split(".", 1)[0]


class _Kernel:
    __slots__ = ("start", "end", "name", "cat", "corr")

    def __init__(self, start: float, end: float, name: str, corr):
        self.start, self.end, self.name, self.cat, self.corr = start, end, name, category(name), corr


def _sweep(pieces: list[tuple[float, float, str]]) -> tuple[float, dict[str, float]]:
    """Union length of intervals and its exact split by category (overlaps shared equally)."""
    edges = sorted([(s, 1, c) for s, e, c in pieces if e > s] + [(e, -1, c) for s, e, c in pieces if e > s])
    active: Counter = Counter()
    busy, by_cat, prev = 0.0, dict.fromkeys(CATEGORY_NAMES, 0.0), None
    for t, delta, cat in edges:
        n = sum(active.values())
        if n and prev is not None and t > prev:
            seg = t - prev
            busy += seg
            for c, k in active.items():
                if k:
                    by_cat[c] += seg * k / n
        active[cat] += delta
        prev = t
    return busy, by_cat


def _annotated_steps(events: list[dict]) -> dict:
    """vLLM's per-step annotations on the CPU (real steps only; DP dummy steps carry none; a step that
    schedules nothing, ``context_0(0)_generation_0(0)``, counts as neither)."""
    decode, mixed, batches = 0, 0, Counter()
    for ev in events:
        if ev.get("cat") != "user_annotation":
            continue
        m = _STEP_ANNOTATION.search(ev.get("name", ""))
        if not m:
            continue
        ctx, gen = int(m.group(1)), int(m.group(2))
        if ctx:
            mixed += 1
        elif gen:
            decode += 1
            batches[str(gen)] += 1
    return {"decode": decode, "prefill_or_mixed": mixed, "decode_batch": dict(sorted(batches.items()))}


def _decode_run(launches: list[tuple[float, int]], kernels_by_corr: dict, eager_starts: list[float]):
    """The longest run of consecutive full-graph launches (module docstring); [(step start, corr)]."""
    sized = [(ts, corr, len(kernels_by_corr.get(corr, ()))) for ts, corr in launches]
    largest = max((n for _, _, n in sized), default=0)
    if largest == 0:
        return [], 0
    best, run = [], []
    for _, corr, n in sized:
        if n == 0:
            continue  # nothing replayed on the GPU under this launch (or CUPTI lost it)
        if n < FULL_GRAPH_SHARE * largest:  # a piecewise graph: a mixed or prefill step
            best, run = max(best, run, key=len), []
            continue
        start = min(k.start for k in kernels_by_corr[corr])
        if run:
            between = bisect.bisect_left(eager_starts, start) - bisect.bisect_right(eager_starts, run[-1][0])
            if between > FULL_GRAPH_SHARE * largest:  # an eager step (prefill) in between
                best, run = max(best, run, key=len), []
        run.append((start, corr))
    best = max(best, run, key=len)
    return best, largest


def summarize_trace(doc: dict, top: int = TOP_KERNELS) -> dict:
    """One worker's trace: the decode window, per-step busy/idle/categories, gaps, top kernels."""
    events = [ev for ev in doc["traceEvents"] if isinstance(ev, dict)]
    out: dict = {"vllm_steps": _annotated_steps(events)}
    kernels: list[_Kernel] = []
    launches: list[tuple[float, object]] = []
    copies: list[tuple[float, float]] = []
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat = str(ev.get("cat", "")).lower()
        ts, dur = float(ev.get("ts", 0.0)), float(ev.get("dur", 0.0))
        if cat == "kernel":
            kernels.append(
                _Kernel(ts, ts + dur, str(ev.get("name", "")), (ev.get("args") or {}).get("correlation"))
            )
        elif cat in ("gpu_memcpy", "gpu_memset"):
            copies.append((ts, ts + dur))
        elif cat in ("cuda_runtime", "cuda_driver") and "GraphLaunch" in str(ev.get("name", "")):
            launches.append((ts, (ev.get("args") or {}).get("correlation")))
    out["kernels"] = len(kernels)
    out["graph_launches"] = len(launches)
    if not kernels:
        out["steps"] = 0
        out["note"] = (
            "no GPU kernel events in this trace: a CPU-only profile (vLLM's CPU worker records CPU activity "
            "only), nothing to split"
        )
        return out
    kernels.sort(key=lambda k: k.start)
    out["trace_span_ms"] = _ms(max(k.end for k in kernels) - kernels[0].start)
    graph_corrs = {corr for _, corr in launches if corr is not None}
    kernels_by_corr: dict = defaultdict(list)
    for k in kernels:
        if k.corr in graph_corrs:
            kernels_by_corr[k.corr].append(k)
    out["graph_kernels"] = sum(len(v) for v in kernels_by_corr.values())
    launches.sort()
    eager_starts = [k.start for k in kernels if k.corr not in graph_corrs]
    run, largest = _decode_run(launches, kernels_by_corr, eager_starts)
    out["kernels_per_decode_graph"] = largest
    if len(run) < 2 and launches and not out["graph_kernels"]:
        # Graph launches whose kernels carry no matching correlation id: no step boundaries, so the whole
        # kernel span (prefill included) divided by the number of launches is the best that is left.
        bounds = [kernels[0].start, max(k.end for k in kernels)]
        out.update(_window(kernels, bounds, set(), copies, top, steps=len(launches)))
        out["step_marker"] = "fallback: whole kernel span / cudaGraphLaunch count (prefill included)"
        out["note"] = (
            f"{len(launches)} cudaGraphLaunch events but no kernel correlated with one: no decode window, "
            "per-step numbers are the whole trace over the launch count"
        )
        return out
    if len(run) < 2:
        out["steps"] = 0
        out["note"] = (
            f"no two consecutive full CUDA-graph launches ({len(launches)} cudaGraphLaunch events, "
            f"{out['graph_kernels']} kernels correlated with them): no decode window (eager mode?)"
        )
        return out
    bounds = [s for s, _ in run]
    first_kernel = {min(kernels_by_corr[c], key=lambda k: k.start) for _, c in run}
    out.update(_window(kernels, bounds, first_kernel, copies, top))
    out["step_marker"] = (
        f"first kernel of each full CUDA-graph launch (>= {FULL_GRAPH_SHARE:g} x {largest} kernels replayed)"
    )
    return out


def _window(
    kernels: list[_Kernel], bounds: list[float], step_first: set, copies, top: int, steps: int | None = None
) -> dict:
    """Numbers of the window [bounds[0], bounds[-1]], per step; ``bounds`` are the step starts (and the
    window's end), unless ``steps`` divides a window without step boundaries."""
    w0, w1 = bounds[0], bounds[-1]
    intervals = len(bounds) - 1
    bounded = steps is None
    steps = intervals if bounded else steps
    per_step_pieces: list[list[tuple[float, float, str]]] = [[] for _ in range(intervals)]
    kernel_time: dict[str, float] = dict.fromkeys(CATEGORY_NAMES, 0.0)
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    first_in_step: dict[str, list[list[float]]] = {"moe": [[], []], "comm": [[], []]}
    seen_in_step: set = set()
    for k in kernels:
        if k.end <= w0 or k.start >= w1:
            continue
        s, e = max(k.start, w0), min(k.end, w1)
        kernel_time[k.cat] += e - s
        by_name[k.name][0] += 1
        by_name[k.name][1] += e - s
        lo = bisect.bisect_right(bounds, s) - 1
        hi = bisect.bisect_left(bounds, e)
        for i in range(max(lo, 0), min(hi, intervals)):
            per_step_pieces[i].append((max(s, bounds[i]), min(e, bounds[i + 1]), k.cat))
        if k.cat in first_in_step and w0 <= k.start < w1:
            step = bisect.bisect_right(bounds, k.start) - 1
            first = (k.cat, step) not in seen_in_step
            seen_in_step.add((k.cat, step))
            first_in_step[k.cat][0 if first else 1].append(k.end - k.start)
    step_ms, busy_total, cats_total = [], 0.0, dict.fromkeys(CATEGORY_NAMES, 0.0)
    for i, pieces in enumerate(per_step_pieces):
        busy, by_cat = _sweep(pieces)
        busy_total += busy
        for c, v in by_cat.items():
            cats_total[c] += v
        step_ms.append((bounds[i + 1] - bounds[i]) / 1e3)
    gaps = _gaps(kernels, w0, w1, step_first)
    copy_total = sum(max(0.0, min(e, w1) - max(s, w0)) for s, e in copies)
    window = w1 - w0
    per_step = {
        "step_ms": _ms(window / steps),
        "step_ms_median": round(statistics.median(step_ms), 4) if bounded else None,
        "step_ms_min": round(min(step_ms), 4) if bounded else None,
        "step_ms_max": round(max(step_ms), 4) if bounded else None,
        "busy_ms": _ms(busy_total / steps),
        "idle_ms": _ms((window - busy_total) / steps),
        "kernels": round(sum(v[0] for v in by_name.values()) / steps, 2),
        "categories_ms": {c: _ms(v / steps) for c, v in cats_total.items()},
        "kernel_time_ms": {c: _ms(v / steps) for c, v in kernel_time.items()},
        "copy_ms": _ms(copy_total / steps),
    }
    top_kernels = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "steps": steps,
        "window_ms": _ms(window),
        "busy_ms": _ms(busy_total),
        "idle_ms": _ms(window - busy_total),
        "per_step": per_step,
        "gaps": {
            cls: {
                "count_per_step": round(len(v) / steps, 2),
                "mean_us": round(statistics.fmean(v), 3) if v else None,
                "per_step_us": round(sum(v) / steps, 3),
                "max_us": round(max(v), 3) if v else None,
            }
            for cls, v in gaps.items()
        },
        # The host's time between two steps, as a distribution: a stall on one DP rank (GIL, GC) shows here
        # and, through vLLM's per-step DP sync, as a long first collective on the others.
        "step_boundary_us": _distribution(gaps["step_boundary"], STALL_US),
        "moe_block_us": _moe_blocks(kernels, bounds) if bounded else None,
        "first_in_step_us": {
            cat: {
                "first": round(statistics.fmean(f), 3) if f else None,
                "rest": round(statistics.fmean(r), 3) if r else None,
                "rest_per_step": round(len(r) / steps, 2),
            }
            for cat, (f, r) in first_in_step.items()
        }
        if bounded
        else None,
        "top_kernels": [
            {
                "name": name[:160],
                "category": category(name),
                "calls_per_step": round(n / steps, 2),
                "ms_per_step": _ms(t / steps),
            }
            for name, (n, t) in top_kernels
        ],
    }


def _distribution(values: list[float], stall: float) -> dict | None:
    """p50 / p90 / max (µs) and how many exceed ``stall``."""
    if not values:
        return None
    ordered = sorted(values)
    return {
        "p50": round(statistics.median(ordered), 1),
        "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 1),
        "max": round(ordered[-1], 1),
        f"over_{stall:g}": sum(v > stall for v in ordered),
        "count": len(ordered),
    }


MOE_BLOCK = ("routing", "moe", "comm")


def _moe_blocks(kernels: list[_Kernel], bounds: list[float]) -> dict | None:
    """Wall time of each layer's MoE block, per step: from the first routing/moe/comm kernel after an
    attention kernel to the end of the last moe/comm kernel before the next attention kernel or the step's
    end (the router, the dispatch, the experts and the combine of either path, and whatever small kernels
    run between them; the last layer's block may take in the step's own collectives, hence medians).
    Layer 0 is apart: with DP it also waits for the other ranks. Medians over the window's steps, µs."""
    by_step: dict[int, list[_Kernel]] = defaultdict(list)  # one pass over the trace, not one per step
    for k in kernels:
        if bounds[0] <= k.start < bounds[-1]:
            by_step[bisect.bisect_right(bounds, k.start) - 1].append(k)
    first, rest = [], []
    for i in range(len(bounds) - 1):
        spans, start, end = [], None, None
        for k in by_step[i]:
            if k.cat == "attention":
                if start is not None and end is not None:
                    spans.append(end - start)
                start = end = None
            elif k.cat in MOE_BLOCK:
                if start is None:
                    start = k.start
                if k.cat != "routing":
                    end = max(end or k.end, k.end)
        if start is not None and end is not None:
            spans.append(end - start)
        if spans:
            first.append(spans[0])
            rest += spans[1:]
    if not first:
        return None
    return {
        "layer0": round(statistics.median(first), 2),
        "rest": round(statistics.median(rest), 2) if rest else None,
        "rest_p90": round(sorted(rest)[int(0.9 * (len(rest) - 1))], 2) if rest else None,
        "layers": round(len(first + rest) / len(first), 1),
    }


def _gaps(kernels: list[_Kernel], w0: float, w1: float, step_first: set) -> dict[str, list[float]]:
    """Gap before each kernel starting in (w0, w1], classed as in the module docstring (µs)."""
    out: dict[str, list[float]] = {c: [] for c in GAP_CLASSES}
    latest: _Kernel | None = None
    for k in kernels:  # sorted by start
        if latest is not None and w0 < k.start <= w1:
            gap = max(0.0, k.start - latest.end)
            if k in step_first:
                cls = "step_boundary"
            elif k.cat == "moe":
                cls = "inside_moe" if latest.cat == "moe" else "before_moe"
            else:
                cls = "after_moe" if latest.cat == "moe" else "other"
            out[cls].append(gap)
        if latest is None or k.end > latest.end:
            latest = k
    return out


def _ms(us: float) -> float:
    return round(us / 1e3, 4)


def load_when_complete(path: str | Path, deadline: float, poll_s: float = 1.0) -> dict:
    """:func:`load_trace`, retried until ``deadline`` (``time.monotonic()``) while the file is still being
    written (torch writes the gzip trace in place: a partial file is a truncated stream)."""
    while True:
        try:
            return load_trace(path)
        except (EOFError, ValueError, OSError, zlib.error):  # JSONDecodeError and BadGzipFile included
            if time.monotonic() > deadline:
                raise
            time.sleep(poll_s)


def summarize_files(named: dict[str, Path], deadline: float | None = None, top: int = TOP_KERNELS) -> dict:
    """Every worker's summary (``named``: worker name -> trace file, read one at a time: a GPU trace
    holds an event per kernel) and the mean over the workers with decode steps. With ``deadline``
    (``time.monotonic()``), a file still being written is waited for (:func:`load_when_complete`)."""
    workers = {}
    for name, path in sorted(named.items()):
        doc = load_trace(path) if deadline is None else load_when_complete(path, deadline)
        workers[name] = summarize_trace(doc, top=top)
        del doc
    return {"workers": workers, "mean": mean_over_workers(workers)}


def trace_names(paths: list[Path]) -> dict[str, Path]:
    """Worker name -> file; the longer name (with the timestamp) where one worker wrote two traces."""
    names: dict[str, Path] = {}
    for p in sorted(paths):
        name = worker_name(p)
        names[name if name not in names else Path(p).name.split(".pt.trace")[0]] = Path(p)
    return names


def summarize_dir(directory: str | Path, top: int = TOP_KERNELS) -> dict:
    paths = sorted(Path(directory).glob(TRACE_GLOB))
    if not paths:
        raise FileNotFoundError(f"no {TRACE_GLOB} under {directory}")
    return summarize_files(trace_names(paths), top=top)


def mean_over_workers(workers: dict) -> dict:
    """Per-step numbers averaged over the workers that have a decode window (the README's row)."""
    with_steps = [w for w in workers.values() if w.get("steps")]
    if not with_steps:
        notes = sorted({w.get("note", "") for w in workers.values()})
        return {"workers": 0, "note": "; ".join(n for n in notes if n) or "no decode steps in any trace"}
    n = len(with_steps)
    mean = {
        "workers": n,
        "steps": min(w["steps"] for w in with_steps),
        **{
            k: _avg([w["per_step"][k] for w in with_steps])
            for k in ("step_ms", "step_ms_median", "busy_ms", "idle_ms", "copy_ms")
        },
        "categories_ms": {
            c: _avg([w["per_step"]["categories_ms"][c] for w in with_steps]) for c in CATEGORY_NAMES
        },
    }
    fallback = sum(str(w.get("step_marker", "")).startswith("fallback") for w in with_steps)
    if fallback:
        mean["note"] = f"{fallback} of {n} workers without step boundaries (step_marker: fallback)"
    boundaries = [w["step_boundary_us"] for w in with_steps if w.get("step_boundary_us")]
    if boundaries:  # the worst worker's: one stalled rank holds every DP rank up
        mean["step_boundary_us"] = {
            "p90": max(b["p90"] for b in boundaries),
            "max": max(b["max"] for b in boundaries),
            f"over_{STALL_US:g}": max(b[f"over_{STALL_US:g}"] for b in boundaries),
        }
    blocks = [w["moe_block_us"] for w in with_steps if w.get("moe_block_us")]
    if blocks:
        mean["moe_block_us"] = {
            key: _avg([b[key] for b in blocks]) for key in ("layer0", "rest", "rest_p90", "layers")
        }
    mean["gap_mean_us"] = {}
    for cls in GAP_CLASSES:
        total = sum(w["gaps"][cls]["per_step_us"] for w in with_steps)
        count = sum(w["gaps"][cls]["count_per_step"] for w in with_steps)
        mean["gap_mean_us"][cls] = round(total / count, 3) if count else None
    return mean


def _avg(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.fmean(known), 4) if known else None


def table(summary: dict) -> str:
    """A plain-text view of a summary: one line per worker and the mean."""
    cols = ("step", "busy", "idle") + CATEGORY_NAMES
    lines = [f"{'worker':34s} steps " + " ".join(f"{c:>9s}" for c in cols) + "  gap before/after moe µs"]
    for name, w in summary["workers"].items():
        if not w.get("steps"):
            lines.append(f"{name:34s} {w.get('note', 'no decode steps')}")
            continue
        ps = w["per_step"]
        vals = [ps["step_ms"], ps["busy_ms"], ps["idle_ms"]] + [
            ps["categories_ms"][c] for c in CATEGORY_NAMES
        ]
        before, after = w["gaps"]["before_moe"]["mean_us"], w["gaps"]["after_moe"]["mean_us"]
        lines.append(
            f"{name:34s} {w['steps']:5d} "
            + " ".join(f"{v:9.3f}" for v in vals)
            + f"  {_num(before)} / {_num(after)}"
        )
    return "\n".join(lines)


def _num(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace_dir", type=Path, help=f"folder of {TRACE_GLOB} files (one per worker)")
    ap.add_argument("--json", type=Path, help="write the summary here")
    ap.add_argument("--top", type=int, default=TOP_KERNELS)
    args = ap.parse_args(argv)
    summary = summarize_dir(args.trace_dir, top=args.top)
    print(table(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
