"""The adapter's logger: a child of vLLM's ``vllm`` logger, so lines carry vLLM's format and process prefix."""

from vllm.logger import init_logger

logger = init_logger("vllm.flashmoe")
