"""SGLang adapter: ``--moe-runner-backend flashmoe`` runs each MoE layer as one flashmoe call.

SGLang's plugin loader (entry point group ``sglang.srt.plugins``) calls :func:`register` in the
launcher and in every scheduler process. It adds the runner name, wraps the ``handle_a2a_moe``
resolution step (flashmoe -> ``moe_a2a_backend=customized``, ``ep_size=tp_size``) and registers
the runtime hooks listed in :mod:`.hooks`. SGLang only logs a plugin's exceptions, so every
misconfiguration is raised later, from the resolution step, where it stops the launch.

Importing this package imports neither SGLang nor ``prometheus_client``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

MIN_SGLANG = (
    0,
    5,
    23,
)  # first release with resolution hooks + runner-core registry + a2a "customized" dispatch
TESTED_SGLANG = ("0.5.23",)


def sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def unsupported_version_reason(found: str) -> str | None:
    """None if ``found`` has the extension points flashmoe needs, else why not."""
    try:
        parts = tuple(int(p) for p in found.split("+")[0].split(".")[:3])
    except ValueError:
        return None  # a dev build: trust the extension-point checks instead of the number
    if parts < MIN_SGLANG:
        need = ".".join(map(str, MIN_SGLANG))
        return (
            f"SGLang {found} is older than {need}: it has no resolution hooks and no MoE runner-core registry "
            f"(flashmoe needs SGLang >= {need})"
        )
    return None


def register() -> None:
    """Entry point ``sglang.srt.plugins: flashmoe``."""
    found = sglang_version()
    why = unsupported_version_reason(found)
    if why is not None:
        # Without the choice registered, '--moe-runner-backend flashmoe' gets SGLang's own
        # "invalid choice" error; this line says why.
        logger.error("flashmoe is not registered with SGLang: %s", why)
        return
    from .hooks import install

    install()


__all__ = ["register", "MIN_SGLANG", "TESTED_SGLANG"]
