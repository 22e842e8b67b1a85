"""The decode-step summariser (benchmarks/moe_bench/step_profile.py) on Chrome traces written here, with
known kernels, overlaps, graph launches and steps: exact busy, idle, categories and gaps."""

from __future__ import annotations

import gzip
import json
import threading
import time

import bench_import  # noqa: F401
import pytest
from moe_bench import step_profile as sp

MOE = "void flashmoe::moe_layer_kernel<false>(flashmoe::Params)"
GEMM = "nvjet_tst_64x8_64x16_4x1_v_bz_TNT"
ATTN = "kernel_unified_attention_2d"
NORM = "void vllm::rms_norm_kernel<c10::BFloat16>(c10::BFloat16*, c10::BFloat16 const*, float, int, int)"
ARGMAX = "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>"
NCCL = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def _x(cat, name, ts, dur, corr=None, stream=7, pid=0):
    ev = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": stream, "ts": ts, "dur": dur}
    if corr is not None:
        ev["args"] = {"correlation": corr, "stream": stream}
    return ev


def _graph_step(t0, corr):
    """One replayed decode graph at GPU time t0: gemm 10, gap 2, attention 8, gap 5, moe 40, gap 3, norm 2."""
    return [
        _x("cuda_runtime", "cudaGraphLaunch", t0 - 500, 5, corr, stream=1, pid=1),
        _x("kernel", GEMM, t0, 10, corr),
        _x("kernel", ATTN, t0 + 12, 8, corr),
        _x("kernel", MOE, t0 + 25, 40, corr),
        _x("kernel", NORM, t0 + 68, 2, corr),
    ]


def _eager_tail(t0, corr):
    """The step's eager kernels: argmax at +75..80, an all-gather on another stream at +78..84 (2 µs overlap)."""
    return [
        _x("cuda_runtime", "cudaLaunchKernel", t0 - 400, 3, corr, stream=1, pid=1),
        _x("kernel", ARGMAX, t0 + 75, 5, corr),
        _x("cuda_runtime", "cudaLaunchKernel", t0 - 399, 3, corr + 1, stream=1, pid=1),
        _x("kernel", NCCL, t0 + 78, 6, corr + 1, stream=9),
    ]


def _trace():
    ev = []
    # A full graph (step before a prefill), then an eager prefill (5 kernels > half a graph), then a
    # piecewise graph (1 kernel): neither belongs to the decode window.
    ev += _graph_step(200, corr=10)
    ev += [_x("kernel", GEMM, 300 + 100 * i, 50, 20 + i) for i in range(5)]
    ev += [_x("cuda_runtime", "cudaGraphLaunch", 450, 5, 30, stream=1, pid=1), _x("kernel", GEMM, 985, 5, 30)]
    # The decode window: full graphs at 1000, 1100, 1200 -> two steps [1000, 1100) and [1100, 1200).
    for i, t0 in enumerate((1000, 1100)):
        ev += _graph_step(t0, corr=100 + i) + _eager_tail(t0, corr=200 + 10 * i)
    ev += _graph_step(1200, corr=102)
    ev.append(_x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 1085, 5, 300))  # copy engine: not busy
    ev += [
        _x("user_annotation", "execute_context_1(1024)_generation_0(0)", 150, 50, pid=1),
        _x("user_annotation", "execute_context_0(0)_generation_1(1)", 550, 50, pid=1),
        _x("user_annotation", "execute_context_0(0)_generation_1(1)", 650, 50, pid=1),
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
    ]
    return {"schemaVersion": 1, "traceEvents": ev}


def test_a_host_stall_between_steps_is_counted_and_reaches_the_mean_row():
    """Six decode steps 100 µs apart, except one whose next graph starts 900 µs late (a host stall: GIL, GC,
    a DP peer): the step-boundary distribution names it, and the workers' mean row keeps the worst worker's."""
    ev, t0 = [], 1000
    for i in range(7):
        ev += _graph_step(t0, corr=100 + i)
        t0 += 1000 if i == 3 else 100  # the stall after the fourth step: 1000 - 70 µs of graph = 930 µs idle
    stalled = sp.summarize_trace({"traceEvents": ev})
    assert stalled["steps"] == 6
    assert stalled["step_boundary_us"] == {"p50": 30.0, "p90": 930.0, "max": 930.0, "over_500": 1, "count": 6}
    steady = sp.summarize_trace(
        {"traceEvents": [e for i in range(7) for e in _graph_step(1000 + 100 * i, 100 + i)]}
    )
    assert steady["step_boundary_us"]["over_500"] == 0
    mean = sp.mean_over_workers({"a": steady, "b": stalled})
    assert mean["step_boundary_us"] == {"p90": 930.0, "max": 930.0, "over_500": 1}


