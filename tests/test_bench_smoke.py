"""End-to-end: layer_bench.py under torchrun with two gloo ranks on the CPU (tiny shape)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import bench_import
import pytest
from moe_bench import results

SCRIPT = bench_import.BENCH_DIR / "layer_bench.py"


def torchrun(out: Path, *extra: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           "--device", "cpu", "--out", str(out), *extra]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks: the session this call started
        stdout, _ = proc.communicate()
        pytest.fail(f"layer_bench did not finish in {timeout:.0f} s:\n{stdout[-3000:]}")
    assert proc.returncode == 0, stdout[-5000:]
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout)


def test_two_rank_cpu_run_checks_and_times_every_variant(tmp_path):
    out = tmp_path / "smoke.json"
    run = torchrun(
        out, "--tokens", "1,16", "--min-iters", "4", "--max-iters", "8", "--warmup", "1", "--max-sets", "4",
        "--mode", "flushed,serving",
    )  # fmt: skip
    doc = results.load(out)  # validates the schema
    assert doc["complete"] and doc["machine"]["tag"] == "cpu-2rank" and doc["config"]["world_size"] == 2
    assert doc["rates"]["link_GBps"] > 0 and "gloo" in doc["rates"]["link_method"]
    assert doc["config"]["modes"] == ["flushed", "serving"] and doc["config"]["serving"]["layers"] == {
        "tiny": 3
    }
    rows = doc["rows"]
    assert len(rows) == 2 * 2 * 2 * 8  # modes x tokens x routings x variants
    # vLLM's fused_experts is a Triton kernel: no CPU run, and the row says so.
    vllm = [r for r in rows if r["variant"] == "vllm_fused"]
    assert {r["status"] for r in vllm} == {"unavailable"}
    assert all("no CUDA device" in r["note"] and "Triton" in r["note"] for r in vllm)
    # DeepEP's low-latency kernels need Hopper GPUs (and deep_ep, which this machine may not have).
    deepep = [r for r in rows if r["variant"].startswith("deepep_ll")]
    assert len(deepep) == 2 * 2 * 2 * 3 and {r["status"] for r in deepep} == {"unavailable"}
    assert all("deep_ep not importable" in r["note"] or "no CUDA device" in r["note"] for r in deepep)
    timed = [r for r in rows if r["variant"] != "vllm_fused" and r not in deepep]
    assert {r["status"] for r in timed} == {"ok"}, [r["note"] for r in timed if r["status"] != "ok"]
    for r in timed:
        assert r["check_rel_l2"] < 1e-2 and r["iters"] % r["sets"] == 0 and 4 <= r["iters"] <= 8
        assert r["x_floor"] == pytest.approx(r["latency_us"] / r["floor_us"])
        assert r["floor_us"] == max(r["t_gemm_us"], r["t_weights_us"], r["t_link_us"])
        assert r["latency_p10_us"] <= r["latency_p50_us"] == r["latency_us"] <= r["latency_p90_us"]
        # The busiest rank computes at least the mean of the 2·T·k pairs over 2 ranks.
        assert r["gemm_rows"] >= r["tokens_per_rank"] * r["top_k"]
        flops = 6 * r["gemm_rows"] * r["hidden"] * r["intermediate"]
        assert r["tflops"] == pytest.approx(flops / (r["latency_us"] * 1e-6) / 1e12)
        assert r["graph"] is False  # no CUDA graphs on a CPU
        assert r["layers"] == (3 if r["mode"] == "serving" else 1)
    # Serving checked every one of its 3 layers (each with its own weights) against its own reference.
    serving = [r for r in timed if r["mode"] == "serving"]
    assert len(serving) == 2 * 2 * 4
    fm = [r for r in rows if r["variant"] == "flashmoe"]
    assert all(r["backend"] == "reference" and "reference backend" in r["note"] for r in fm)
    # The baselines really differ from the reference: their check error is bf16 rounding, not zero.
    assert all(r["check_rel_l2"] > 0 for r in rows if r["variant"] in ("all_to_all", "allgather_rs"))
    # The table is printed last, one per mode, with the p90/p10 spread.
    assert "[flushed]" in run.stdout and "[serving (per layer of a 3-layer step)]" in run.stdout
    assert "flashmoe p50 us (x floor) p90/p10" in run.stdout and f"{len(rows)} rows -> {out}" in run.stdout


def test_one_rank_compute_comparison_uses_the_same_rows(tmp_path):
    """World 1 (one process, no torchrun): flashmoe and compute_only on identical rows, TFLOP/s and ratio."""
    out = tmp_path / "w1.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out), "--tokens", "8", "--routing", "uniform",
           "--mode", "serving", "--variants", "flashmoe,compute_only", "--per-rank-of-ep", "2", "--layers", "2",
           "--min-iters", "4", "--max-iters", "4", "--warmup", "1", "--max-sets", "2"]  # fmt: skip
    run = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    fm, co = results.load(out)["rows"]
    assert fm["variant"] == "flashmoe" and co["variant"] == "compute_only"
    assert (
        fm["num_experts"] == 8 and fm["model_num_experts"] == 16 and "E/2 per rank, as at EP2" in fm["note"]
    )
    assert fm["layers"] == co["layers"] == 2 and fm["status"] == co["status"] == "ok"
    assert fm["gemm_rows"] == co["gemm_rows"] == 8 * fm["top_k"]  # world 1: every (token, expert) pair
    assert fm["tflops_vs_compute_only"] == pytest.approx(co["latency_us"] / fm["latency_us"])
    assert co["tflops_vs_compute_only"] is None
    assert "[world 1: expert GEMM throughput" in run.stdout


def test_time_budget_stops_cleanly_and_still_writes_the_file(tmp_path):
    out = tmp_path / "budget.json"
    run = torchrun(out, "--max-minutes", "0", "--tokens", "1")
    doc = json.loads(out.read_text())
    assert results.validate(doc) == []
    assert doc["complete"] is False and "max-minutes" in doc["stopped_reason"] and doc["rows"] == []
    assert "stopped" in run.stdout


def test_idle_dp_ranks_get_zeros_from_flashmoe_and_the_floor_counts_real_tokens(tmp_path):
    """--padding-ranks 1: rank 1 runs dummy steps. flashmoe must return zeros there (checked: the row would be
    'wrong' otherwise) while the baseline computes rank 1's tokens as vLLM's paths do; the floor and the work
    figures count rank 0's tokens only."""
    out = tmp_path / "padding.json"
    torchrun(
        out, "--tokens", "8", "--routing", "uniform", "--variants", "flashmoe,allgather_rs", "--mode", "serving",
        "--padding-ranks", "1", "--min-iters", "2", "--max-iters", "4", "--warmup", "1", "--max-sets", "2",
    )  # fmt: skip
    doc = results.load(out)
    assert doc["config"]["padding_ranks"] == 1
    rows = {r["variant"]: r for r in doc["rows"]}
    assert {r["status"] for r in rows.values()} == {"ok"}, [r["note"] for r in rows.values()]
    assert all(r["padding_ranks"] == 1 for r in rows.values())
    # Only rank 0's 8 tokens x top-k pairs are real work: the busiest rank holds at most all of them.
    assert 0 < rows["flashmoe"]["gemm_rows"] <= 8 * rows["flashmoe"]["top_k"]
    assert rows["flashmoe"]["check_rel_l2"] < 1e-2 and rows["allgather_rs"]["check_rel_l2"] < 1e-2
    # The same run without idle ranks: more real work, a higher floor.
    full = tmp_path / "full.json"
    torchrun(
        full, "--tokens", "8", "--routing", "uniform", "--variants", "flashmoe", "--mode", "serving",
        "--min-iters", "2", "--max-iters", "4", "--warmup", "1", "--max-sets", "2",
    )  # fmt: skip
    all_real = results.load(full)["rows"][0]
    assert all_real["padding_ranks"] == 0 and all_real["gemm_rows"] > rows["flashmoe"]["gemm_rows"]
