"""benchmarks/experiments/ncu_stalls.py on a small ncu source-page export and nvdisasm listing of the same shape as
the real ones: per-function tables, samples grouped by execution count, CUDA lines matched by opcode (and refused
for another build), barrier samples kept apart."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments" / "ncu_stalls.py"
sys.path.insert(0, str(TOOL.parent))

import ncu_stalls  # noqa: E402

HEADER = ["Address", "Source", ncu_stalls.SAMPLES, ncu_stalls.EXECUTED, "stall_barrier", "stall_long_sb",
          "stall_no_inst", "stall_barrier (Not Issued)"]  # fmt: skip

# (source, samples, executed, barrier, long_sb, no_inst) per instruction
CONSUMER = [
    ("VIADD R1, R1, 0xffffffa8", 9, 100, 0, 0, 9),  # per tile: entry
    ("@P0 BRA 0x7f00", 40, 1600, 0, 40, 0),  # K loop: waiting for a stage
    ("QGMMA.64x32x32.F32.E4M3.E4M3 R44, gdesc[UR24], RZ, !UP", 5, 1600, 5, 0, 0),
    ("R2UR UR24, R10", 30, 100, 0, 0, 30),  # per tile: epilogue
    ("RET.ABS.NODEC R20, 0x0", 0, 100, 0, 0, 0),
]
KERNEL = [("BAR.SYNC.DEFER_BLOCKING 0x0", 70, 12, 70, 0, 0), ("EXIT", 1, 12, 0, 0, 1)]

SASS = """\
.text._Z8consumerv:
        .type _Z8consumerv,@function
_Z8consumerv:
\t//## File "/x/csrc/flashmoe/gemm.cuh", line 604
        /*0000*/                   VIADD R1, R1, 0xffffffa8 ;
\t//## File "/x/csrc/flashmoe/gemm.cuh", line 188
        /*0010*/              @P0  BRA `(.L_x_1) ;
\t//## File "/x/csrc/flashmoe/hopper.cuh", line 107
        /*0020*/                   QGMMA.64x32x32.F32.E4M3.E4M3 R44, gdesc[UR24], RZ, !UP0, gsb0 ;
\t//## File "/x/csrc/flashmoe/gemm.cuh", line 461
        /*0030*/                   R2UR UR24, R10 ;
        /*0040*/                   RET.ABS.NODEC R20 0x0 ;
.text._Z6kernelv:
_Z6kernelv:
        /*0000*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0010*/                   EXIT ;
"""


def _write_csv(path: Path, functions: dict[str, list[tuple]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        for name, rows in functions.items():
            w.writerow(["Kernel Name", name])
            w.writerow(HEADER)
            for i, (src, samples, executed, barrier, long_sb, no_inst) in enumerate(rows):
                w.writerow(
                    [f"0x{0x7F00 + 16 * i:x}", src, samples, f"{executed:,}", barrier, long_sb, no_inst, 0]
                )


def test_report_groups_samples_by_function_count_and_line(tmp_path):
    _write_csv(
        tmp_path / "p.csv",
        {"consumer<(bool)1, (int)32>(args)": CONSUMER, "moe_layer_kernel<1>(Params)": KERNEL},
    )
    (tmp_path / "d.sass").write_text(SASS)
    rep = ncu_stalls.report(tmp_path / "p.csv", tmp_path / "d.sass")
    assert rep["samples"] == 84 + 71
    consumer = rep["functions"]["consumer<(bool)1, (int)32>(args)"]
    assert consumer["lines_matched"] and consumer["samples"] == 84
    assert consumer["samples_without_barrier"] == 79
    assert consumer["by_reason"] == {"long_sb": 40, "no_inst": 39, "barrier": 5}
    per_tile, loop = (
        next(c for c in consumer["by_execution_count"] if c["executed"] == n) for n in (100, 1600)
    )
    assert (per_tile["instructions"], per_tile["samples"], per_tile["top"]) == (3, 39, {"no_inst": 39})
    assert (loop["instructions"], loop["samples"]) == (2, 45)
    lines = {c["line"]: c["samples"] for c in consumer["by_line"]}
    assert lines == {"gemm.cuh:188": 40, "gemm.cuh:461": 30, "gemm.cuh:604": 9, "hopper.cuh:107": 5}
    kernel = rep["functions"]["moe_layer_kernel<1>(Params)"]
    assert kernel["samples_without_barrier"] == 1 and kernel["share"] == round(71 / 155, 4)


def test_another_builds_listing_maps_no_lines(tmp_path):
    changed = [list(r) for r in CONSUMER]
    changed[3][0] = "MOV R3, R10"  # same length, another instruction: not this build
    _write_csv(tmp_path / "p.csv", {"consumer(args)": [tuple(r) for r in changed]})
    (tmp_path / "d.sass").write_text(SASS)
    rep = ncu_stalls.report(tmp_path / "p.csv", tmp_path / "d.sass")
    assert rep["functions"]["consumer(args)"]["lines_matched"] is False
    assert rep["functions"]["consumer(args)"]["by_line"] == []


def test_cli_filters_functions_and_writes_json(tmp_path):
    _write_csv(tmp_path / "p.csv", {"consumer(args)": CONSUMER, "moe_layer_kernel<1>(Params)": KERNEL})
    out = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            str(tmp_path / "p.csv"),
            "--function",
            "consumer",
            "--json",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "consumer" in out and "moe_layer_kernel" not in out
    assert list(json.loads((tmp_path / "r.json").read_text())["functions"]) == ["consumer(args)"]


def test_compare_reports_what_moved_between_two_builds(tmp_path):
    after = [list(r) for r in CONSUMER]
    after[1][1:] = [10, 1600, 0, 10, 0]  # the K loop's stage wait: 40 -> 10 samples
    after[3][1:] = [35, 100, 0, 0, 35]  # the epilogue's fetch: 30 -> 35
    _write_csv(tmp_path / "a.csv", {"consumer(args)": CONSUMER, "moe_layer_kernel<1>(Params)": KERNEL})
    _write_csv(tmp_path / "b.csv", {"consumer(args)": [tuple(r) for r in after]})
    (tmp_path / "d.sass").write_text(SASS)
    cmp = ncu_stalls.compare(
        ncu_stalls.report(tmp_path / "a.csv", tmp_path / "d.sass", top=1 << 30),
        ncu_stalls.report(tmp_path / "b.csv", tmp_path / "d.sass", top=1 << 30),
    )
    assert cmp["samples"] == [155, 59] and list(cmp["functions"]) == ["consumer(args)"]  # in both only
    f = cmp["functions"]["consumer(args)"]
    assert (
        f["samples"] == [84, 59]
        and f["by_reason"]["long_sb"] == [40, 10]
        and f["by_reason"]["no_inst"] == [39, 44]
    )
    assert f["lines_changed"] == [
        {"line": "gemm.cuh:188", "samples": [40, 10], "delta": -30},
        {"line": "gemm.cuh:461", "samples": [30, 35], "delta": 5},
    ]
    out = subprocess.run(
        [sys.executable, str(TOOL), str(tmp_path / "a.csv"), "--sass", str(tmp_path / "d.sass"),
         "--against", str(tmp_path / "b.csv"), "--against-sass", str(tmp_path / "d.sass")],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "consumer(args): 84 -> 59 samples" in out and "gemm.cuh:188" in out
