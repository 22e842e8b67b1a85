"""Every ``FLASHMOE_*`` environment variable, declared and parsed here and nowhere else.

The rest of flashmoe reads them through the typed accessors below, at the moment a value is needed
(not at import), so tests and launchers can set variables after ``import flashmoe``. The README's
configuration table is :func:`env_table_markdown` of :data:`ENV_VARS` (tests/test_config.py fails when
they differ).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .contract import MAX_GEMM0_SPLITS


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str


# One variable per line, as in the README table: kept out of the formatter.
# fmt: off
ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("FLASHMOE_CACHE_DIR", "~/.cache/flashmoe", "JIT build cache (compiled kernels, lock files)."),
    EnvVar("FLASHMOE_NVCC", "", "nvcc to use; default: $CUDA_HOME/bin/nvcc, then nvcc on PATH."),
    EnvVar("FLASHMOE_ARCH", "", "Target arch for a JIT build without a GPU (e.g. sm_90a); with a GPU the JIT uses the GPU's own arch, and a different value here is an error."),
    EnvVar("FLASHMOE_JIT_VERBOSE", "0", "1 prints every nvcc command line and its timing."),
    EnvVar("FLASHMOE_TIMEOUT_MS", "10000", "Bound on every spin-wait inside the kernel; on expiry the kernel records what it waited for and exits, and Python raises."),
    EnvVar("FLASHMOE_FORCE_PUT", "0", "1 sends dispatch/combine through NVSHMEM put-with-signal even to NVLink peers (the multi-node path, testable on one node)."),
    EnvVar("FLASHMOE_NODE_SIZE", "0", "EP ranks per node (nodes are contiguous rank blocks): peers on other nodes get NVSHMEM puts, same-node peers NVLink stores; 0 = the launcher's LOCAL_WORLD_SIZE if it divides the EP world, else one node. Smaller than the real node simulates several nodes on one host."),
    EnvVar("FLASHMOE_NUM_BLOCKS", "0", "Persistent grid size (SM budget); 0 = every SM the occupancy check allows."),
    EnvVar("FLASHMOE_GEMM0_SPLITS", "4", "Most tasks one GEMM0 tile's K is split over when a call's GEMM0 tiles leave blocks idle (small T; only as many splits as still start at once; the last split of a tile adds the fp32 sums in a fixed order); 1 = never split (for A/B measurement)."),
    EnvVar("FLASHMOE_MAX_TOKENS", "0", "Max tokens per rank per call the symmetric buffers are sized for; 0 = what the engine reports."),
    EnvVar("FLASHMOE_TP_SLICE", "1", "vLLM TP+EP (tokens replicated over the EP group): 1 = each rank dispatches its 1/W slice of the tokens and the combined slices are all-gathered; 0 = every rank dispatches all of them (for A/B measurement)."),
    EnvVar("FLASHMOE_SKIP_PADDING", "1", "vLLM with DP: 1 = a rank's dummy steps (slot mapping -1) send no tokens to the experts (padding_marker); 0 = they are computed like real tokens, as vLLM's own paths do (for A/B measurement)."),
    EnvVar("FLASHMOE_STRICT", "0", "1 turns any fallback away from the megakernel into an error."),
    EnvVar("FLASHMOE_BACKEND", "auto", "auto | megakernel | reference | fallback: force the implementation behind the op. fallback: the vLLM and SGLang adapters decline flashmoe at start-up and serve with the engine's own MoE path (its all-to-all as FLASHMOE_FALLBACK_ALL2ALL says), with the same log line and fallback metric as a real decline (FLASHMOE_STRICT=1: an error); for A/B runs against flashmoe."),
    EnvVar("FLASHMOE_FALLBACK_ALL2ALL", "auto", "auto | deepep | default: the all-to-all behind the engines' fallback (a layer flashmoe declines). auto = DeepEP (vLLM deepep_high_throughput, SGLang deepep) when deep_ep imports and the EP group spans nodes, else the engine's default (on one node vLLM's DeepEP tier served DP2+EP at 0.14x of its default path: no CUDA graphs with DP > 1); deepep = DeepEP whenever deep_ep imports; default = never DeepEP."),
    EnvVar("FLASHMOE_METRICS", "1", "0 turns off the Prometheus export and the kernel's metrics records (read once per process)."),
    EnvVar("FLASHMOE_METRICS_PORT", "0", "If set, each rank serves its own Prometheus exporter on PORT + local rank."),
    EnvVar("FLASHMOE_METRICS_ADDR", "0.0.0.0", "Address the per-rank exporter (FLASHMOE_METRICS_PORT) binds."),
    EnvVar("FLASHMOE_METRICS_BRIDGE_DIR", "", "Set by the vLLM plugin for its workers (not by users): where they leave metrics for the API server's /metrics."),
    EnvVar("FLASHMOE_SGLANG_FALLBACK", "", "Set by the SGLang plugin's launcher for its schedulers (not by users): why the megakernel was not selected, counted in the fallback metric."),
    EnvVar("FLASHMOE_STRESS_DELAY_NS", "0", "Test only: build a kernel variant that sleeps a random 0..N ns before each signal and wait (race hunting)."),
    EnvVar("FLASHMOE_TRACE", "0", "Profiling only: build a kernel variant that records a tile-level timeline of each launch (scripts/kernel_trace.py reads it)."),
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


def _optional(name: str) -> str | None:
    return env(name).strip() or None


# --- the JIT (flashmoe.build)


def cache_dir() -> Path:
    return Path(os.path.expanduser(env("FLASHMOE_CACHE_DIR")))


def nvcc_override() -> str | None:
    return _optional("FLASHMOE_NVCC")


def arch_override() -> str | None:
    return _optional("FLASHMOE_ARCH")


def jit_verbose() -> bool:
    return env_flag("FLASHMOE_JIT_VERBOSE")


def stress_delay_ns() -> int:
    return env_int("FLASHMOE_STRESS_DELAY_NS")


def trace() -> bool:
    return env_flag("FLASHMOE_TRACE")


# --- the op and the kernel's runtime arguments

BACKENDS = ("auto", "megakernel", "reference", "fallback")


def backend() -> str:
    """FLASHMOE_BACKEND, one of :data:`BACKENDS`."""
    value = env("FLASHMOE_BACKEND").strip().lower()
    if value not in BACKENDS:
        raise ValueError(f"FLASHMOE_BACKEND={value!r}: expected one of {', '.join(BACKENDS)}")
    return value


def strict() -> bool:
    return env_flag("FLASHMOE_STRICT")


FALLBACK_ALL2ALL = ("auto", "deepep", "default")


def fallback_all2all() -> str:
    """FLASHMOE_FALLBACK_ALL2ALL, one of :data:`FALLBACK_ALL2ALL`."""
    value = env("FLASHMOE_FALLBACK_ALL2ALL").strip().lower()
    if value not in FALLBACK_ALL2ALL:
        raise ValueError(
            f"FLASHMOE_FALLBACK_ALL2ALL={value!r}: expected one of {', '.join(FALLBACK_ALL2ALL)}"
        )
    return value


def max_tokens_per_rank(reported: int) -> int:
    """FLASHMOE_MAX_TOKENS if set (> 0), else ``reported``: the bound the engine or caller gave."""
    return env_int("FLASHMOE_MAX_TOKENS") or reported


def tp_slice() -> bool:
    return env_flag("FLASHMOE_TP_SLICE")


def skip_padding() -> bool:
    return env_flag("FLASHMOE_SKIP_PADDING")


def timeout_ms() -> int:
    return env_int("FLASHMOE_TIMEOUT_MS")


def force_put() -> bool:
    return env_flag("FLASHMOE_FORCE_PUT")


def node_size() -> int:
    """FLASHMOE_NODE_SIZE; 0 = not set (flashmoe.topology decides)."""
    return env_int("FLASHMOE_NODE_SIZE")


def gemm0_max_splits() -> int:
    """FLASHMOE_GEMM0_SPLITS, checked against the kernel's limit."""
    value = env_int("FLASHMOE_GEMM0_SPLITS")
    if not 1 <= value <= MAX_GEMM0_SPLITS:
        raise ValueError(f"FLASHMOE_GEMM0_SPLITS={value}: expected 1..{MAX_GEMM0_SPLITS}")
    return value


