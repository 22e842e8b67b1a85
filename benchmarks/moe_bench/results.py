"""The benchmark's JSON document: run metadata, measured rates, one row per (case, variant).

Schema ``flashmoe.layer_bench/1``. Top level::

    schema, created (UTC ISO), argv, complete (bool), stopped_reason, elapsed_s,
    machine   {tag, hostname, device, gpu_name, gpu_count, visible_gpus, capability, gpu_memory_gib}
    software  {python, torch, cuda, nccl, nvshmem, deep_ep, flashmoe, commit, dirty}
    env       {NCCL_*, NVSHMEM_*, TORCH_SYMM_MEM_*, FLASHMOE_* variables set for the run}
    config    {dtype, variants, models, tokens, routings, zipf_s, grouped_gemm, grouped_gemm_note, fp8, check, timing, ...}
    rates     see rates.MeasuredRates.to_json
    rows      [ROW_FIELDS...]

Rows whose ``status`` is not "ok" carry ``None`` latencies and say why in ``note``.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import socket
import subprocess
import sys
from pathlib import Path

import torch

SCHEMA = "flashmoe.layer_bench/1"
STATUSES = ("ok", "wrong", "unavailable", "error")

# Every row has exactly these keys.
ROW_FIELDS = (
    "model",  # shape name (shapes.MODELS)
    "hidden",
    "intermediate",
    "num_experts",  # experts actually run (global)
    "model_num_experts",  # the model's expert count; differs when reduced to fit memory
    "top_k",
    "dtype",  # weight format: bf16 | fp8 (block-fp8 e4m3 + 128x128 fp32 scales); activations bf16 in both
    "world_size",
    "tokens_per_rank",
    "routing",  # uniform | zipf
    "padding_ranks",  # the last N ranks ran dummy steps (flashmoe: padding_marker); the floor counts the rest
    "variant",  # flashmoe | all_to_all | allgather_rs | vllm_fused | deepep_ll | deepep_ll_fp8 | deepep_ll_comm | compute_only
    "mode",  # flushed (one layer, L2 flushed before each call) | serving (graph of L layers, no flush)
    "layers",  # layers per timed step (1 when flushed); latencies are per layer
    "graph",  # the timed step was a CUDA graph replay
    "backend",  # flashmoe: megakernel | reference; others: the grouped GEMM / kernel that ran
    "status",  # ok | wrong | unavailable | error
    "latency_us",  # max over ranks of each rank's median call time (= latency_p50_us)
    "latency_p10_us",  # 10th / 50th / 90th percentile of the slowest rank's calls
    "latency_p50_us",
    "latency_p90_us",
    "latency_per_rank_us",  # every rank's median
    "iters",  # timed calls per rank
    "sets",  # rotated input sets
    "floor_us",  # physical floor with dispatch dedup (ratios use this)
    "floor_nodedup_us",  # the same with one row per (token, remote expert)
    "t_gemm_us",  # floor terms, each maxed over ranks
    "t_weights_us",
    "t_link_us",
    "t_link_nodedup_us",
    "bound",  # gemm | weights | link: the largest dedup term
    "x_floor",  # latency_us / floor_us
    "x_floor_nodedup",  # latency_us / floor_nodedup_us
    "check_rel_l2",  # ||out - ref|| / ||ref|| on input set 0 (None if unchecked)
    "check_max_rel",  # max |out - ref| / max |ref|
    "check_max_row_rel",  # fp8 budget checks: the worst row's ||out - ref|| / ||ref|| over all ranks (else None)
    "check_against",  # what the check compared with, and by which tolerance
    "load_imbalance",  # max / mean expert rows over ranks
    "gemm_rows",  # (token, expert) pairs of the busiest rank per layer (mean over sets and layers)
    "tflops",  # achieved 6 · gemm_rows · H · I / latency, TFLOP/s
    "tflops_vs_compute_only",  # tflops / compute_only's tflops in the same case (identical rows at world 1)
    "metrics_on_us",  # flashmoe with --metrics-overhead: interleaved medians with the kernel's
    "metrics_off_us",  # metrics ring on / off (max over ranks)
    "metrics_overhead",  # metrics_on_us / metrics_off_us - 1
    "note",
)

# Fields added after the first results were committed: absent in older files, read as these values
# (every older row was a flushed single-layer call, its median being its p50).
LATER_FIELDS = {
    "padding_ranks": 0,
    "metrics_on_us": None,
    "metrics_off_us": None,
    "metrics_overhead": None,
    "mode": "flushed",
    "layers": 1,
    "graph": False,
    "latency_p50_us": None,
    "gemm_rows": None,
    "tflops": None,
    "tflops_vs_compute_only": None,
    "dtype": "bf16",
    "check_max_row_rel": None,
    "check_against": None,
}
MODES = ("flushed", "serving")
DTYPES = ("bf16", "fp8")

NUMERIC_WHEN_OK = (
    "latency_us",
    "latency_p10_us",
    "latency_p90_us",
    "floor_us",
    "floor_nodedup_us",
    "x_floor",
    "x_floor_nodedup",
)


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def short_gpu_name(name: str) -> str:
    """'NVIDIA H200' -> 'H200', 'NVIDIA H100 80GB HBM3' -> 'H100'; otherwise the name made file-safe."""
    m = re.search(r"\b(GB\d+|[A-Z]\d{2,4}[A-Z]?)\b", name)
    return m.group(1) if m else re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-") or "gpu"


def machine_info(device: torch.device, world: int) -> dict:
    info = {
        "hostname": socket.gethostname(),
        "device": device.type,
        "gpu_count": world if device.type == "cuda" else 0,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu_name=props.name,
            visible_gpus=torch.cuda.device_count(),
            capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
            l2_mib=round(props.L2_cache_size / 2**20, 1),
            tag=f"{world}x{short_gpu_name(props.name)}",
        )
    else:
        info.update(
            gpu_name=None, visible_gpus=0, capability=None, gpu_memory_gib=None, tag=f"cpu-{world}rank"
        )
    return info


def _package_version(*names: str) -> str | None:
    for n in names:
        try:
            return f"{n} {importlib.metadata.version(n)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def git_commit(repo: Path) -> tuple[str | None, bool | None]:
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode:
            return None, None
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return head.stdout.strip(), bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None, None


def software_info(repo: Path, commit_override: str | None) -> dict:
    nccl = None
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # torch built without NCCL
            nccl = None
    commit, dirty = git_commit(repo)
    if commit_override:
        commit, dirty = commit_override, None
    try:
        import flashmoe

        fm = flashmoe.__version__
    except Exception as e:  # the benchmark still measures the baselines without flashmoe
        fm = f"import failed: {type(e).__name__}: {e}"
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "nvshmem": _package_version("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"),
        "deep_ep": _package_version("deep_ep"),  # the deepep_ll variants' (scripts/build-deepep.sh)
        "flashmoe": fm,
        "commit": commit,
        "dirty": dirty,
    }


def run_env() -> dict:
    prefixes = ("NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM_", "FLASHMOE_", "CUDA_VISIBLE_DEVICES", "TORCH_NCCL_")
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes)}


def default_out_path(
    results_dir: Path, machine_tag: str, when: _dt.datetime | None = None, dtype: str = "bf16"
) -> Path:
    """``<date>-<machine>-layer.json``; fp8 runs add ``-fp8``, so they never overwrite a bf16 run's file."""
    when = when or _dt.datetime.now()
    return results_dir / f"{when:%Y-%m-%d}-{machine_tag}-layer{'' if dtype == 'bf16' else '-' + dtype}.json"


