"""``python -m flashmoe.build``: build the kernel library into the cache, or print its key (see flashmoe.build)."""

from __future__ import annotations

import argparse
import json
import sys

from .. import build as package
from .. import config
from ..errors import FlashMoEBuildError
from .cache import build, cache_entry, key_fields
from .recipe import Variant
from .toolchain import check_runnable, default_arch, find_nvcc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m flashmoe.build",
        description=package.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--arch", default=None, help="sm_90a, the only one (default: FLASHMOE_ARCH or the running GPU)"
    )
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
        choices=["default", "stress", "trace"],
        default=None,
        help="default: from FLASHMOE_STRESS_DELAY_NS / FLASHMOE_TRACE; stress: that delay, or 2000 ns if unset; trace: the timeline build",
    )
    ap.add_argument(
        "--puts",
        action="store_true",
        help="the put build (NVSHMEM device puts: multi-node EP, FLASHMOE_FORCE_PUT); flashmoe loads it for such layers",
    )
    args = ap.parse_args(argv)
    if args.variant == "stress":
        variant = Variant.stress(config.stress_delay_ns() or 2000)
    elif args.variant == "trace":
        variant = Variant.trace()
    elif args.variant == "default":
        variant = Variant.default()
    else:
        variant = Variant.current()
    if args.puts:
        variant = variant.with_puts()
    try:
        arch = check_runnable(args.arch or default_arch())
        if args.print_key:
            nvcc = find_nvcc()
            entry = cache_entry(arch, variant, nvcc=nvcc)
            print(
                json.dumps(
                    {
                        "key": entry.key,
                        "arch": entry.arch,
                        "variant": variant.name,
                        "cache_dir": str(config.cache_dir()),
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


if __name__ == "__main__":
    sys.exit(main())
