"""The diagnosis of a failed bitwise repeat (tests/tolerances.py repeat_difference, reported by
scripts/kernel_check.py and the matrix's determinism and variant checks; no GPU): which rows differ, by how much,
which call is the odd one out against the reference, and the experts of those rows."""

from __future__ import annotations

import pytest
import torch
from tolerances import repeat_difference


def test_a_failed_repeat_names_its_rows_experts_and_the_odd_call():
    gen = torch.Generator().manual_seed(3)
    ref = torch.randn(6, 16, generator=gen).to(torch.bfloat16)
    first, second = ref.clone(), ref.clone()
    second[2, 3] += 0.5
    second[4, :] += 0.25
    ids = torch.arange(12, dtype=torch.int32).view(6, 2)
    d = repeat_difference(first, second, ref, ids)
    assert (d["differing_rows"], d["first_differing_rows"], d["their_experts"]) == (
        2,
        [2, 4],
        [[4, 5], [8, 9]],
    )
    assert d["differing_elements"] == 17 and d["max_abs_diff"] == pytest.approx(0.5, rel=0.02)
    assert d["first_call_vs_ref"] == 0.0 and d["other_call_vs_ref"] > 0.05  # the second call went wrong
