"""The build recipe: the compile, device-link and link command lines, and the compile-time variants.

This file is part of the cache key (:func:`flashmoe.build.cache.build_key` hashes it), so any change to a
flag or a link input here makes a new cache entry.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import config
from ..errors import FlashMoEBuildError
from .toolchain import nvshmem_dir


@dataclass(frozen=True)
class Variant:
    name: str  # "default", "stress<ns>" or "trace"
    ops_namespace: str  # torch.ops.<ns>
    defines: tuple[str, ...]

    @staticmethod
    def default() -> Variant:
        return Variant("default", "flashmoe", ("FLASHMOE_OPS=flashmoe",))

    @staticmethod
    def stress(delay_ns: int) -> Variant:
        """Sleeps a random 0..delay_ns before each signal and wait (race hunting); its own op namespace."""
        return Variant(
            f"stress{delay_ns}",
            "flashmoe_stress",
            (f"FLASHMOE_STRESS_DELAY_NS={delay_ns}", "FLASHMOE_OPS=flashmoe_stress"),
        )

    @staticmethod
    def trace() -> Variant:
        """Records a tile-level timeline of each launch (csrc/flashmoe/trace.cuh); its own op namespace."""
        return Variant("trace", "flashmoe_trace", ("FLASHMOE_TRACE=1", "FLASHMOE_OPS=flashmoe_trace"))

    @staticmethod
    def current() -> Variant:
        """The variant FLASHMOE_STRESS_DELAY_NS or FLASHMOE_TRACE asks for (not both)."""
        delay = config.stress_delay_ns()
        if delay > 0 and config.trace():
            raise ValueError("FLASHMOE_STRESS_DELAY_NS and FLASHMOE_TRACE select different builds; set one")
        if delay > 0:
            return Variant.stress(delay)
        return Variant.trace() if config.trace() else Variant.default()


def _gencode(arch: str) -> str:
    num = arch.removeprefix("sm_")
    return f"-gencode=arch=compute_{num},code=sm_{num}"


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


def compile_objects(src: Path, out: Path, arch: str, variant: Variant, nvcc: str) -> list[Path]:
    import torch
    from torch.utils import cpp_extension

    verbose = config.jit_verbose()
    nv = nvshmem_dir()
    includes = [f"-I{src}", f"-I{nv / 'include'}"]
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


def link_library(out: Path, objects: list[Path], variant: Variant, nvcc: str, tmp_suffix: str = "") -> Path:
    """Host link of the library; needs no GPU and no driver.

    No ``-lcuda``: the objects call only the runtime API (libcudart, which finds the driver at run time) and
    NVSHMEM, so ``--no-undefined`` holds without the driver or the toolkit's ``lib64/stubs/libcuda.so``. A
    driver-API call added later fails this link loudly on a machine without a driver, rather than producing a
    library that cannot load.
    """
    import torch

    verbose = config.jit_verbose()
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
