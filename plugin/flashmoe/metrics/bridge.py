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
import json
import logging
import os
import re
import shutil
import tempfile

from .. import config

logger = logging.getLogger("flashmoe")

_FILE_RE = re.compile(r"^flashmoe-(\d+)\.json$")
_SUMMED_TYPES = ("counter", "histogram", "summary", "unknown", "untyped")

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
    return os.path.join(path, f"flashmoe-{os.getpid()}.json")


def write_snapshot(path: str, snapshot: dict) -> None:
    """``snapshot``: ``{"families": [{"name", "type", "help", "samples": [[name, labels, value], ...]}]}``."""
    tmp = f"{path}.tmp"
    text = json.dumps(snapshot, separators=(",", ":"))  # the C encoder (json.dump streams in Python)
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # a scrape reads the old file or the new one, never half of one


def remove_snapshot(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class WorkerFilesCollector:
    """A prometheus_client collector over the snapshot files of live worker processes.

    Families with the same name from several workers are merged into one (Prometheus rejects a
    repeated ``# TYPE``); identical series are summed for counters and histograms (e.g. the same
    fallback reason on two ranks) and take the maximum for gauges.
    """

    def __init__(self, path: str):
        self.path = path

    def collect(self):
        from prometheus_client.metrics_core import Metric

        merged: dict[str, tuple[Metric, dict]] = {}
        for snapshot in self._live_snapshots():
            try:
                families = [(f["name"], f["type"], f["help"], f["samples"]) for f in snapshot["families"]]
            except (KeyError, TypeError) as e:  # a writer of another flashmoe version, or a bug
                logger.warning("flashmoe metrics: skipping an unreadable worker snapshot: %r", e)
                continue
            for name, kind, documentation, rows in families:
                into = merged.get(name)
                if into is None:
                    into = merged[name] = (Metric(name, documentation, kind), {})
                family, samples = into
                for sample_name, labels, value in rows:
                    key = (sample_name, tuple(sorted(labels.items())))
                    old = samples.get(key)
                    if old is None:
                        samples[key] = (sample_name, labels, value)
                    elif family.type in _SUMMED_TYPES:
                        samples[key] = (sample_name, labels, old[2] + value)
                    else:
                        samples[key] = (sample_name, labels, max(old[2], value))
        for family, samples in merged.values():
            for sample_name, labels, value in samples.values():
                family.add_sample(sample_name, labels, value)
            yield family

    def _live_snapshots(self):
        try:
            names = sorted(os.listdir(self.path))
        except FileNotFoundError:
            return
        for name in names:
            m = _FILE_RE.match(name)
            if m is None:
                continue
            pid = int(m.group(1))
            file = os.path.join(self.path, name)
            if pid == os.getpid():
                continue
            if not _alive(pid):
                remove_snapshot(file)  # a worker that died without cleaning up; its series go away
                continue
            try:
                with open(file) as f:
                    snapshot = json.load(f)
            except FileNotFoundError:
                continue
            except ValueError as e:
                logger.warning("flashmoe metrics: skipping an unreadable worker snapshot %s: %s", file, e)
                continue
            yield snapshot


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
