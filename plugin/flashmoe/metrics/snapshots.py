"""The metrics snapshot files: what an engine process writes once a second and what serves them.

A snapshot is this process's flashmoe series as data (JSON: families, samples as [name, labels, value]), so
the engine's process never formats Prometheus text (that held the GIL ~40 ms per poll for a 48-layer model
and stalled the step loop). Two readers merge the live processes' files into families at scrape time: the
serving process of vLLM (:mod:`.bridge`) and the per-rank exporter process (:mod:`.exporter`), which runs
this file by path (``runpy.run_path``, see :func:`.exporter.start_exporter`): it imports only the standard
library and prometheus_client, not torch (~25 MB instead of ~240 MB per rank).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import time

logger = logging.getLogger("flashmoe")

FILE_RE = re.compile(r"^flashmoe-(\d+)\.json$")
READY = "flashmoe-exporter: serving"
_SUMMED_TYPES = ("counter", "histogram", "summary", "unknown", "untyped")


def snapshot_path(directory: str) -> str:
    """This process's snapshot file in ``directory`` (FILE_RE: readers find the writer's pid in the name)."""
    return os.path.join(directory, f"flashmoe-{os.getpid()}.json")


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
            m = FILE_RE.match(name)
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


def main(argv=None) -> int:
    """The exporter process: serve ``--dir``'s snapshots on ``--addr``:``--port`` until ``--parent`` exits."""
    ap = argparse.ArgumentParser(description="flashmoe's per-rank Prometheus exporter (started by the rank)")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--addr", default="0.0.0.0")
    ap.add_argument("--parent", type=int, required=True)
    args = ap.parse_args(argv)
    import prometheus_client

    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(WorkerFilesCollector(args.dir))
    try:
        prometheus_client.start_http_server(args.port, addr=args.addr, registry=registry)
    except OSError as e:
        print(f"flashmoe-exporter: {e}", flush=True)
        return 1
    print(f"{READY} {args.addr}:{args.port}", flush=True)
    while os.getppid() == args.parent:  # re-parented: the rank is gone
        time.sleep(1.0)
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
