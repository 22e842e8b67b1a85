"""benchmarks/experiments/layer_ab_report.py on layer_bench-shaped files: p50 per case and run, ratios to the
base's first run, a repeated base kept apart, cases told apart by dtype and padding ranks, and a results file
that keeps every run whole."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPORT = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments" / "layer_ab_report.py"
sys.path.insert(0, str(REPORT.parent))

import layer_ab_report  # noqa: E402


def _row(tokens: int, p50: float, dtype: str = "bf16", padding: int = 0, status: str = "ok") -> dict:
    latency = status == "ok"
    return {
        "model": "qwen3-30b-a3b",
        "dtype": dtype,
        "routing": "uniform",
        "tokens_per_rank": tokens,
        "padding_ranks": padding,
        "variant": "flashmoe",
        "mode": "serving",
        "status": status,
        "latency_p10_us": p50 * 0.96 if latency else None,
        "latency_p50_us": p50 if latency else None,
        "latency_p90_us": p50 * 1.05 if latency else None,
        "x_floor": p50 / 20.0 if latency else None,
    }


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text(
        json.dumps({"schema": "flashmoe.layer_bench/1", "config": {"world_size": 2}, "rows": rows})
    )
    return str(path)


def test_table_in_run_order_against_the_first_base_run(tmp_path):
    a = _write(tmp_path / "a.json", [_row(1, 60.0), _row(8, 100.0)])
    b = _write(
        tmp_path / "b.json", [_row(1, 48.0), _row(8, 125.0), _row(1, 45.0, padding=1), _row(1, 40.0, "fp8")]
    )
    c = _write(
        tmp_path / "c.json",
        [_row(1, 61.0), _row(8, 99.0), _row(8, 0.0, status="error"), _row(1, 50.0, "fp8")],
    )
    runs = layer_ab_report.load_runs([f"base={a}", f"v2={b}", f"base={c}"])
    assert [name for name, _ in runs] == ["base", "v2", "base.run2"]
    names, rows = layer_ab_report.table(runs, "base")
    by = {(r["dtype"], r["tokens_per_rank"], r["padding_ranks"]): r for r in rows}
    assert by[("bf16", 1, 0)]["p50_us"] == {"base": 60.0, "v2": 48.0, "base.run2": 61.0}
    assert by[("bf16", 1, 0)]["speedup_vs_base"]["v2"] == pytest.approx(1.25)
    assert by[("bf16", 8, 0)]["speedup_vs_base"]["v2"] == pytest.approx(0.8)
    assert by[("bf16", 8, 0)]["p10_p90_us"]["v2"] == [120.0, 131.25]
    # fp8 and a padding rank are other cases, not the bf16 T = 1 one. The fp8 case's base is the first base run
    # that measured it (the second here); a case no base run measured gets no ratio; a failed row gives no number.
    assert by[("fp8", 1, 0)]["p50_us"] == {"v2": 40.0, "base.run2": 50.0}
    assert by[("fp8", 1, 0)]["speedup_vs_base"] == {"v2": pytest.approx(1.25), "base.run2": 1.0}
    assert by[("bf16", 1, 1)]["p50_us"] == {"v2": 45.0} and by[("bf16", 1, 1)]["speedup_vs_base"] == {}
    assert "base.run2" in by[("bf16", 8, 0)]["p50_us"] and by[("bf16", 8, 0)]["p50_us"]["base.run2"] == 99.0
    table = layer_ab_report.markdown(names, rows)
    assert "| qwen3-30b-a3b bf16 uniform T=8 | 100.0 (1.00x) | 125.0 (0.80x) | 99.0 (1.01x) |" in table
    assert "| qwen3-30b-a3b bf16 uniform T=1 +1 padding | - | 45.0 | - |" in table


def test_cli_writes_the_results_file_and_refuses_bad_arguments(tmp_path):
    a = _write(tmp_path / "a.json", [_row(2048, 800.0)])
    b = _write(tmp_path / "b.json", [_row(2048, 740.0)])
    out = tmp_path / "results.json"
    cmd = [
        sys.executable,
        str(REPORT),
        f"base={a}",
        f"ring={b}",
        "--json",
        str(out),
        "--machine",
        "nvidia-h200-x2",
    ]
    cmd += ["--commit", "abc1234", "--what", "put ring", "--command", "torchrun ..."]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "740.0 (1.08x)" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["machine"] == "nvidia-h200-x2" and doc["commit"] == "abc1234" and doc["base"] == "base"
    assert doc["rows"][0]["speedup_vs_base"]["ring"] == pytest.approx(800.0 / 740.0, abs=1e-3)
    assert doc["runs"]["ring"]["rows"][0]["latency_p50_us"] == 740.0  # each run kept whole
    r = subprocess.run(
        [sys.executable, str(REPORT), f"ring={b}", "--base", "base"], capture_output=True, text=True
    )
    assert r.returncode != 0 and "no run named 'base'" in r.stderr
    r = subprocess.run([sys.executable, str(REPORT), b], capture_output=True, text=True)
    assert r.returncode != 0 and "is not NAME=FILE" in r.stderr
