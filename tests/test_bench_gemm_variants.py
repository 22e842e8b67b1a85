"""benchmarks/experiments/gemm_variants.py (no GPU): every timing variant's source patches, and every kernel diff
kept under benchmarks/experiments/diffs/, still apply to the checkout, each piece exactly once. A patch whose text
has moved fails here instead of on a lent GPU machine, and a text that also occurs elsewhere (the producer's
deeper-indented copy of a consumer's wait, say) would patch both."""

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


def _copy_of(tmp_path, rels):
    for rel in rels:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((REPO / rel).read_text())


def test_every_kept_kernel_diff_applies(gemm_variants, tmp_path):
    diffs = sorted((REPO / "benchmarks" / "experiments" / "diffs").glob("*.diff"))
    assert diffs, "no diff kept: remove this test with the directory"
    for path in diffs:
        text = path.read_text()
        rels = [line[6:] for line in text.splitlines() if line.startswith("+++ b/")]
        tree = tmp_path / path.stem
        _copy_of(tree, rels)
        gemm_variants.apply_diff(tree, text)
        for rel in rels:
            assert (tree / rel).read_text() != (REPO / rel).read_text(), (path.name, rel)


def test_a_diff_whose_context_moved_is_refused(gemm_variants, tmp_path):
    (tmp_path / "a.cuh").write_text("one\ntwo\nthree\n")
    ok = "--- a/a.cuh\n+++ b/a.cuh\n@@ -1,3 +1,3 @@\n one\n-two\n+TWO\n three\n"
    gemm_variants.apply_diff(tmp_path, ok)
    assert (tmp_path / "a.cuh").read_text() == "one\nTWO\nthree\n"
    with pytest.raises(AssertionError):  # the old lines are no longer there
        gemm_variants.apply_diff(tmp_path, ok)


def test_trace_option_is_taken_out_of_kernel_checks_arguments(gemm_variants):
    assert gemm_variants.trace_option(["--dtype", "fp8"]) == (None, ["--dtype", "fp8"])
    assert gemm_variants.trace_option(["--dtype", "fp8", "--trace", "8,128", "--replays", "5"]) == (
        "8,128",
        ["--dtype", "fp8", "--replays", "5"],
    )
    with pytest.raises(SystemExit):
        gemm_variants.trace_option(["--trace"])
