"""Every ``FLASHMOE_*`` environment variable, parsed in one place.

Read through :func:`env` at the moment a value is needed (not at import), so tests and launchers
can set variables after ``import flashmoe``. The README's configuration table is generated from
:data:`ENV_VARS`; keep the two in step by editing only this list.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str


# One variable per line (the README table is generated from it): kept out of the formatter.
# fmt: off
ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("FLASHMOE_CACHE_DIR", "~/.cache/flashmoe", "JIT build cache (compiled kernels, lock files)."),
    EnvVar("FLASHMOE_NVCC", "", "nvcc to use; default: $CUDA_HOME/bin/nvcc, then nvcc on PATH."),
    EnvVar("FLASHMOE_ARCH", "", "Target arch for a JIT build without a GPU (e.g. sm_90a); with a GPU the JIT uses the GPU's own arch, and a different value here is an error."),
    EnvVar("FLASHMOE_JIT_VERBOSE", "0", "1 prints every nvcc command line and its timing."),
    EnvVar("FLASHMOE_TIMEOUT_MS", "10000", "Bound on every spin-wait inside the kernel; on expiry the kernel records what it waited for and exits, and Python raises."),
    EnvVar("FLASHMOE_FORCE_PUT", "0", "1 sends dispatch/combine through NVSHMEM put-with-signal even to NVLink peers (the multi-node path, testable on one node)."),
    EnvVar("FLASHMOE_NUM_BLOCKS", "0", "Persistent grid size (SM budget); 0 = every SM the occupancy check allows."),
    EnvVar("FLASHMOE_MAX_TOKENS", "0", "Max tokens per rank per call the symmetric buffers are sized for; 0 = what the engine reports."),
    EnvVar("FLASHMOE_STRICT", "0", "1 turns any fallback away from the megakernel into an error."),
    EnvVar("FLASHMOE_BACKEND", "auto", "auto | megakernel | reference: force the implementation behind the op."),
    EnvVar("FLASHMOE_METRICS", "1", "0 disables in-kernel timing and the Prometheus export."),
    EnvVar("FLASHMOE_METRICS_PORT", "0", "If set, each rank serves its own Prometheus exporter on PORT + local rank."),
    EnvVar("FLASHMOE_METRICS_ADDR", "0.0.0.0", "Address the per-rank exporter (FLASHMOE_METRICS_PORT) binds."),
    EnvVar("FLASHMOE_METRICS_BRIDGE_DIR", "", "Set by the vLLM plugin for its workers (not by users): where they leave metrics for the API server's /metrics."),
    EnvVar("FLASHMOE_SGLANG_FALLBACK", "", "Set by the SGLang plugin's launcher for its schedulers (not by users): why the megakernel was not selected, counted in the fallback metric."),
    EnvVar("FLASHMOE_STRESS_DELAY_NS", "0", "Test only: build a kernel variant that sleeps a random 0..N ns before each signal and wait (race hunting)."),
)
# fmt: on

_BY_NAME = {v.name: v for v in ENV_VARS}


def env(name: str) -> str:
    """The value of a FLASHMOE_* variable, or its documented default."""
    if name not in _BY_NAME:
        raise KeyError(f"{name} is not a FLASHMOE_* variable; known: {sorted(_BY_NAME)}")
    return os.environ.get(name, _BY_NAME[name].default)


def env_int(name: str) -> int:
    raw = env(name)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def env_flag(name: str) -> bool:
    raw = env(name).strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{name}={raw!r}: expected 0 or 1")


def cache_dir() -> Path:
    return Path(os.path.expanduser(env("FLASHMOE_CACHE_DIR")))


def env_table_markdown() -> str:
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{v.name}` | `{v.default}` | {v.help} |" for v in ENV_VARS]
    return "\n".join(rows)
