"""The per-rank HTTP exporter (``FLASHMOE_METRICS_PORT``): for multi-node runs or engines without a /metrics.

It runs in a small process of its own (:func:`main`, started by the rank's first layer), not in the
engine's: formatting a scrape of a 48-layer model is ~40 ms of Python, and inside the
engine's process that holds the GIL its step loop needs (with DP, every rank then waits for the stalled one at
the next step's sync). The rank writes its series once a second as a snapshot file (the bridge's format,
:func:`.bridge.write_snapshot`) into a private directory; the exporter process serves that file with the
bridge's collector and exits when the rank does.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from .. import config

logger = logging.getLogger("flashmoe")

READY = "flashmoe-exporter: serving"
START_TIMEOUT_S = 30.0

_snapshot_path: str | None = None


def start_exporter() -> str | None:
    """Serve this rank's series on ``FLASHMOE_METRICS_PORT`` + local rank, if the port is set; return the
    snapshot path this process must write (None: no exporter). Failing to serve logs a warning, never raises."""
    global _snapshot_path
    port = config.metrics_port()
    if port <= 0 or _snapshot_path is not None:
        return _snapshot_path
    port += local_rank()
    addr = config.metrics_addr()
    directory = tempfile.mkdtemp(prefix="flashmoe-exporter-")
    # -c, not -m: the package imports this module, and runpy warns when it runs a module already imported.
    cmd = [sys.executable, "-c", "import sys; from flashmoe.metrics.exporter import main; sys.exit(main())"]
    cmd += ["--dir", directory, "--port", str(port), "--addr", addr, "--parent", str(os.getpid())]
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    try:  # stderr stays the rank's: whatever the exporter says lands in the engine's log
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    except OSError as e:
        logger.warning("flashmoe metrics: cannot start the exporter process (%s); exporter disabled", e)
        shutil.rmtree(directory, ignore_errors=True)
        return None
    line = _first_line(proc, START_TIMEOUT_S)
    if not line.startswith(READY):
        proc.kill()
        shutil.rmtree(directory, ignore_errors=True)
        logger.warning(
            "flashmoe metrics: cannot serve on %s:%d (%s); exporter disabled", addr, port, line.strip()
        )
        return None
    atexit.register(_stop, proc, directory)
    logger.info("flashmoe metrics: exporter on http://%s:%d/metrics (pid %d)", addr, port, proc.pid)
    _snapshot_path = os.path.join(directory, f"flashmoe-{os.getpid()}.json")
    return _snapshot_path


def snapshot_path() -> str | None:
    """Where this rank writes the series its exporter serves (None: no exporter)."""
    return _snapshot_path


def _first_line(proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.1):
                return proc.stdout.readline() or f"exited with {proc.wait()}"
            if proc.poll() is not None:
                return f"exited with {proc.returncode}"
    return f"no answer in {timeout_s:.0f} s"


def _stop(proc: subprocess.Popen, directory: str) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
    shutil.rmtree(directory, ignore_errors=True)


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


def main(argv=None) -> int:
    """The exporter process: serve ``--dir``'s snapshot until ``--parent`` exits."""
    ap = argparse.ArgumentParser(description="flashmoe's per-rank Prometheus exporter (started by the rank)")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--addr", default="0.0.0.0")
    ap.add_argument("--parent", type=int, required=True)
    args = ap.parse_args(argv)
    import prometheus_client

    from .bridge import WorkerFilesCollector

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