def new_row(**values) -> dict:
    unknown = set(values) - set(ROW_FIELDS)
    if unknown:
        raise KeyError(f"unknown row fields {sorted(unknown)}")
    return {f: values.get(f, LATER_FIELDS.get(f)) for f in ROW_FIELDS}


def validate(doc: dict) -> list[str]:
    """Problems with a document (empty list = valid)."""
    errs = []
    if doc.get("schema") != SCHEMA:
        errs.append(f"schema is {doc.get('schema')!r}, expected {SCHEMA!r}")
    for key, kind in (
        ("machine", dict),
        ("software", dict),
        ("config", dict),
        ("rates", dict),
        ("rows", list),
        ("complete", bool),
    ):
        if not isinstance(doc.get(key), kind):
            errs.append(f"{key}: expected {kind.__name__}, got {type(doc.get(key)).__name__}")
    for key in ("gemm_tflops", "copy_GBps", "link_GBps"):
        if not isinstance(doc.get("rates", {}).get(key), (int, float)):
            errs.append(f"rates.{key} missing")
    if any(r.get("dtype") == "fp8" for r in doc.get("rows") or []) and not isinstance(
        doc.get("rates", {}).get("fp8_gemm_tflops"), (int, float)
    ):
        errs.append("rates.fp8_gemm_tflops missing (fp8 rows need the fp8 GEMM rate their floor used)")
    for i, row in enumerate(doc.get("rows") or []):
        missing, extra = set(ROW_FIELDS) - set(row) - set(LATER_FIELDS), set(row) - set(ROW_FIELDS)
        if missing or extra:
            errs.append(f"row {i}: fields differ: missing {sorted(missing)}, extra {sorted(extra)}")
            continue
        if row["status"] not in STATUSES:
            errs.append(f"row {i}: status {row['status']!r} not in {STATUSES}")
        if row.get("mode", "flushed") not in MODES:
            errs.append(f"row {i}: mode {row['mode']!r} not in {MODES}")
        if row.get("dtype", "bf16") not in DTYPES:
            errs.append(f"row {i}: dtype {row['dtype']!r} not in {DTYPES}")
        if row["status"] == "ok":
            for f in NUMERIC_WHEN_OK:
                if not isinstance(row[f], (int, float)) or row[f] < 0:
                    errs.append(f"row {i}: {f}={row[f]!r} must be a non-negative number when status is ok")
            pcts = [row.get(f) for f in ("latency_p10_us", "latency_p50_us", "latency_p90_us")]
            if all(isinstance(p, (int, float)) for p in pcts) and not pcts[0] <= pcts[1] <= pcts[2]:
                errs.append(f"row {i}: percentiles out of order (p10, p50, p90 = {pcts})")
        elif row["latency_us"] is not None:
            errs.append(f"row {i}: status {row['status']} but latency_us is set")
    return errs


def write_json(path: Path, doc: dict) -> None:
    """Atomic replace, so an interrupted run leaves the previous complete file."""
    errs = validate(doc)
    if errs:
        raise ValueError("refusing to write an invalid benchmark document:\n  " + "\n  ".join(errs))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def load(path: Path) -> dict:
    doc = json.loads(Path(path).read_text())
    errs = validate(doc)
    if errs:
        raise ValueError(f"{path}: not a valid {SCHEMA} document:\n  " + "\n  ".join(errs[:10]))
    for row in doc["rows"]:
        for f, default in LATER_FIELDS.items():
            row.setdefault(f, default)
        if row["latency_p50_us"] is None:
            row["latency_p50_us"] = row["latency_us"]
    return doc
