"""The test suite's definitions the benchmark shares: error budgets (``tests/tolerances.py``) and the fp8
input generators (``tests/moe_inputs.py``), imported from ``tests/`` so that each is defined once.

``tests/`` is appended to ``sys.path`` (after everything else, so it shadows nothing); the suite itself
imports these modules by the same top-level names, so both see one module object.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[2] / "tests"


def _module(name: str):
    if str(TESTS_DIR) not in sys.path:
        sys.path.append(str(TESTS_DIR))
    return importlib.import_module(name)


def tolerances():
    return _module("tolerances")


def moe_inputs():
    return _module("moe_inputs")