def num_blocks() -> int:
    """FLASHMOE_NUM_BLOCKS; 0 = as many as the occupancy check allows."""
    return env_int("FLASHMOE_NUM_BLOCKS")


# --- metrics

_metrics_enabled: bool | None = None


def metrics_enabled() -> bool:
    """FLASHMOE_METRICS, read once per process: the kernel's records and the export must agree."""
    global _metrics_enabled
    if _metrics_enabled is None:
        _metrics_enabled = env_flag("FLASHMOE_METRICS")
    return _metrics_enabled


def metrics_port() -> int:
    return env_int("FLASHMOE_METRICS_PORT")


def metrics_addr() -> str:
    return env("FLASHMOE_METRICS_ADDR")


def metrics_bridge_dir() -> str | None:
    return _optional("FLASHMOE_METRICS_BRIDGE_DIR")


def set_metrics_bridge_dir(path: str) -> None:
    """Hand the bridge directory to the processes this one spawns (vLLM's engine core and workers)."""
    os.environ["FLASHMOE_METRICS_BRIDGE_DIR"] = path


def environ_for_new_server() -> dict[str, str]:
    """This process's environment for a serving process it starts (not one of its workers): without the
    metrics bridge directory, so the server makes its own bridge instead of taking itself for a worker."""
    return {k: v for k, v in os.environ.items() if k != "FLASHMOE_METRICS_BRIDGE_DIR"}


def sglang_fallback() -> str | None:
    return _optional("FLASHMOE_SGLANG_FALLBACK")


def set_sglang_fallback(reason: str | None) -> None:
    """Hand the launcher's fallback decision to the scheduler processes it spawns (None clears it)."""
    if reason is None:
        os.environ.pop("FLASHMOE_SGLANG_FALLBACK", None)
    else:
        os.environ["FLASHMOE_SGLANG_FALLBACK"] = reason


def env_table_markdown() -> str:
    """The README's configuration table."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{v.name}` | `{v.default}` | {v.help} |" for v in ENV_VARS]
    return "\n".join(rows)
