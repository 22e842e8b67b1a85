"""flashmoe.config: every FLASHMOE_* variable is declared once, parsed once, and documented in the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from flashmoe import config, contract

ROOT = Path(__file__).resolve().parents[1]


def test_readme_table_is_the_declared_variables():
    readme = (ROOT / "README.md").read_text()
    assert config.env_table_markdown() in readme


def test_no_flashmoe_variable_is_read_outside_config():
    """Every other module goes through config's accessors (one parser per variable)."""
    pattern = re.compile(r"[\"']FLASHMOE_[A-Z_]+[\"']")
    roots = [ROOT / "plugin" / "flashmoe", ROOT / "integration"]
    offenders = []
    for path in (p for root in roots for p in root.rglob("*.py")):
        if path.name == "config.py" or path.parent.name == "deploy":  # deploy forwards FLASHMOE_* wholesale
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_backend_is_validated(monkeypatch):
    monkeypatch.setenv("FLASHMOE_BACKEND", " Reference ")
    assert config.backend() == "reference"
    monkeypatch.setenv("FLASHMOE_BACKEND", "fast")
    with pytest.raises(ValueError, match="FLASHMOE_BACKEND='fast'"):
        config.backend()


def test_max_tokens_override(monkeypatch):
    monkeypatch.delenv("FLASHMOE_MAX_TOKENS", raising=False)
    assert config.max_tokens_per_rank(256) == 256
    monkeypatch.setenv("FLASHMOE_MAX_TOKENS", "64")
    assert config.max_tokens_per_rank(256) == 64


def test_the_op_applies_the_max_tokens_override(monkeypatch):
    """Applied once, in FlashMoE: the per-call token check and the buffers see the same bound."""
    from flashmoe import ExpertPlacement, FlashMoE, MoELayerSpec

    spec = MoELayerSpec(
        num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, max_tokens_per_rank=256
    )
    monkeypatch.setenv("FLASHMOE_MAX_TOKENS", "8")
    moe = FlashMoE(spec, ExpertPlacement.contiguous(4, 1), device=torch.device("cpu"))
    assert moe.spec.max_tokens_per_rank == 8
    monkeypatch.delenv("FLASHMOE_MAX_TOKENS")
    moe = FlashMoE(spec, ExpertPlacement.contiguous(4, 1), device=torch.device("cpu"))
    assert moe.spec.max_tokens_per_rank == 256


def test_gemm0_splits_are_validated(monkeypatch):
    monkeypatch.setenv("FLASHMOE_GEMM0_SPLITS", "2")
    assert config.gemm0_max_splits() == 2
    for bad in ("0", str(contract.MAX_GEMM0_SPLITS + 1), "-1"):
        monkeypatch.setenv("FLASHMOE_GEMM0_SPLITS", bad)
        with pytest.raises(ValueError, match="FLASHMOE_GEMM0_SPLITS"):
            config.gemm0_max_splits()
