"""Build the CUDA sources on first use, cached by a hash of everything that goes into the binary.

    python -m flashmoe.build --arch sm_90a                  # no GPU needed: the full build (compile, device-link, link)
    python -m flashmoe.build --arch sm_90a --compile-only   # no GPU needed: compile and device-link only (CI check)
    python -m flashmoe.build --arch sm_90a --print-key      # the key and library path, without building
    python -m flashmoe.build                                # build (if needed) for the running GPU

The cache key covers every file under ``csrc/`` (contents), this file (the compile and link lines), the variant's
defines, the target arch, the nvcc version, the torch version/ABI, the NVSHMEM version and the Python ABI; nothing
that needs a GPU or a driver (no device name, no driver version). The arch is spelt one way (:func:`canonical_arch`:
compute capability 9.0 is ``sm_90a``), so a build made on a machine without a GPU with ``--arch sm_90a`` (the
Docker image build) is the very library the runtime finds on an H100/H200. The link needs no driver: nothing in
the library calls the driver API (libcudart loads the driver at run time), so neither ``libcuda`` nor its stub is
linked. A compile-only build and a full build share one cache entry: a full build over a compile-only entry only
links. Shapes are runtime arguments of the kernel, so one build serves every layer; the only compile-time variant
is the stress-test build. One process builds while the others wait on a file lock; the result is published with
an atomic rename, and a finished entry is found without taking the lock (a read-only cache works).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import cache_dir, env, env_flag, env_int
from ..errors import FlashMoEBuildError

_SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")


@dataclass(frozen=True)
class Variant:
    name: str  # "default" or "stress<ns>"
    ops_namespace: str  # torch.ops.<ns>
    defines: tuple[str, ...]

    @staticmethod
    def current() -> Variant:
        delay = env_int("FLASHMOE_STRESS_DELAY_NS")
        if delay > 0:
            return Variant(
                f"stress{delay}",
                "flashmoe_stress",
                (f"FLASHMOE_STRESS_DELAY_NS={delay}", "FLASHMOE_OPS=flashmoe_stress"),
            )
        return Variant("default", "flashmoe", ("FLASHMOE_OPS=flashmoe",))


@dataclass(frozen=True)
class BuildResult:
    library: Path | None  # None in compile-only mode
    key: str
    cached: bool
    seconds: float
    objects: tuple[Path, ...]


def source_dir() -> Path:
    """csrc/ in a source checkout (editable install), else the copy shipped inside the wheel."""
    pkg = Path(__file__).resolve().parent.parent
    for candidate in (pkg.parent.parent / "csrc", pkg / "_csrc"):
        if (candidate / "kernel.cu").is_file():
            return candidate
    raise FlashMoEBuildError(
        f"flashmoe CUDA sources not found (looked in {pkg.parent.parent / 'csrc'} and {pkg / '_csrc'})"
    )


def find_nvcc() -> str | None:
    explicit = env("FLASHMOE_NVCC")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


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


def cute_include_dir() -> Path | None:
    try:
        import cutlass_library
    except ImportError:
        return None
    inc = Path(cutlass_library.__file__).parent / "source" / "include"
    return inc if (inc / "cute").is_dir() else None


def _nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def arch_for_capability(major: int, minor: int) -> str:
    """The arch the JIT builds for a GPU of compute capability ``major.minor``; 9.0 (Hopper) is ``sm_90a``."""
    return f"sm_{major}{minor}{'a' if (major, minor) == (9, 0) else ''}"


_ARCH_RE = re.compile(r"^(?:sm_|compute_)?(\d+)(\d)([a-z]?)$|^(\d+)\.(\d)$")


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


def device_arch(device=None) -> str:
    """The arch of the running GPU (``torch.cuda`` must see one)."""
    import torch

    if not torch.cuda.is_available():
        raise FlashMoEBuildError("no GPU visible: pass --arch (e.g. sm_90a) or set FLASHMOE_ARCH")
    return arch_for_capability(*torch.cuda.get_device_capability(device))


def default_arch() -> str:
    """FLASHMOE_ARCH if set, else the running GPU's arch (builds without a GPU must name the arch)."""
    arch = env("FLASHMOE_ARCH")
    return canonical_arch(arch) if arch else device_arch()


def runtime_arch(device=None) -> str:
    """The arch to load for the running GPU. FLASHMOE_ARCH, if set, must name that same arch."""
    import torch

    if not torch.cuda.is_available():
        return default_arch()
    arch = device_arch(device)
    forced = env("FLASHMOE_ARCH")
    if forced and canonical_arch(forced) != arch:
        name = torch.cuda.get_device_name(device)
        raise FlashMoEBuildError(
            f"FLASHMOE_ARCH={forced} but the GPU ({name}) is {arch}: unset FLASHMOE_ARCH or run on a {forced} GPU"
        )
    return arch


