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
        out, "--tokens", "1,16", "--min-iters", "4", "--max-iters", "8", "--warmup", "1", "--max-sets", "4"
    )
    doc = results.load(out)  # validates the schema
    assert doc["complete"] and doc["machine"]["tag"] == "cpu-2rank" and doc["config"]["world_size"] == 2
    assert doc["rates"]["link_GBps"] > 0 and "gloo" in doc["rates"]["link_method"]
    rows = doc["rows"]
    assert len(rows) == 2 * 2 * 4  # tokens x routings x variants
    assert {r["status"] for r in rows} == {"ok"}, [r["note"] for r in rows if r["status"] != "ok"]
    for r in rows:
        assert r["check_rel_l2"] < 1e-2 and r["iters"] % r["sets"] == 0 and 4 <= r["iters"] <= 8
        assert r["x_floor"] == pytest.approx(r["latency_us"] / r["floor_us"])
        assert r["floor_us"] == max(r["t_gemm_us"], r["t_weights_us"], r["t_link_us"])
    fm = [r for r in rows if r["variant"] == "flashmoe"]
    assert all(r["backend"] == "reference" and "reference backend" in r["note"] for r in fm)
    # The baselines really differ from the reference: their check error is bf16 rounding, not zero.
    assert all(r["check_rel_l2"] > 0 for r in rows if r["variant"] in ("all_to_all", "allgather_rs"))
    # The table is printed last.
    assert "flashmoe us (x floor)" in run.stdout and f"{len(rows)} rows -> {out}" in run.stdout


def test_time_budget_stops_cleanly_and_still_writes_the_file(tmp_path):
    out = tmp_path / "budget.json"
    run = torchrun(out, "--max-minutes", "0", "--tokens", "1")
    doc = json.loads(out.read_text())
    assert results.validate(doc) == []
    assert doc["complete"] is False and "max-minutes" in doc["stopped_reason"] and doc["rows"] == []
    assert "stopped" in run.stdout
