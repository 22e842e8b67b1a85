"""The build cache: the key, the entry layout under FLASHMOE_CACHE_DIR, and build/load.

The key covers every file under ``csrc/`` (contents), the recipe (:mod:`.recipe`: compile and link lines), the
variant's defines, the target arch, the nvcc version, the torch version/ABI, the NVSHMEM version and the Python ABI;
nothing that needs a GPU or a driver (no device name, no driver version). A compile-only build and a full build
share one cache entry: a full build over a compile-only entry only links. One process builds while the others wait
on a file lock; the result is published with an atomic rename, and a finished entry is found without taking the
lock (a read-only cache works).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from .. import config
from . import recipe
from .recipe import Variant
from .toolchain import (
    canonical_arch,
    check_runnable,
    default_arch,
    nvcc_version,
    nvshmem_dir,
    require_nvcc,
    runtime_arch,
    source_dir,
)

_SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")


@dataclass(frozen=True)
class BuildResult:
    library: Path | None  # None in compile-only mode
    key: str
    cached: bool
    seconds: float
    objects: tuple[Path, ...]


def key_fields(variant: Variant, arch: str, nvcc: str) -> dict:
    """Everything besides the sources and this file that the key covers (all known without a GPU)."""
    import torch

    nv = nvshmem_dir()
    version_h = nv / "include" / "non_abi" / "nvshmem_version.h"
    return {
        "variant": list(variant.defines),
        "arch": canonical_arch(arch),
        "nvcc": nvcc_version(nvcc),
        "torch": torch.__version__,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "nvshmem": hashlib.sha256(version_h.read_bytes()).hexdigest() if version_h.exists() else str(nv),
        "python": sysconfig.get_config_var("SOABI"),
    }


def build_key(src: Path, variant: Variant, arch: str, nvcc: str) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in src.rglob("*") if p.suffix in _SOURCE_SUFFIXES):
        h.update(str(path.relative_to(src)).encode())
        h.update(path.read_bytes())
    h.update(Path(recipe.__file__).read_bytes())  # the build recipe itself (flags, link line)
    h.update(json.dumps(key_fields(variant, arch, nvcc), sort_keys=True).encode())
    return h.hexdigest()[:24]


@dataclass(frozen=True)
class CacheEntry:
    """Where the build for one (variant, arch, key) lives in FLASHMOE_CACHE_DIR."""

    key: str
    arch: str
    variant: Variant
    dir: Path

    @property
    def library(self) -> Path:
        return self.dir / f"flashmoe_{self.variant.name}.so"

    @property
    def marker(self) -> Path:
        return self.dir / "build.json"

    def info(self) -> dict | None:
        try:
            info = json.loads(self.marker.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return info if info.get("key") == self.key and info.get("arch") == self.arch else None

    def linked(self) -> bool:
        info = self.info()
        return bool(info and info.get("linked")) and self.library.is_file()


def cache_entry(
    arch: str, variant: Variant | None = None, src: Path | None = None, nvcc: str | None = None
) -> CacheEntry:
    """The cache entry for ``arch``: the same one for the build-time ``--arch`` and for the runtime device."""
    nvcc = nvcc or require_nvcc()
    arch = canonical_arch(arch)
    variant = variant or Variant.current()
    key = build_key(src or source_dir(), variant, arch, nvcc)
    return CacheEntry(key, arch, variant, config.cache_dir() / f"{variant.name}-{arch}-{key}")


def find_library(arch: str, variant: Variant | None = None) -> Path | None:
    """The runtime lookup: the linked library for ``arch`` if the cache has it, else None. Never builds."""
    entry = cache_entry(arch, variant)
    return entry.library if entry.linked() else None


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def build(
    arch: str | None = None,
    compile_only: bool = False,
    variant: Variant | None = None,
    src: Path | None = None,
) -> BuildResult:
    """Compile, device-link and (unless compile_only) link the kernel library for ``arch``; returns the cached artifact.

    Needs nvcc and the CUDA toolkit, not a GPU or a driver. ``arch`` defaults to FLASHMOE_ARCH, else the running GPU's;
    anything but sm_90a is refused (:func:`.toolchain.check_runnable`).
    """
    from filelock import FileLock

    arch = check_runnable(arch or default_arch())
    nvcc = require_nvcc()
    variant = variant or Variant.current()
    src = src or source_dir()
    entry = cache_entry(arch, variant, src, nvcc)
    t0 = time.perf_counter()

    def done(info: dict, cached: bool) -> BuildResult:
        objects = tuple(entry.dir / Path(o).name for o in info["objects"])
        return BuildResult(
            None if compile_only else entry.library, entry.key, cached, time.perf_counter() - t0, objects
        )

    # A finished entry is used without the lock, so a read-only cache baked into an image works.
    info = entry.info()
    if info is not None and (compile_only or entry.linked()):
        return done(info, True)
    config.cache_dir().mkdir(parents=True, exist_ok=True)
    with FileLock(str(config.cache_dir() / f"{entry.key}.lock"), timeout=1800):
        info = entry.info()
        if info is not None and (compile_only or entry.linked()):
            return done(info, True)
        if info is None:
            tmp = Path(str(entry.dir) + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            objects = recipe.compile_objects(src, tmp, arch, variant, nvcc)
            info = {
                "key": entry.key,
                "arch": arch,
                "variant": variant.name,
                "fields": key_fields(variant, arch, nvcc),
                "compile_seconds": round(time.perf_counter() - t0, 1),
                "objects": [o.name for o in objects],
                "linked": False,
            }
            if not compile_only:
                recipe.link_library(tmp, objects, variant, nvcc)
                info.update(
                    linked=True, link_seconds=round(time.perf_counter() - t0 - info["compile_seconds"], 1)
                )
            (tmp / "build.json").write_text(json.dumps(info, indent=1))
            shutil.rmtree(entry.dir, ignore_errors=True)
            os.replace(tmp, entry.dir)
        else:
            # Compiled earlier with --compile-only: link those objects (seconds) into the same entry.
            t1 = time.perf_counter()
            recipe.link_library(
                entry.dir,
                [entry.dir / o for o in info["objects"]],
                variant,
                nvcc,
                tmp_suffix=f".tmp{os.getpid()}",
            )
            info.update(linked=True, link_seconds=round(time.perf_counter() - t1, 1))
            # After the library is in place: a reader sees "linked" only once the .so is there.
            _write_json(entry.marker, info)
    return done(info, False)


_loaded: dict[str, object] = {}


def load(variant: Variant | None = None):
    """Find (building if needed) and load the kernel library for the running GPU; returns ``torch.ops.<namespace>``.

    The arch is the GPU's own (:func:`runtime_arch`), so a library baked into an image for ``sm_90a`` is used on
    Hopper and never on another GPU.
    """
    import torch

    variant = variant or Variant.current()
    if variant.name not in _loaded:
        result = build(arch=runtime_arch(), variant=variant)
        torch.ops.load_library(str(result.library))
        _loaded[variant.name] = getattr(torch.ops, variant.ops_namespace)
    return _loaded[variant.name]
