"""scripts/kernel_trace.py's analysis of decoded trace events (no GPU): an fp8 GEMM0 task issues its stages in
two passes, and the producer's view of the task must be the whole task's (first pass's first issue, last pass's
last issue, the empty-slot waits of both), not the last pass's alone."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def kernel_trace():
    before = os.environ.get("FLASHMOE_TRACE")
    sys.path.insert(0, str(SCRIPTS))
    try:
        module = importlib.import_module("kernel_trace")
    finally:
        sys.path.remove(str(SCRIPTS))
    # Only its main() asks for the trace build: importing it must not switch the rest of the suite's builds.
    assert os.environ.get("FLASHMOE_TRACE") == before
    return module


def _task(kt, ns, index, gemm, n, splits=1, rows=1):
    return (ns, ns * 2, kt.PRODUCER_TASK, index, gemm << 24 | 3, splits << 28 | n << 8 | rows)


def test_a_two_pass_task_is_timed_from_its_first_pass_to_its_last(kernel_trace):
    kt = kernel_trace
    rate = 2  # cycles per ns, as the events' clocks below say
    producer = [
        (0, 0, 0, 0, 0, 0),  # phase event: start
        _task(kt, 1_000, 0, gemm=0, n=32),
        (1_200, 2_400, kt.PRODUCER_READY, 0, 0, 0),
        (1_500, 3_000, kt.PRODUCER_FIRST, 0, 0, 0),  # pass 0
        (5_000, 10_000, kt.PRODUCER_LAST, 600 * rate, 0, 0),
        (5_100, 10_200, kt.PRODUCER_FIRST, 0, 0, 0),  # pass 1
        (9_000, 18_000, kt.PRODUCER_LAST, 400 * rate, 0, 0),
        _task(kt, 10_000, 1, gemm=1, n=32),
        (10_300, 20_600, kt.PRODUCER_READY, 0, 0, 0),
        (10_400, 20_800, kt.PRODUCER_FIRST, 0, 0, 0),
        (12_000, 24_000, kt.PRODUCER_LAST, 100 * rate, 0, 0),
    ]
    trace = [[producer, [], []]]
    summary = kt.analyse(trace, H=2048, I=768, fp8=True)
    gemm0 = summary["producer_tiles"]["gemm0/N32"]
    assert gemm0["taken_to_ready"] == pytest.approx(0.2)
    assert gemm0["ready_to_first_issue"] == pytest.approx(0.3)  # pass 0's first issue, not pass 1's (3.9)
    assert gemm0["issue_span"] == pytest.approx(7.5)  # to pass 1's last issue
    assert gemm0["empty_wait"] == pytest.approx(1.0)  # 0.6 + 0.4 us
    gemm1 = summary["producer_tiles"]["gemm1/N32"]
    assert gemm1["ready_to_first_issue"] == pytest.approx(0.1)
    assert gemm1["empty_wait"] == pytest.approx(0.1)
    # Weight bytes: the fp8 GEMM0 task's two passes of 128 one-byte rows of K = H, and one GEMM1 tile of K = I.
    assert summary["gemm_weight_bytes"] == 128 * 2048 * 2 + 128 * 768


def test_the_streaming_timeline_spreads_each_task_over_its_issue_span(kernel_trace):
    kt = kernel_trace
    producer = [
        (0, 0, 0, 0, 0, 0),  # phase event: start (the launch's first event, t = 0)
        _task(kt, 1_000, 0, gemm=0, n=32),
        (1_500, 3_000, kt.PRODUCER_FIRST, 0, 0, 0),
        (9_000, 18_000, kt.PRODUCER_LAST, 0, 0, 0),
        _task(kt, 10_000, 1, gemm=1, n=32),
        (10_400, 20_800, kt.PRODUCER_FIRST, 0, 0, 0),
        (12_000, 24_000, kt.PRODUCER_LAST, 0, 0, 0),
    ]
    summary = kt.analyse([[producer, [], []]], H=2048, I=768, fp8=True)
    bins = {b["t_us"]: b for b in summary["streaming_timeline"]}
    assert sorted(bins) == [0, 2, 4, 6, 8, 10]
    gemm0_bytes, gemm1_bytes = 128 * 2048 * 2, 128 * 768
    # GEMM0 issues 1.5-9.0 us: a quarter of the first bin, whole bins 2-8, half of the bin at 8.
    assert bins[0]["sms_issuing"] == [0.2, 0.0]  # 0.25, rounded to one place
    assert bins[4]["sms_issuing"] == [1.0, 0.0]
    assert bins[8]["sms_issuing"] == [0.5, 0.0]
    assert bins[10]["sms_issuing"] == [0.0, 0.8]  # GEMM1 10.4-12.0 us
    # TB/s = bytes per us / 1e6.
    assert bins[4]["tb_per_s"] == pytest.approx(gemm0_bytes / 7.5 / 1e6, abs=1e-3)
    total = sum(b["tb_per_s"] * 1e6 * 2.0 for b in bins.values())
    assert total == pytest.approx(gemm0_bytes + gemm1_bytes, rel=1e-3)


def test_per_sm_rates_tell_a_per_sm_ceiling_from_hbm_saturation(kernel_trace):
    """Bins where all SMs issue against bins where few do: the traces of 2026-11-23 showed ~33 GB/s per SM in the
    full wave and only ~40 where 50 SMs issued (a per-SM ceiling); a stream bounded by HBM alone would show the
    sparse bins' SMs much faster."""
    timeline = [
        {"t_us": 0, "tb_per_s": 4.4, "sms_issuing": [132, 0]},
        {"t_us": 2, "tb_per_s": 4.2, "sms_issuing": [120, 6]},
        {"t_us": 4, "tb_per_s": 2.0, "sms_issuing": [30, 20]},
        {"t_us": 6, "tb_per_s": 1.2, "sms_issuing": [0, 30]},
        {"t_us": 8, "tb_per_s": 0.1, "sms_issuing": [0, 2]},  # too few SMs to say anything
        {"t_us": 10, "tb_per_s": 3.5, "sms_issuing": [105, 0]},  # neither full nor sparse
    ]
    r = kernel_trace.per_sm_rates(timeline)
    assert r["full_bins"] == 2 and r["sparse_bins"] == 2
    assert r["full_gb_per_s_per_sm"] == pytest.approx((4400 / 132 + 4200 / 126) / 2, abs=0.06)
    assert r["sparse_gb_per_s_per_sm"] == pytest.approx((2000 / 50 + 1200 / 30) / 2, abs=0.06)
    assert kernel_trace.per_sm_rates([]) == {
        "full_gb_per_s_per_sm": None,
        "full_bins": 0,
        "sparse_gb_per_s_per_sm": None,
        "sparse_bins": 0,
    }