def _gencode(arch: str) -> str:
    num = arch.removeprefix("sm_")
    return f"-gencode=arch=compute_{num},code=sm_{num}"


def key_fields(variant: Variant, arch: str, nvcc: str) -> dict:
    """Everything besides the sources and this file that the key covers (all known without a GPU)."""
    import torch

    nv = nvshmem_dir()
    version_h = nv / "include" / "non_abi" / "nvshmem_version.h"
    return {
        "variant": list(variant.defines),
        "arch": canonical_arch(arch),
        "nvcc": _nvcc_version(nvcc),
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
    h.update(Path(__file__).read_bytes())  # the build recipe itself (flags, link line)
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
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FlashMoEBuildError(
            "nvcc not found: set FLASHMOE_NVCC or CUDA_HOME, or put nvcc on PATH (CUDA 12.4+; 13.0 tested)"
        )
    arch = canonical_arch(arch)
    variant = variant or Variant.current()
    key = build_key(src or source_dir(), variant, arch, nvcc)
    return CacheEntry(key, arch, variant, cache_dir() / f"{variant.name}-{arch}-{key}")


def find_library(arch: str, variant: Variant | None = None) -> Path | None:
    """The runtime lookup: the linked library for ``arch`` if the cache has it, else None. Never builds."""
    entry = cache_entry(arch, variant)
    return entry.library if entry.linked() else None


def _run(cmd: list[str], verbose: bool) -> subprocess.Popen:
    if verbose:
        print("[flashmoe.build]", " ".join(cmd), file=sys.stderr)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_all(procs: list[tuple[str, subprocess.Popen]]) -> None:
    errors = []
    for what, proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            errors.append(f"--- {what} failed (exit {proc.returncode}):\n{out[-8000:]}")
    if errors:
        raise FlashMoEBuildError("flashmoe kernel build failed:\n" + "\n".join(errors))


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

    Needs nvcc and the CUDA toolkit, not a GPU or a driver. ``arch`` defaults to FLASHMOE_ARCH, else the running GPU's.
    """
    from filelock import FileLock

    nvcc = find_nvcc()
    if nvcc is None:
        raise FlashMoEBuildError(
            "nvcc not found: set FLASHMOE_NVCC or CUDA_HOME, or put nvcc on PATH (CUDA 12.4+; 13.0 tested)"
        )
    arch = canonical_arch(arch) if arch else default_arch()
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
    cache_dir().mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir() / f"{entry.key}.lock"), timeout=1800):
        info = entry.info()
        if info is not None and (compile_only or entry.linked()):
            return done(info, True)
        if info is None:
            tmp = Path(str(entry.dir) + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            objects = _compile(src, tmp, arch, variant, nvcc)
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
                _link(tmp, objects, variant, nvcc)
                info.update(
                    linked=True, link_seconds=round(time.perf_counter() - t0 - info["compile_seconds"], 1)
                )
            (tmp / "build.json").write_text(json.dumps(info, indent=1))
            shutil.rmtree(entry.dir, ignore_errors=True)
            os.replace(tmp, entry.dir)
        else:
            # Compiled earlier with --compile-only: link those objects (seconds) into the same entry.
            t1 = time.perf_counter()
            _link(
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


def _compile(src: Path, out: Path, arch: str, variant: Variant, nvcc: str) -> list[Path]:
    import torch
    from torch.utils import cpp_extension

    verbose = env_flag("FLASHMOE_JIT_VERBOSE")
    nv = nvshmem_dir()
    includes = [f"-I{src}", f"-I{nv / 'include'}"]
    cute = cute_include_dir()
    if cute is not None:
        includes.append(f"-I{cute}")
    defines = [f"-D{d}" for d in variant.defines]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    kernel_o, dlink_o, bind_o = out / "kernel.o", out / "dlink.o", out / "bindings.o"
    cuda_home = Path(nvcc).resolve().parent.parent
    torch_includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{cuda_home / 'include'}"]
    nvcc_cmd = [
        nvcc,
        "-c",
        str(src / "kernel.cu"),
        "-o",
        str(kernel_o),
        "-rdc=true",
        _gencode(arch),
        "-std=c++17",
        "-O3",
        "-Xcompiler",
        "-fPIC",
        "--expt-relaxed-constexpr",
        "-lineinfo",
        "-Xptxas=-v" if verbose else "-Xptxas=-O3",
        abi,
        *defines,
        *includes,
    ]
    cxx = os.environ.get("CXX", "g++")
    bind_cmd = [
        cxx,
        "-c",
        str(src / "bindings.cpp"),
        "-o",
        str(bind_o),
        "-std=c++20",
        "-O2",
        "-fPIC",
        abi,
        *defines,
        *includes,
        *torch_includes,
    ]
    _wait_all([("nvcc kernel.cu", _run(nvcc_cmd, verbose)), ("c++ bindings.cpp", _run(bind_cmd, verbose))])
    # Device link: resolves NVSHMEM's device symbols (relocatable device code) into this library.
    dlink_cmd = [
        nvcc,
        "-dlink",
        str(kernel_o),
        str(nv / "lib" / "libnvshmem_device.a"),
        "-o",
        str(dlink_o),
        _gencode(arch),
        "-Xcompiler",
        "-fPIC",
    ]
    _wait_all([("nvcc -dlink", _run(dlink_cmd, verbose))])
    return [kernel_o, dlink_o, bind_o]


def _link(out: Path, objects: list[Path], variant: Variant, nvcc: str, tmp_suffix: str = "") -> Path:
    """Host link of the library; needs no GPU and no driver.

    No ``-lcuda``: the objects call only the runtime API (libcudart, which finds the driver at run time) and
    NVSHMEM, so ``--no-undefined`` holds without the driver or the toolkit's ``lib64/stubs/libcuda.so``. A
    driver-API call added later fails this link loudly on a machine without a driver, rather than producing a
    library that cannot load.
    """
    import torch

    verbose = env_flag("FLASHMOE_JIT_VERBOSE")
    nv = nvshmem_dir()
    cuda_home = Path(nvcc).resolve().parent.parent
    torch_lib = Path(torch.__file__).parent / "lib"
    lib = out / f"flashmoe_{variant.name}.so"
    target = lib.with_name(lib.name + tmp_suffix)
    cxx = os.environ.get("CXX", "g++")
    link_cmd = [
        cxx,
        "-shared",
        "-Wl,--no-undefined",
        "-o",
        str(target),
        *map(str, objects),
        # The device archive again, for its host half: the registration stubs of its device modules and the
        # NVSHMEM init entry point that installs this library's device state.
        str(nv / "lib" / "libnvshmem_device.a"),
        f"-L{nv / 'lib'}",
        "-l:libnvshmem_host.so.3",
        f"-Wl,-rpath,{nv / 'lib'}",
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        f"-Wl,-rpath,{torch_lib}",
        f"-L{cuda_home / 'lib64'}",
        "-lcudart",
    ]
    _wait_all([("link", _run(link_cmd, verbose))])
    if target != lib:
        os.replace(target, lib)
    return lib


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m flashmoe.build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--arch", default=None, help="e.g. sm_90a (default: FLASHMOE_ARCH or the running GPU)")
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="compile and device-link, do not link (a CI compile check)",
    )
    ap.add_argument(
        "--print-key",
        action="store_true",
        help="print the cache key, its fields and the library path as JSON without building; exit 1 if the library is not built",
    )
    ap.add_argument(
        "--variant",
        choices=["default", "stress"],
        default=None,
        help="default: from FLASHMOE_STRESS_DELAY_NS",
    )
    args = ap.parse_args(argv)
    if args.variant == "stress" and env_int("FLASHMOE_STRESS_DELAY_NS") <= 0:
        os.environ["FLASHMOE_STRESS_DELAY_NS"] = "2000"
    variant = (
        Variant.current()
        if args.variant != "default"
        else Variant("default", "flashmoe", ("FLASHMOE_OPS=flashmoe",))
    )
    try:
        arch = canonical_arch(args.arch) if args.arch else default_arch()
        if args.print_key:
            nvcc = find_nvcc()
            entry = cache_entry(arch, variant, nvcc=nvcc)
            print(
                json.dumps(
                    {
                        "key": entry.key,
                        "arch": entry.arch,
                        "variant": variant.name,
                        "cache_dir": str(cache_dir()),
                        "library": str(entry.library),
                        "built": entry.linked(),
                        "fields": key_fields(variant, entry.arch, nvcc),
                    },
                    indent=1,
                )
            )
            return 0 if entry.linked() else 1
        res = build(arch=arch, compile_only=args.compile_only, variant=variant)
    except FlashMoEBuildError as e:
        print(e, file=sys.stderr)
        return 1
    what = "objects" if args.compile_only else "library"
    target = " ".join(map(str, res.objects)) if args.compile_only else res.library
    state = "cache hit" if res.cached else f"built in {res.seconds:.1f} s"
    print(f"flashmoe.build: {variant.name} {arch} {state} (key {res.key}); {what}: {target}")
    return 0