def test_categories_by_kernel_name():
    assert [sp.category(n) for n in (MOE, GEMM, ATTN, NORM, ARGMAX, NCCL)] == [
        "moe", "gemm", "attention", "other", "other", "comm",
    ]  # fmt: skip
    vllm_path = {
        "fused_moe_kernel": "moe",
        "void vllm::moe::moe_align_block_size_kernel<int>(int const*, int*)": "moe",
        "void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel<c10::BFloat16>, true>": "moe",
        "void vllm::moe::moe_sum_kernel<c10::BFloat16, 8>": "moe",
        "void vllm::moe::topkGatingSoftmax<float, 4, 128, 4, 8, int>": "routing",
        "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL": "comm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64": "gemm",
        "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>": "attention",
        # vLLM 0.26 with --all2all-backend deepep_low_latency (names from a DP2 trace on 2xH200)
        "batched_triton_kernel": "moe",
        "void deep_ep::internode_ll::dispatch<false, false, 2048>(void*, void*, int*, long*)": "comm",
        "void deep_ep::internode_ll::combine<false, 2048, 11, 4>(void*, void*, int*, void*)": "comm",
    }
    assert {n: sp.category(n) for n in vllm_path} == vllm_path


def test_two_decode_steps_exact_busy_idle_categories_and_gaps():
    s = sp.summarize_trace(_trace())
    assert (s["steps"], s["window_ms"], s["kernels_per_decode_graph"]) == (2, 0.2, 4)
    assert s["graph_launches"] == 5 and s["graph_kernels"] == 4 * 4 + 1
    # per step: union 10 + 8 + 40 + 2 + [75, 84) = 69 µs of 100
    assert (s["busy_ms"], s["idle_ms"]) == (0.138, 0.062)
    ps = s["per_step"]
    assert (ps["step_ms"], ps["step_ms_min"], ps["step_ms_max"], ps["busy_ms"], ps["idle_ms"]) == (
        0.1, 0.1, 0.1, 0.069, 0.031,
    )  # fmt: skip
    # the 2 µs where argmax and the all-gather overlap are shared 1:1, so the categories add up to busy
    assert ps["categories_ms"] == {
        "moe": 0.04, "routing": 0.0, "comm": 0.005, "attention": 0.008, "gemm": 0.01, "other": 0.006,
    }  # fmt: skip
    assert ps["kernel_time_ms"]["other"] == 0.007 and ps["kernel_time_ms"]["comm"] == 0.006
    assert ps["kernels"] == 6 and ps["copy_ms"] == 0.0025
    g = s["gaps"]
    assert g["before_moe"] == {"count_per_step": 1, "mean_us": 5.0, "per_step_us": 5.0, "max_us": 5.0}
    assert g["after_moe"] == {"count_per_step": 1, "mean_us": 3.0, "per_step_us": 3.0, "max_us": 3.0}
    assert g["inside_moe"] == {"count_per_step": 0, "mean_us": None, "per_step_us": 0.0, "max_us": None}
    # attention after gemm 2, argmax after norm 5, the overlapping all-gather 0
    assert g["other"] == {
        "count_per_step": 3, "mean_us": pytest.approx(7 / 3, abs=1e-3), "per_step_us": 7.0, "max_us": 5.0,
    }  # fmt: skip
    # 1100 - 1084 and 1200 - 1184: the host's share between steps
    assert g["step_boundary"] == {"count_per_step": 1, "mean_us": 16.0, "per_step_us": 16.0, "max_us": 16.0}
    assert s["step_boundary_us"] == {"p50": 16.0, "p90": 16.0, "max": 16.0, "over_500": 0, "count": 2}
    # One layer per step: its block runs from the moe kernel (+25) to the end of the step's last comm kernel
    # (the all-gather, +84) before the next attention; no layers 1+.
    assert s["moe_block_us"] == {"layer0": 59.0, "rest": None, "rest_p90": None, "layers": 1.0}
    assert sum(c["per_step_us"] for c in g.values()) == pytest.approx(ps["idle_ms"] * 1e3)
    assert s["first_in_step_us"]["moe"] == {"first": 40.0, "rest": None, "rest_per_step": 0}
    top = s["top_kernels"]
    assert [(t["name"], t["category"], t["calls_per_step"], t["ms_per_step"]) for t in top[:2]] == [
        (MOE, "moe", 1, 0.04), (GEMM, "gemm", 1, 0.01),
    ]  # fmt: skip
    assert len(top) == 6
    assert s["vllm_steps"] == {"decode": 2, "prefill_or_mixed": 1, "decode_batch": {"1": 2}}


