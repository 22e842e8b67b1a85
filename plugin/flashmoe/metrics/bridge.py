"""Gets worker-process metrics onto an HTTP server's ``/metrics`` when prometheus multiprocess mode is off.

vLLM serves ``/metrics`` from its API-server process, but the MoE layers run in EngineCore/worker
processes. vLLM reads other processes' metrics only through ``PROMETHEUS_MULTIPROC_DIR``, which it
sets only with ``--api-server-count > 1``; and by the time a plugin loads, the API server has
imported prometheus_client in single-process mode, which cannot be switched afterwards. So with one
API server and no user-set ``PROMETHEUS_MULTIPROC_DIR``:

- the serving process calls :func:`install_consumer` (the vLLM plugin's ``register()``, before the
  engine is spawned): it makes a private directory, exports ``FLASHMOE_METRICS_BRIDGE_DIR`` to the
  processes it spawns, and registers a collector that merges the files found there;
- each worker (:func:`producer_path`) writes its flashmoe series to ``<dir>/flashmoe-<pid>.json`` about
  once a second (atomic rename): families with their samples as (name, labels, value), read off the
  metric objects. The worker never formats Prometheus text: that cost ~40 ms of Python per write for
  a 48-layer model, and the GIL it held stalled the engine's step loop; the serving process builds the
  families at scrape time.

Workers with a per-rank exporter (``FLASHMOE_METRICS_PORT``) write their snapshot for the exporter process
(:mod:`.exporter`) instead: a scrape of both would count every series twice. Files of dead processes are dropped at scrape time; the serving
process skips its own file (its metrics are in its registry already).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile

from .. import config
from .snapshots import WorkerFilesCollector, remove_snapshot, snapshot_path, write_snapshot

logger = logging.getLogger("flashmoe")


_consumer_dir: str | None = None


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir") or None


def install_consumer(registry=None) -> str | None:
    """Make this process serve its child processes' flashmoe metrics; return the bridge directory.

    No-op (None) when prometheus multiprocess mode is on (its own collector already merges every
    process) or when this process is itself a child of a consumer. Idempotent.
    """
    global _consumer_dir
    if _consumer_dir is not None:
        return _consumer_dir
    if multiprocess_dir() is not None or config.metrics_bridge_dir():
        return None
    import prometheus_client

    path = tempfile.mkdtemp(prefix="flashmoe-metrics-")
    config.set_metrics_bridge_dir(path)
    (registry if registry is not None else prometheus_client.REGISTRY).register(WorkerFilesCollector(path))
    atexit.register(shutil.rmtree, path, True)
    _consumer_dir = path
    logger.debug("flashmoe metrics: serving worker metrics from %s", path)
    return path


def producer_path() -> str | None:
    """Where this process should write its metrics, or None when it need not."""
    if multiprocess_dir() is not None:
        return None
    if config.metrics_port() > 0:
        return None  # the per-rank exporter serves these series; bridging them too would double-count
    path = config.metrics_bridge_dir()
    if not path or path == _consumer_dir:
        return None  # not spawned under a consumer, or we are the consumer (metrics already in REGISTRY)
    return snapshot_path(path)


__all__ = ["WorkerFilesCollector", "install_consumer", "producer_path", "remove_snapshot", "write_snapshot"]