def test_a_handover_splits_the_time_between_two_tiles(kernel_trace):
    """Tile 0 (GEMM0) then tile 1 (GEMM1) on one block: the consumer's epilogue steps, the producer's way to tile
    1's first stage, and that stage's landing, taken from the global time the event carries (not the clock)."""
    kt = kernel_trace
    producer = [
        (0, 0, 0, 0, 0, 0),
        _task(kt, 1_000, 0, gemm=0, n=128),
        (1_100, 0, kt.PRODUCER_ROWS_LOCATED, 0, 0, 0),
        (1_300, 0, kt.PRODUCER_FIRST_SLOT, 0, 0, 0),
        (1_400, 0, kt.PRODUCER_FIRST, 0, 0, 0),
        (8_000, 0, kt.PRODUCER_LAST, 0, 0, 0),
        _task(kt, 8_500, 1, gemm=1, n=128),
        (9_500, 0, kt.PRODUCER_ROWS_LOCATED, 0, 0, 0),
        (10_200, 0, kt.PRODUCER_FIRST_SLOT, 0, 0, 0),
        (10_300, 0, kt.PRODUCER_FIRST, 0, 0, 0),
        (14_000, 0, kt.PRODUCER_LAST, 0, 0, 0),
    ]
    landed_0, landed_1 = 2_000, 13_000
    consumer = [
        (1_050, 0, kt.CONSUMER_TASK, 0, 0, 0),
        (9_000, 0, kt.CONSUMER_FIRST_FULL, landed_0, 0, 0),  # recorded late, its landing in a | b << 32
        (9_000, 0, kt.CONSUMER_MMA, 0, 0, 0),
        (9_400, 0, kt.CONSUMER_STAGED, 0, 0, 0),
        (10_400, 0, kt.CONSUMER_STORED, 0, 0, 0),
        (11_400, 0, kt.CONSUMER_COUNTED, 0, 0, 0),
        (11_500, 0, kt.CONSUMER_EPILOGUE, 0, 0, 0),
        (11_700, 0, kt.CONSUMER_TASK, 1, 0, 0),
        (15_000, 0, kt.CONSUMER_FIRST_FULL, landed_1 & 0xFFFFFFFF, landed_1 >> 32, 0),
        (15_000, 0, kt.CONSUMER_MMA, 0, 0, 0),
        (15_500, 0, kt.CONSUMER_EPILOGUE, 0, 0, 0),
    ]
    summary = kt.analyse([[producer, consumer, []]], H=2048, I=768)
    h = summary["handovers"]["gemm0->gemm1"]
    assert h["count"] == 1
    m = h["median_us"]
    assert m["mma_done->staged"] == pytest.approx(0.4)
    assert m["staged->stored"] == pytest.approx(1.0)
    assert m["stored->counted"] == pytest.approx(1.0)
    assert m["counted->epilogue_done"] == pytest.approx(0.1)
    assert m["epilogue_done->next_task"] == pytest.approx(0.2)
    assert m["next_task->first_full"] == pytest.approx(1.3)
    assert m["producer: last_issue (from mma_done)"] == pytest.approx(-1.0)
    assert m["producer: ->rows_located"] == pytest.approx(1.0)
    assert m["producer: ->first_slot"] == pytest.approx(0.7)
    assert m["producer: first_issue (from mma_done)"] == pytest.approx(1.3)
    assert m["first stage: issue->landed"] == pytest.approx(2.7)
    tile0 = summary["consumer_tiles"]["gemm0/N128"]["median_us"]
    assert tile0["wait_first_stage"] == pytest.approx(0.95)  # the landing's own time, not the event's (7.95)
