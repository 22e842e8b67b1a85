"""Makes ``benchmarks/`` importable for the benchmark tests (the scripts run with it as sys.path[0])."""

import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))
