"""The two sides of the Python<->kernel contract agree: csrc/flashmoe/contract.h, compiled on the host, against
flashmoe.contract. A field added, removed, renamed or reordered on one side only fails here."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from flashmoe import contract

REPO = Path(__file__).resolve().parents[1]
HEADER_DIR = REPO / "csrc"

# Prints every item of the header as "kind name value" lines.
PROGRAM = r"""
#include <cstdio>
#include "flashmoe/contract.h"
using namespace flashmoe;
int main() {
#define CAP(name) std::printf("capacity %s 0\n", #name);
  FLASHMOE_CAPACITY_FIELDS(CAP)
#define RUN(name) std::printf("runtime %s 0\n", #name);
  FLASHMOE_RUNTIME_FIELDS(RUN)
#define STATUS(name) std::printf("status %s 0\n", #name);
  FLASHMOE_STATUS_FIELDS(STATUS)
#define VALUE(kind, name) std::printf(kind " %s %lld\n", #name, static_cast<long long>(name));
  VALUE("const", kStatusOk) VALUE("const", kStatusTimeout)
  VALUE("phase", kPhaseDispatchWait) VALUE("phase", kPhaseCombineWait) VALUE("phase", kPhaseGridBarrier)
  VALUE("phase", kPhaseGemmPipeline) VALUE("phase", kPhaseExpertReady) VALUE("phase", kPhaseReleaseWait)
  VALUE("ring", kRingSeq) VALUE("ring", kRingLayerId) VALUE("ring", kRingStartNs) VALUE("ring", kRingEndNs)
  VALUE("ring", kRingBusyNs) VALUE("ring", kRingBlocksDone) VALUE("ring", kRingNumBlocks)
  VALUE("ring", kRingTokensIn) VALUE("ring", kRingRowsDispatched) VALUE("ring", kRingRowsReceived)
  VALUE("ring", kRingRemoteBytes) VALUE("ring", kRingWorldSize) VALUE("ring", kRingDispatchEndNs)
  VALUE("ring", kRingReceiveEndNs) VALUE("ring", kRingGemm0EndNs) VALUE("ring", kRingGemm1EndNs)
  VALUE("totals", kTotalCalls) VALUE("totals", kTotalTokensIn) VALUE("totals", kTotalRowsDispatched)
  VALUE("totals", kTotalRemoteBytes)
  VALUE("const", kRingSlots) VALUE("const", kRingFields) VALUE("const", kTotalsFields) VALUE("const", kMaxLayers)
  VALUE("const", kHiddenMultiple) VALUE("const", kInterMultiple) VALUE("const", kMaxTopK)
  VALUE("const", kMaxLocalExperts) VALUE("const", kMaxWorld) VALUE("const", kMaxGemm0Splits)
  std::printf("const sizeof_status %zu\n", sizeof(Status));
  std::printf("const sizeof_capacity %zu\n", sizeof(Capacity));
  std::printf("const sizeof_runtime %zu\n", sizeof(RuntimeArgs));
  return 0;
}
"""


def _snake(name: str) -> str:
    """kRingRowsDispatched -> RING_ROWS_DISPATCHED."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name[1:]).upper()


@pytest.fixture(scope="module")
def header(tmp_path_factory) -> dict[str, list[tuple[str, int]]]:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.fail("a host C++ compiler (g++) is needed to check the kernel contract")
    tmp = tmp_path_factory.mktemp("contract")
    (tmp / "main.cpp").write_text(PROGRAM)
    subprocess.run(
        [cxx, "-std=c++17", f"-I{HEADER_DIR}", str(tmp / "main.cpp"), "-o", str(tmp / "dump")], check=True
    )
    out = subprocess.run([str(tmp / "dump")], capture_output=True, text=True, check=True).stdout
    items: dict[str, list[tuple[str, int]]] = {}
    for line in out.splitlines():
        kind, name, value = line.split()
        items.setdefault(kind, []).append((name, int(value)))
    return items


def test_struct_fields_in_order(header):
    assert tuple(n for n, _ in header["capacity"]) == contract.CAPACITY_FIELDS
    assert tuple(n for n, _ in header["runtime"]) == contract.RUNTIME_FIELDS
    assert tuple(n for n, _ in header["status"]) == contract.STATUS_FIELDS
    sizes = dict(header["const"])
    assert sizes["sizeof_status"] == 8 * contract.STATUS_WORDS
    assert sizes["sizeof_capacity"] == 8 * len(contract.CAPACITY_FIELDS)
    assert sizes["sizeof_runtime"] == 8 * len(contract.RUNTIME_FIELDS)


def test_phases_and_status_codes(header):
    phases = {_snake(n).removeprefix("PHASE_"): v for n, v in header["phase"]}
    assert phases == {
        "DISPATCH_WAIT": 1,
        "COMBINE_WAIT": 2,
        "GRID_BARRIER": 3,
        "GEMM_PIPELINE": 4,
        "EXPERT_READY": 5,
        "RELEASE_WAIT": 6,
    }
    for name, value in phases.items():
        assert getattr(contract, f"PHASE_{name}") == value
    assert set(contract.PHASES) == set(phases.values())  # every phase has a message
    consts = dict(header["const"])
    assert (consts["kStatusOk"], consts["kStatusTimeout"]) == (contract.STATUS_OK, contract.STATUS_TIMEOUT)


def test_ring_and_totals_fields(header):
    ring = {_snake(n): v for n, v in header["ring"]}
    assert ring == {
        n: getattr(contract, n)
        for n in dir(contract)
        if n.startswith("RING_") and n not in ("RING_SLOTS", "RING_FIELDS")
    }
    totals = {_snake(n): v for n, v in header["totals"]}
    assert totals == {n: getattr(contract, n) for n in dir(contract) if n.startswith("TOTAL_")}
    assert max(ring.values()) < contract.RING_FIELDS and max(totals.values()) < contract.TOTALS_FIELDS


def test_limits(header):
    consts = dict(header["const"])
    for cpp, py in [
        ("kRingSlots", "RING_SLOTS"),
        ("kRingFields", "RING_FIELDS"),
        ("kTotalsFields", "TOTALS_FIELDS"),
        ("kMaxLayers", "MAX_LAYERS"),
        ("kHiddenMultiple", "HIDDEN_MULTIPLE"),
        ("kInterMultiple", "INTER_MULTIPLE"),
        ("kMaxTopK", "MAX_TOP_K"),
        ("kMaxLocalExperts", "MAX_LOCAL_EXPERTS"),
        ("kMaxWorld", "MAX_WORLD"),
        ("kMaxGemm0Splits", "MAX_GEMM0_SPLITS"),
    ]:
        assert consts[cpp] == getattr(contract, py), cpp


def test_kernel_uses_named_ring_fields():
    # Raw indices into a ring record or the totals (rec[9]) would bypass the contract.
    for path in (REPO / "csrc").rglob("*.cu*"):
        assert not re.search(r"\brec\[\d+\]|\bu \+ \d+\b|totals \+ \d+\b", path.read_text()), path


def test_no_keep_in_sync_comments():
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    hits = []
    for name in listed.stdout.splitlines():
        path = REPO / name
        if (
            path.is_file()
            and path.suffix in {".py", ".cu", ".cuh", ".h", ".cpp", ".md", ".sh", ".toml"}
            and path != Path(__file__)
        ):
            if "keep in sync" in path.read_text(errors="ignore").lower():
                hits.append(name)
    assert not hits, f"hand-synchronised copies remain: {hits}"
