"""What a build needs from the machine: the CUDA sources, nvcc, NVSHMEM, and the target arch.

The arch is spelt one way (:func:`canonical_arch`: compute capability 9.0 is ``sm_90a``), so a build made without a
GPU with ``--arch sm_90a`` (the Docker image build) is the very library the runtime finds on an H100/H200. Only
``sm_90a`` is built: the kernel uses Hopper's arch-specific features and the runtime loads it only on sm_90 GPUs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from .. import config
from ..errors import FlashMoEBuildError

# The one arch the megakernel runs on (backend.py refuses every other GPU before any load).
RUNNABLE_ARCH = "sm_90a"

_ARCH_RE = re.compile(r"^(?:sm_|compute_)?(\d+)(\d)([a-z]?)$|^(\d+)\.(\d)$")


def source_dir() -> Path:
    """csrc/ in a source checkout (editable install), else the copy shipped inside the wheel."""
    pkg = Path(__file__).resolve().parent.parent  # plugin/flashmoe
    for candidate in (pkg.parent.parent / "csrc", pkg / "_csrc"):
        if (candidate / "kernel.cu").is_file():
            return candidate
    raise FlashMoEBuildError(
        f"flashmoe CUDA sources not found (looked in {pkg.parent.parent / 'csrc'} and {pkg / '_csrc'})"
    )


def find_nvcc() -> str | None:
    explicit = config.nvcc_override()
    if explicit:
        return explicit if Path(explicit).is_file() else None
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def require_nvcc() -> str:
    nvcc = find_nvcc()
    if nvcc is None:
        raise FlashMoEBuildError(
            "nvcc not found: set FLASHMOE_NVCC or CUDA_HOME, or put nvcc on PATH (CUDA 12.4+; 13.0 tested)"
        )
    return nvcc


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def nvshmem_dir() -> Path:
    try:
        import nvidia.nvshmem as nvshmem_pkg
    except ImportError:
        raise FlashMoEBuildError(
            "NVSHMEM not found: install the pip package nvidia-nvshmem-cu13 (torch's CUDA wheels depend on it)"
        ) from None
    root = Path(list(nvshmem_pkg.__path__)[0])
    missing = [
        p
        for p in ("include/nvshmem.h", "lib/libnvshmem_device.a", "lib/libnvshmem_host.so.3")
        if not (root / p).exists()
    ]
    if missing:
        raise FlashMoEBuildError(f"NVSHMEM at {root} is incomplete: missing {', '.join(missing)}")
    return root


def arch_for_capability(major: int, minor: int) -> str:
    """The arch the JIT builds for a GPU of compute capability ``major.minor``; 9.0 (Hopper) is ``sm_90a``."""
    return f"sm_{major}{minor}{'a' if (major, minor) == (9, 0) else ''}"


def canonical_arch(arch: str) -> str:
    """One spelling per target, so build-time ``--arch`` and the runtime device agree on the cache key.

    ``sm_90a``, ``sm_90``, ``90`` and ``9.0`` are all ``sm_90a`` (the megakernel needs Hopper's arch-specific
    features); other arches keep their suffix (``sm_100a``, ``sm_120``).
    """
    m = _ARCH_RE.match(arch.strip().lower())
    if m is None:
        raise FlashMoEBuildError(f"unrecognised arch {arch!r}: expected e.g. sm_90a")
    if m.group(4) is not None:  # "9.0"
        return arch_for_capability(int(m.group(4)), int(m.group(5)))
    major, minor, suffix = int(m.group(1)), int(m.group(2)), m.group(3)
    if (major, minor) == (9, 0):
        return arch_for_capability(9, 0)
    return f"sm_{major}{minor}{suffix}"


def check_runnable(arch: str) -> str:
    """``arch`` in canonical form if the megakernel runs there, else a FlashMoEBuildError saying so."""
    arch = canonical_arch(arch)
    if arch != RUNNABLE_ARCH:
        raise FlashMoEBuildError(
            f"flashmoe builds only for {RUNNABLE_ARCH} (Hopper: H100/H200); a library for {arch} would never be "
            "loaded, since the runtime uses the megakernel on sm_90 GPUs only"
        )
    return arch


def device_arch(device=None) -> str:
    """The arch of the running GPU (``torch.cuda`` must see one)."""
    import torch

    if not torch.cuda.is_available():
        raise FlashMoEBuildError("no GPU visible: pass --arch (e.g. sm_90a) or set FLASHMOE_ARCH")
    return arch_for_capability(*torch.cuda.get_device_capability(device))


def default_arch() -> str:
    """FLASHMOE_ARCH if set, else the running GPU's arch (builds without a GPU must name the arch)."""
    arch = config.arch_override()
    return canonical_arch(arch) if arch else device_arch()


def runtime_arch(device=None) -> str:
    """The arch to load for the running GPU. FLASHMOE_ARCH, if set, must name that same arch."""
    import torch

    if not torch.cuda.is_available():
        return default_arch()
    arch = device_arch(device)
    forced = config.arch_override()
    if forced and canonical_arch(forced) != arch:
        name = torch.cuda.get_device_name(device)
        raise FlashMoEBuildError(
            f"FLASHMOE_ARCH={forced} but the GPU ({name}) is {arch}: unset FLASHMOE_ARCH or run on a {forced} GPU"
        )
    return arch
