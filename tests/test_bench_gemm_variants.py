"""benchmarks/experiments/gemm_variants.py (no GPU): every timing variant's source patches, and every kernel diff
kept under benchmarks/experiments/diffs/, still apply to the checkout, each piece exactly once. A patch whose text
has moved fails here instead of on a lent GPU machine, and a text that also occurs elsewhere (the producer's
deeper-indented copy of a consumer's wait, say) would patch both."""

from __future__ import annotations

import importlib
import re
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


def test_every_kept_kernel_diff_is_indexed(gemm_variants):
    """diffs/README.md's table names every kept and refuted diff, and nothing else: a result's code stays findable."""
    root = REPO / "benchmarks" / "experiments" / "diffs"
    files = {p.relative_to(root).as_posix() for p in root.rglob("*.diff")}
    assert any(f.startswith("refuted/") for f in files)
    listed = set(re.findall(r"^\| `([^`]+\.diff)` \|", (root / "README.md").read_text(), flags=re.M))
    assert listed == files, (sorted(listed - files), sorted(files - listed))


def test_every_kept_kernel_diff_applies(gemm_variants, tmp_path):
    # None may be waiting (all measured); each one kept must apply to main alone.
    diffs = sorted((REPO / "benchmarks" / "experiments" / "diffs").glob("*.diff"))
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


def test_a_diff_can_add_a_file_but_not_overwrite_one(gemm_variants, tmp_path):
    # `git diff` (with `git add -N`) writes a new header as a hunk of added lines from /dev/null.
    (tmp_path / "a.cuh").write_text("one\n")
    diff = (
        "diff --git a/new.cuh b/new.cuh\nnew file mode 100644\n--- /dev/null\n+++ b/new.cuh\n@@ -0,0 +1,3 @@\n"
        "+// role\n+\n+int x;\n"
        '--- a/a.cuh\n+++ b/a.cuh\n@@ -1 +1,2 @@\n one\n+#include "new.cuh"\n'
    )
    gemm_variants.apply_diff(tmp_path, diff)
    assert (tmp_path / "new.cuh").read_text() == "// role\n\nint x;\n"
    assert (tmp_path / "a.cuh").read_text() == 'one\n#include "new.cuh"\n'
    with pytest.raises(AssertionError):  # applied again: the file exists now
        gemm_variants.apply_diff(tmp_path, diff)


def test_trace_option_is_taken_out_of_kernel_checks_arguments(gemm_variants):
    assert gemm_variants.trace_option(["--dtype", "fp8"]) == (None, ["--dtype", "fp8"])
    assert gemm_variants.trace_option(["--dtype", "fp8", "--trace", "8,128", "--replays", "5"]) == (
        "8,128",
        ["--dtype", "fp8", "--replays", "5"],
    )
    with pytest.raises(SystemExit):
        gemm_variants.trace_option(["--trace"])


def test_combined_variants_apply_each_part_in_order(gemm_variants, tmp_path):
    """``a+b`` applies both variants' patches to one tree (the weights-only stream: no wgmma, no token rows)."""
    root = gemm_variants.variant_tree("fp8_no_wgmma+no_cp_async", tmp_path / "both")
    gemm = (root / "csrc/flashmoe/gemm.cuh").read_text()
    for part in ("fp8_no_wgmma", "no_cp_async"):
        for rel, old, new in gemm_variants.VARIANTS[part]:
            text = (root / rel).read_text()
            assert new in text and (not old or old not in text or old in new), (part, rel)
    assert "constexpr int kFullArrivals = 1;" in gemm
    with pytest.raises(SystemExit, match="unknown variant 'nope'"):
        gemm_variants.variant_tree("base+nope", tmp_path / "bad")


def test_a_diff_combines_with_registered_variants(gemm_variants, tmp_path):
    """``diff=FILE+name``: the diff first, then the registered variant's patches on the tree it left; the run is
    named after the diff's stem and the variant (the refuted producer-roles + probe runs of 2026-11-23)."""
    rel = "csrc/flashmoe/gemm.cuh"
    line = next(l for l in (REPO / rel).read_text().splitlines() if l.startswith("constexpr int kRowBytesK"))
    diff = tmp_path / "row-bytes-comment.diff"
    diff.write_text(f"--- a/{rel}\n+++ b/{rel}\n@@ -1,1 +1,1 @@\n-{line}\n+{line}  // changed by the diff\n")
    name = f"diff={diff}+no_proxy_fence"
    root = gemm_variants.variant_tree(name, tmp_path / "tree")
    gemm = (root / rel).read_text()
    assert f"{line}  // changed by the diff\n" in gemm
    ((_, old, new),) = gemm_variants.VARIANTS["no_proxy_fence"]
    assert new in gemm and old not in gemm
    assert gemm_variants.run_label(name) == "row-bytes-comment+no_proxy_fence"
    assert gemm_variants.run_label("csrc=/tmp/older/csrc") == "csrc"
    assert gemm_variants.run_label("probe_consumer_mma") == "probe_consumer_mma"
