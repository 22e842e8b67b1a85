"""benchmarks/experiments/gemm_variants.py (no GPU): every timing variant's source patches still apply to the
checkout, each exactly once. A patch whose text has moved fails here instead of on a lent GPU machine, and a
text that also occurs elsewhere (the producer's deeper-indented copy of a consumer's wait, say) would patch
both."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gemm_variants():
    sys.path.insert(0, str(REPO / "benchmarks" / "experiments"))
    try:
        return importlib.import_module("gemm_variants")
    finally:
        sys.path.remove(str(REPO / "benchmarks" / "experiments"))


def test_every_variant_patches_the_sources_exactly_once(gemm_variants, tmp_path):
    assert "base" in gemm_variants.VARIANTS and len(gemm_variants.VARIANTS) > 1
    for name, patches in gemm_variants.VARIANTS.items():
        tree = tmp_path / name
        for rel, _, _ in patches:
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            if not (tree / rel).exists():
                (tree / rel).write_text((REPO / rel).read_text())
        for rel, old, new in patches:
            assert old != new, (name, rel)
            gemm_variants.patch(tree, rel, old, new)  # asserts the text occurs exactly once
        for rel, _, _ in patches:
            assert (tree / rel).read_text() != (REPO / rel).read_text(), (name, rel)


def test_a_patch_text_found_twice_is_refused(gemm_variants, tmp_path):
    (tmp_path / "a.cuh").write_text("  wait();\n      wait();\n")
    with pytest.raises(AssertionError):
        gemm_variants.patch(tmp_path, "a.cuh", "  wait();\n", "")
    gemm_variants.patch(tmp_path, "a.cuh", "      wait();\n", "")
    assert (tmp_path / "a.cuh").read_text() == "  wait();\n"
