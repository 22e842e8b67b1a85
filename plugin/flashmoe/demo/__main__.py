"""The README's first command: serve a MoE model through vLLM with ``--moe-backend flashmoe``.

    python -m flashmoe.demo                      # tiny local Qwen3-MoE, 1 rank, CPU or GPU
    python -m flashmoe.demo --tp 2               # TP2 + EP2
    python -m flashmoe.demo --model DIR --dp 4   # any local checkpoint, DP4 + EP4

Starts vLLM's OpenAI server on 127.0.0.1, sends one greedy completion, prints it, and shuts the
server down.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from .server import VLLMServer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m flashmoe.demo",
        description="Serve a MoE model through vLLM with --moe-backend flashmoe, send one request.",
    )
    ap.add_argument(
        "--model", help="local checkpoint directory (default: a tiny Qwen3-MoE generated on the spot)"
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (EP over TP ranks)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel size (EP over DP ranks)")
    ap.add_argument("--prompt", default=None)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=300.0, help="server startup bound, seconds")
    ap.add_argument("vllm_args", nargs="*", help="extra vLLM arguments, after --")
    args = ap.parse_args(argv)

    import torch

    from .tiny_model import make_tiny_qwen3_moe, prompt_words

    model = args.model or make_tiny_qwen3_moe(Path(tempfile.gettempdir()) / "flashmoe-tiny-qwen3-moe")
    prompt = args.prompt or prompt_words(8, seed=0)
    extra = [
        "--enable-expert-parallel",
        "--tensor-parallel-size",
        str(args.tp),
        "--data-parallel-size",
        str(args.dp),
    ]
    if not torch.cuda.is_available():
        extra += ["--enforce-eager", "--max-model-len", "256"]
    server = VLLMServer(model, extra + args.vllm_args, startup_timeout=args.timeout)
    print(f"flashmoe demo: {' '.join(server.cmd)}", flush=True)
    t0 = time.monotonic()
    with server:
        print(f"  server up in {time.monotonic() - t0:.1f} s", flush=True)
        choice = server.complete(prompt, max_tokens=args.max_tokens)
        server.stop()
        log = server.log_path.read_text(errors="replace")  # read before the with block removes it
    for line in log.splitlines():
        if "flashmoe:" in line:
            print("  " + line.strip())
    print(f"prompt:     {prompt}\ncompletion: {choice['text']}")
    if args.model is None:
        print(
            "(the tiny model's weights are random, so the completion is gibberish: the demo shows the path works)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
