"""benchmarks/experiments/variants_report.py on kernel_check-shaped files: medians, ratios to the base's first run,
runs in execution order (a bracketing second base run kept apart), and a results file that says what it holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPORT = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments" / "variants_report.py"
sys.path.insert(0, str(REPORT.parent))

import variants_report  # noqa: E402


def _write(directory: Path, name: str, p50_by_case: dict, mtime: int) -> None:
    timings = [
        {"shape": shape, "tokens": tokens, "flashmoe_us": [p50 * 0.97, p50, p50 * 1.04]}
        for (shape, tokens), p50 in p50_by_case.items()
    ]
    f = directory / f"var_{name}.json"
    f.write_text(
        json.dumps({"device": "NVIDIA H200", "torch": "2.11", "build": f"build {name}", "timings": timings})
    )
    os.utime(f, (mtime, mtime))


def test_table_takes_medians_in_run_order_against_the_first_base_run(tmp_path):
    q = "qwen3-30b/ep4"
    _write(tmp_path, "base", {(q, 1): 50.0, (q, 8): 100.0}, 100)
    _write(tmp_path, "no_prefetch", {(q, 1): 40.0, (q, 8): 125.0}, 200)
    _write(tmp_path, "base.run2", {(q, 1): 51.0, (q, 8): 99.0}, 300)
    _write(tmp_path, "only_t1", {(q, 1): 25.0}, 250)
    runs = variants_report.load_runs(tmp_path)
    assert [name for name, _ in runs] == ["base", "no_prefetch", "only_t1", "base.run2"]
    names, rows = variants_report.table(runs, "base")
    by_t = {row["tokens"]: row for row in rows}
    assert by_t[1]["us"] == {"base": 50.0, "no_prefetch": 40.0, "only_t1": 25.0, "base.run2": 51.0}
    assert by_t[1]["speedup_vs_base"]["no_prefetch"] == pytest.approx(1.25)
    assert by_t[8]["speedup_vs_base"]["no_prefetch"] == pytest.approx(0.8)
    assert "only_t1" not in by_t[8]["us"]  # a case a run did not time stays empty, not zero
    table = variants_report.markdown(names, rows)
    assert "| qwen3-30b/ep4 | 8 | 100.0 (1.00x) | 125.0 (0.80x) | - | 99.0 (1.01x) |" in table


def test_cli_writes_the_results_file_and_refuses_an_unknown_base(tmp_path):
    _write(tmp_path, "base", {("dsv3/ep4", 8): 800.0}, 100)
    _write(tmp_path, "two_pass", {("dsv3/ep4", 8): 640.0}, 200)
    out = tmp_path / "results.json"
    cmd = [
        sys.executable,
        str(REPORT),
        str(tmp_path),
        "--json",
        str(out),
        "--commit",
        "abc1234",
        "--what",
        "A/B",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert (doc["commit"], doc["machine"], doc["base"]) == ("abc1234", "NVIDIA H200", "base")
    assert [r["name"] for r in doc["runs"]] == ["base", "two_pass"]
    assert doc["rows"][0]["speedup_vs_base"]["two_pass"] == pytest.approx(1.25)
    bad = subprocess.run([*cmd[:3], "--base", "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "no run named 'nope'" in bad.stderr


def test_trace_files_are_summarised_into_the_results_file(tmp_path):
    """gemm_variants --trace leaves trace_<run>.json (raw events); the results file carries each one's analysis:
    the streaming timeline and per-SM rates, not the raw events or the steps table."""
    env_before = os.environ.get("FLASHMOE_TRACE")
    out = variants_report.trace_summaries(tmp_path)  # no trace files yet: nothing imported, nothing set
    assert out == {} and os.environ.get("FLASHMOE_TRACE") == env_before
    sys.path.insert(0, str(REPORT.parents[2] / "scripts"))
    try:
        import kernel_trace as kt
    finally:
        sys.path.remove(str(REPORT.parents[2] / "scripts"))
    producer = [
        [0, 0, 0, 0, 0, 0],  # the launch's start
        [1_000, 2_000, kt.PRODUCER_TASK, 0, 0 << 24 | 3, 1 << 28 | 32 << 8 | 1],
        [1_500, 3_000, kt.PRODUCER_FIRST, 0, 0, 0],
        [9_000, 18_000, kt.PRODUCER_LAST, 0, 0, 0],
    ]
    doc = {
        "shape": "qwen3-30b/ep4",
        "dtype": "fp8",
        "H": 2048,
        "I": 768,
        "cases": {"8": {"rel_err_vs_reference": 0.004, "events": [[producer, [], []]]}},
    }
    (tmp_path / "trace_fp8_no_wgmma.json").write_text(json.dumps(doc))
    out = variants_report.trace_summaries(tmp_path)
    assert os.environ.get("FLASHMOE_TRACE") == env_before
    case = out["fp8_no_wgmma"]["cases"]["8"]
    assert out["fp8_no_wgmma"]["dtype"] == "fp8" and case["rel_err_vs_reference"] == 0.004
    assert "transitions" not in case and "events" not in case
    issued = sum(b["tb_per_s"] * 1e6 * 2.0 for b in case["streaming_timeline"])
    assert issued == pytest.approx(128 * 2048 * 2, rel=1e-3)  # the fp8 GEMM0 task's two passes of weights
    assert set(case["per_sm_rates"]) == {
        "full_gb_per_s_per_sm",
        "full_bins",
        "sparse_gb_per_s_per_sm",
        "sparse_bins",
    }
