"""Exceptions raised by flashmoe."""


class FlashMoEError(RuntimeError):
    """Base class for flashmoe runtime failures."""


class FlashMoEBuildError(FlashMoEError):
    """The JIT could not build the kernel (missing nvcc/NVSHMEM, compiler error)."""


class FlashMoETimeoutError(FlashMoEError):
    """A spin-wait inside the kernel expired; the message names the rank, the peer (or barrier) it waited for,
    the phase, the call and the block."""


class FlashMoEUnsupported(FlashMoEError):
    """The megakernel cannot serve this layer (the message says why); callers fall back."""
