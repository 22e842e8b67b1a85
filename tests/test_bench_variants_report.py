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
