"""Shared pytest setup: one fresh random seed per session, reproducible from the report header.

Every test draws its inputs from ``gen`` (a ``torch.Generator`` seeded from the session seed and the
test's id), so each run sees new data and a failure is replayed with
``FLASHMOE_TEST_SEED=<seed from the header> pytest <test id>``.
"""

from __future__ import annotations

import logging
import os
import secrets
import zlib

import pytest
import torch

SESSION_SEED = int(os.environ.get("FLASHMOE_TEST_SEED") or secrets.randbits(31))


def pytest_report_header(config):
    return f"flashmoe test seed: {SESSION_SEED} (replay with FLASHMOE_TEST_SEED={SESSION_SEED})"


def seed_for_test(nodeid: str) -> int:
    return (SESSION_SEED ^ zlib.crc32(nodeid.encode())) & 0x7FFFFFFF


@pytest.fixture
def seed(request) -> int:
    return seed_for_test(request.node.nodeid)


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pytest_runtest_makereport(item, call):
    # Put the seed next to any failure, so it is in the one line CI shows.
    if call.excinfo is not None and call.when == "call":
        item.add_report_section(
            "call", "seed", f"test seed {seed_for_test(item.nodeid)} (session {SESSION_SEED})"
        )


@pytest.fixture
def flashmoe_log():
    """The messages the vLLM adapter logs during the test. Its logger is a child of vLLM's, which does not
    propagate to the root (pytest's caplog does not see them), and vLLM may re-apply its logging config
    while it builds an engine config, which drops handlers added to its loggers but keeps their filters:
    a filter collects them."""
    lines: list[str] = []

    def collect(record: logging.LogRecord) -> bool:
        lines.append(record.getMessage())
        return True

    logger = logging.getLogger("vllm.flashmoe")
    logger.addFilter(collect)
    yield lines
    logger.removeFilter(collect)