def test_directory_of_gzip_and_plain_traces_one_per_worker(tmp_path):
    doc = json.dumps(_trace()).encode()
    (tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1700000000000000001.pt.trace.json.gz").write_bytes(
        gzip.compress(doc)
    )
    (tmp_path / "dp1_pp0_tp0_dcp0_ep1_rank1.1700000000000000002.pt.trace.json").write_bytes(doc)
    cpu_only = {
        "traceEvents": [
            _x("cpu_op", "aten::mm", 0, 5),
            _x("user_annotation", "execute_context_1(8)_generation_0(0)", 0, 9),
        ]
    }
    (tmp_path / "dp2_pp0_tp0_dcp0_ep2_rank2.1700000000000000003.pt.trace.json").write_text(
        json.dumps(cpu_only)
    )
    out = sp.summarize_dir(tmp_path)
    assert list(out["workers"]) == [
        "dp0_pp0_tp0_dcp0_ep0_rank0", "dp1_pp0_tp0_dcp0_ep1_rank1", "dp2_pp0_tp0_dcp0_ep2_rank2",
    ]  # fmt: skip
    assert out["workers"]["dp0_pp0_tp0_dcp0_ep0_rank0"] == out["workers"]["dp1_pp0_tp0_dcp0_ep1_rank1"]
    cpu = out["workers"]["dp2_pp0_tp0_dcp0_ep2_rank2"]
    assert cpu["kernels"] == 0 and cpu["steps"] == 0 and "CPU-only" in cpu["note"]
    mean = out["mean"]  # over the two workers with decode steps
    assert (mean["workers"], mean["steps"], mean["step_ms"], mean["busy_ms"], mean["idle_ms"]) == (
        2, 2, 0.1, 0.069, 0.031,
    )  # fmt: skip
    assert mean["categories_ms"]["moe"] == 0.04 and mean["gap_mean_us"]["before_moe"] == 5.0
    assert sp.main([str(tmp_path), "--json", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["mean"] == mean


def test_no_kernels_and_no_graphs_say_so():
    cpu = sp.mean_over_workers(
        {"rank0": sp.summarize_trace({"traceEvents": [_x("cpu_op", "aten::add", 0, 1)]})}
    )
    assert cpu["workers"] == 0 and "CPU-only" in cpu["note"]
    eager = sp.summarize_trace({"traceEvents": [_x("kernel", GEMM, 0, 5, 1), _x("kernel", MOE, 9, 5, 2)]})
    assert eager["kernels"] == 2 and eager["steps"] == 0 and "no decode window" in eager["note"]


def test_not_a_trace_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.pt.trace.json"
    bad.write_text(json.dumps({"events": []}))
    with pytest.raises(ValueError, match="not a Chrome trace"):
        sp.load_trace(bad)
    with pytest.raises(FileNotFoundError, match="no \\*.pt.trace.json"):
        sp.summarize_dir(tmp_path / "empty")


def test_vllm_step_annotations_both_forms():
    names = [
        "execute_context_2(2048)_generation_0(0)",  # simple form: prefill of two requests
        "execute_context_1(100)_generation_15(15)",  # mixed
        "execute_context_0(0)_generation_16(16)",
        "execute_16_context_0(sq0sk0sqsq0sqsk0)_generation_16(sq16sk16400sqsq16sqsk16400)",  # detailed form
        "execute_context_0(0)_generation_0(0)",  # a step that schedules nothing
        "execute_model",  # not a step annotation
    ]
    events = [_x("user_annotation", n, i, 1) for i, n in enumerate(names)] + [_x("cpu_op", names[2], 9, 1)]
    got = sp.summarize_trace({"traceEvents": events})["vllm_steps"]
    assert got == {"decode": 2, "prefill_or_mixed": 2, "decode_batch": {"16": 2}}


def test_a_trace_still_being_written_is_waited_for_within_the_deadline(tmp_path):
    full = gzip.compress(json.dumps(_trace()).encode())
    path = tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz"
    path.write_bytes(full[: len(full) // 2])  # torch writes the gzip in place: a truncated stream first
    with pytest.raises((EOFError, ValueError, OSError)):
        sp.load_when_complete(path, deadline=time.monotonic())  # a passed deadline: no waiting
    finisher = threading.Timer(0.5, path.write_bytes, args=(full,))
    finisher.start()
    try:
        doc = sp.load_when_complete(path, deadline=time.monotonic() + 30, poll_s=0.1)
    finally:
        finisher.join()
    assert sp.summarize_trace(doc)["steps"] == 2


def test_graph_kernels_without_correlation_fall_back_to_the_launch_count():
    # two launches, kernels whose correlation matches neither: whole span / 2, flagged as a fallback
    ev = [_x("cuda_runtime", "cudaGraphLaunch", t, 5, c, stream=1, pid=1) for t, c in ((0, 1), (100, 2))]
    ev += [_x("kernel", MOE, 1000, 40, 0), _x("kernel", GEMM, 1050, 10, 0), _x("kernel", GEMM, 1100, 20, 0)]
    s = sp.summarize_trace({"traceEvents": ev})
    assert s["graph_kernels"] == 0 and s["steps"] == 2 and s["step_marker"].startswith("fallback")
    assert (s["window_ms"], s["per_step"]["step_ms"], s["per_step"]["busy_ms"]) == (0.12, 0.06, 0.035)
    assert s["per_step"]["categories_ms"]["moe"] == 0.02 and s["per_step"]["step_ms_median"] is None
    gaps = {cls: g["per_step_us"] for cls, g in s["gaps"].items()}  # 10 after the moe kernel, then 40
    assert gaps == {
        "before_moe": 0.0,
        "after_moe": 5.0,
        "inside_moe": 0.0,
        "step_boundary": 0.0,
        "other": 20.0,
    }
    mean = sp.mean_over_workers({"w": s})
    assert mean["step_ms"] == 0.06 and mean["step_ms_median"] is None and "fallback" in mean["note"]
