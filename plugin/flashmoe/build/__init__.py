"""Build the CUDA sources on first use, cached by a hash of everything that goes into the binary.

    python -m flashmoe.build --arch sm_90a                  # no GPU needed: the full build (compile, device-link, link)
    python -m flashmoe.build --arch sm_90a --compile-only   # no GPU needed: compile and device-link only (CI check)
    python -m flashmoe.build --arch sm_90a --puts           # the put build (multi-node EP, FLASHMOE_FORCE_PUT)
    python -m flashmoe.build --arch sm_90a --print-key      # the key and library path, without building
    python -m flashmoe.build                                # build (if needed) for the running GPU

Only sm_90a is built (the megakernel runs on Hopper only); another --arch is refused. A build made without a GPU
or driver (the Docker image build) is the very library the runtime finds on an H100/H200. The link needs no driver:
nothing in the library calls the driver API (libcudart loads the driver at run time), so neither ``libcuda`` nor
its stub is linked. Shapes are runtime arguments of the kernel, so one build serves every layer of a topology: the
default build reaches peers by NVLink stores and compiles the fp8 kernel as a whole program (so ptxas honours
``setmaxnreg`` there); the put build adds NVSHMEM's device library (relocatable device code) for peers on other
nodes or ``FLASHMOE_FORCE_PUT``. The stress-test and trace builds are the other compile-time variants
(:class:`.recipe.Variant`; the code mode of each translation unit: ``recipe._kernel_units``).

Modules: :mod:`.toolchain` (sources, nvcc, NVSHMEM, arch), :mod:`.recipe` (command lines, variants), :mod:`.cache`
(key, cache entries, build and load), ``__main__`` (the command line).
"""

from .cache import BuildResult, CacheEntry, build, build_key, cache_entry, find_library, key_fields, load
from .recipe import Variant
from .toolchain import (
    RUNNABLE_ARCH,
    arch_for_capability,
    canonical_arch,
    check_runnable,
    find_nvcc,
    nvshmem_dir,
    runtime_arch,
    source_dir,
)

__all__ = [
    "RUNNABLE_ARCH",
    "BuildResult",
    "CacheEntry",
    "Variant",
    "arch_for_capability",
    "build",
    "build_key",
    "cache_entry",
    "canonical_arch",
    "check_runnable",
    "find_library",
    "find_nvcc",
    "key_fields",
    "load",
    "nvshmem_dir",
    "runtime_arch",
    "source_dir",
]
