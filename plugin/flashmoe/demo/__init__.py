"""Examples and tools around the op, apart from it: the README's demo and what the tests and benchmarks
use to serve a model.

    python -m flashmoe.demo                        # serve a tiny local Qwen3-MoE through vLLM, one request
    python -m flashmoe.demo.tiny_model DIR         # write that checkpoint (random seeded weights) to DIR

:class:`VLLMServer` (:mod:`.server`) starts and stops a vLLM OpenAI server; :mod:`.tiny_model` writes
the checkpoints and computes transformers' greedy reference.
"""

from .server import VLLMServer, free_port

__all__ = ["VLLMServer", "free_port"]
