"""The per-rank HTTP exporter (``FLASHMOE_METRICS_PORT``): for multi-node runs or engines without a /metrics."""

from __future__ import annotations

import logging
import os

import torch

from .. import config

logger = logging.getLogger("flashmoe")


def start_exporter(registry) -> None:
    """Serve ``registry`` on ``FLASHMOE_METRICS_PORT`` + local rank, if the port is set."""
    port = config.metrics_port()
    if port <= 0:
        return
    import prometheus_client

    port += local_rank()
    addr = config.metrics_addr()
    try:
        prometheus_client.start_http_server(port, addr=addr, registry=registry)
        logger.info("flashmoe metrics: exporter on http://%s:%d/metrics", addr, port)
    except OSError as e:
        logger.warning("flashmoe metrics: cannot serve on %s:%d (%s); exporter disabled", addr, port, e)


def default_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def local_rank() -> int:
    """LOCAL_RANK if a launcher set it, else the CUDA device in use, else the global rank."""
    if os.environ.get("LOCAL_RANK", "").isdigit():
        return int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return default_rank()
