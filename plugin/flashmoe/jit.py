"""Build the CUDA sources on first use, cached by a hash of everything that goes into the binary.

    python -m flashmoe.jit --arch sm_90a --compile-only   # no GPU needed: compiles, does not link
    python -m flashmoe.jit                                # build + load for the running GPU

The cache key covers every file under ``csrc/`` (contents), this file (the compile and link lines), the variant's defines, the target arch, the
nvcc version, the torch version/ABI and the NVSHMEM version. Shapes are runtime arguments of the kernel, so
one build serves every layer; the only compile-time variant is the stress-test build. One process compiles
while the others wait on a file lock; the result is published with an atomic rename.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from .config import cache_dir, env, env_flag, env_int
from .errors import FlashMoEBuildError

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
            return Variant(f"stress{delay}", "flashmoe_stress", (f"FLASHMOE_STRESS_DELAY_NS={delay}", "FLASHMOE_OPS=flashmoe_stress"))
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
    pkg = Path(__file__).resolve().parent
    for candidate in (pkg.parent.parent / "csrc", pkg / "_csrc"):
        if (candidate / "kernel.cu").is_file():
            return candidate
    raise FlashMoEBuildError(f"flashmoe CUDA sources not found (looked in {pkg.parent.parent / 'csrc'} and {pkg / '_csrc'})")


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
        raise FlashMoEBuildError("NVSHMEM not found: install the pip package nvidia-nvshmem-cu13 (torch's CUDA wheels depend on it)") from None
    root = Path(list(nvshmem_pkg.__path__)[0])
    missing = [p for p in ("include/nvshmem.h", "lib/libnvshmem_device.a", "lib/libnvshmem_host.so.3") if not (root / p).exists()]
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


def default_arch() -> str:
    arch = env("FLASHMOE_ARCH")
    if arch:
        return arch
    import torch

    if not torch.cuda.is_available():
        raise FlashMoEBuildError("no GPU visible: pass --arch (e.g. sm_90a) or set FLASHMOE_ARCH")
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}{'a' if major == 9 else ''}"


def _gencode(arch: str) -> str:
    num = arch.removeprefix("sm_")
    return f"-gencode=arch=compute_{num},code=sm_{num}"


def build_key(src: Path, variant: Variant, arch: str, nvcc: str, compile_only: bool) -> str:
    import torch

    h = hashlib.sha256()
    for path in sorted(p for p in src.rglob("*") if p.suffix in _SOURCE_SUFFIXES):
        h.update(str(path.relative_to(src)).encode())
        h.update(path.read_bytes())
    nv = nvshmem_dir()
    version_h = nv / "include" / "non_abi" / "nvshmem_version.h"
    meta = {
        "variant": variant.defines,
        "arch": arch,
        "nvcc": _nvcc_version(nvcc),
        "torch": torch.__version__,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "nvshmem": hashlib.sha256(version_h.read_bytes()).hexdigest() if version_h.exists() else str(nv),
        "python": sysconfig.get_config_var("SOABI"),
        "compile_only": compile_only,
    }
    h.update(Path(__file__).read_bytes())  # the build recipe itself (flags, link line)
    h.update(json.dumps(meta, sort_keys=True).encode())
    return h.hexdigest()[:24]


def _run(cmd: list[str], verbose: bool) -> subprocess.Popen:
    if verbose:
        print("[flashmoe.jit]", " ".join(cmd), file=sys.stderr)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_all(procs: list[tuple[str, subprocess.Popen]]) -> None:
    errors = []
    for what, proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            errors.append(f"--- {what} failed (exit {proc.returncode}):\n{out[-8000:]}")
    if errors:
        raise FlashMoEBuildError("flashmoe kernel build failed:\n" + "\n".join(errors))


def build(arch: str | None = None, compile_only: bool = False, variant: Variant | None = None, src: Path | None = None) -> BuildResult:
    """Compile (and unless compile_only, link) the kernel library for ``arch``; returns the cached artifact."""
    from filelock import FileLock

    nvcc = find_nvcc()
    if nvcc is None:
        raise FlashMoEBuildError("nvcc not found: set FLASHMOE_NVCC or CUDA_HOME, or put nvcc on PATH (CUDA 12.4+; 13.0 tested)")
    arch = arch or default_arch()
    variant = variant or Variant.current()
    src = src or source_dir()
    key = build_key(src, variant, arch, nvcc, compile_only)
    out_dir = cache_dir() / f"{variant.name}-{arch}-{key}"
    lib = out_dir / f"flashmoe_{variant.name}.so"
    marker = out_dir / "build.json"
    cache_dir().mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with FileLock(str(cache_dir() / f"{key}.lock"), timeout=1800):
        if marker.is_file():
            info = json.loads(marker.read_text())
            return BuildResult(None if compile_only else lib, key, True, time.perf_counter() - t0, tuple(Path(p) for p in info["objects"]))
        tmp = Path(str(out_dir) + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        objects = _compile(src, tmp, arch, variant, nvcc, compile_only)
        seconds = time.perf_counter() - t0
        (tmp / "build.json").write_text(
            json.dumps({"key": key, "arch": arch, "variant": variant.name, "seconds": round(seconds, 1), "compile_only": compile_only, "objects": [str(out_dir / o.name) for o in objects]}, indent=1)
        )
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    return BuildResult(None if compile_only else lib, key, False, seconds, tuple(out_dir / o.name for o in objects))


def _compile(src: Path, out: Path, arch: str, variant: Variant, nvcc: str, compile_only: bool) -> list[Path]:
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
        nvcc, "-c", str(src / "kernel.cu"), "-o", str(kernel_o), "-rdc=true", _gencode(arch), "-std=c++17", "-O3",
        "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr", "-lineinfo", "-Xptxas=-v" if verbose else "-Xptxas=-O3",
        abi, *defines, *includes,
    ]
    cxx = os.environ.get("CXX", "g++")
    bind_cmd = [cxx, "-c", str(src / "bindings.cpp"), "-o", str(bind_o), "-std=c++20", "-O2", "-fPIC", abi, *defines, *includes, *torch_includes]
    _wait_all([("nvcc kernel.cu", _run(nvcc_cmd, verbose)), ("c++ bindings.cpp", _run(bind_cmd, verbose))])
    # Device link: resolves NVSHMEM's device symbols (relocatable device code) into this library.
    dlink_cmd = [nvcc, "-dlink", str(kernel_o), str(nv / "lib" / "libnvshmem_device.a"), "-o", str(dlink_o), _gencode(arch), "-Xcompiler", "-fPIC"]
    _wait_all([("nvcc -dlink", _run(dlink_cmd, verbose))])
    objects = [kernel_o, dlink_o, bind_o]
    if compile_only:
        return objects
    torch_lib = Path(torch.__file__).parent / "lib"
    link_cmd = [
        cxx, "-shared", "-Wl,--no-undefined", "-o", str(out / f"flashmoe_{variant.name}.so"), *map(str, objects),
        # The device archive again, for its host half: the registration stubs of its device modules and the
        # NVSHMEM init entry point that installs this library's device state.
        str(nv / "lib" / "libnvshmem_device.a"),
        f"-L{nv / 'lib'}", "-l:libnvshmem_host.so.3", f"-Wl,-rpath,{nv / 'lib'}",
        f"-L{torch_lib}", "-lc10", "-ltorch", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}",
        f"-L{cuda_home / 'lib64'}", "-lcudart", "-lcuda",
    ]
    _wait_all([("link", _run(link_cmd, verbose))])
    return objects


_loaded: dict[str, object] = {}


def load(variant: Variant | None = None):
    """Build if needed and load the kernel library; returns ``torch.ops.<namespace>``."""
    import torch

    variant = variant or Variant.current()
    if variant.name not in _loaded:
        result = build(variant=variant)
        torch.ops.load_library(str(result.library))
        _loaded[variant.name] = getattr(torch.ops, variant.ops_namespace)
    return _loaded[variant.name]


def cache_has_any_build() -> bool:
    root = cache_dir()
    return root.is_dir() and any(root.glob("*/flashmoe_*.so"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashmoe.jit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default=None, help="e.g. sm_90a (default: FLASHMOE_ARCH or the running GPU)")
    ap.add_argument("--compile-only", action="store_true", help="compile and device-link, do not link or load (no GPU needed)")
    ap.add_argument("--variant", choices=["default", "stress"], default=None, help="default: from FLASHMOE_STRESS_DELAY_NS")
    args = ap.parse_args(argv)
    if args.variant == "stress" and env_int("FLASHMOE_STRESS_DELAY_NS") <= 0:
        os.environ["FLASHMOE_STRESS_DELAY_NS"] = "2000"
    variant = Variant.current() if args.variant != "default" else Variant("default", "flashmoe", ("FLASHMOE_OPS=flashmoe",))
    try:
        res = build(arch=args.arch, compile_only=args.compile_only, variant=variant)
    except FlashMoEBuildError as e:
        print(e, file=sys.stderr)
        return 1
    what = "objects" if args.compile_only else "library"
    target = res.objects if args.compile_only else res.library
    print(f"flashmoe.jit: {variant.name} {'cache hit' if res.cached else f'built in {res.seconds:.1f} s'} (key {res.key}); {what}: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
