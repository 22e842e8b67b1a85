"""The per-rank HTTP exporter (``FLASHMOE_METRICS_PORT``): for multi-node runs or engines without a /metrics.

It runs in a small process of its own (:func:`.snapshots.main`, run by path, so it loads neither torch nor
flashmoe), started by the rank's first layer, not in the engine's: formatting a scrape of a 48-layer model
is ~40 ms of Python, and inside the engine's process that holds the GIL its step loop needs (with DP, every
rank then waits for the stalled one at the next step's sync). The rank writes its series once a second as a
snapshot file (:mod:`.snapshots`) into a private directory; the exporter process serves it and exits when
the rank does.
"""

from __future__ import annotations

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
from . import snapshots

logger = logging.getLogger("flashmoe")

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
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "snapshots.py")
    # Run by path through runpy, which (unlike `python script.py`) does not put the script's folder, with its
    # bridge.py and ring.py, first on sys.path.
    run = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    cmd = [sys.executable, "-c", run, script, "--dir", directory, "--port", str(port), "--addr", addr]
    cmd += ["--parent", str(os.getpid())]
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    try:  # stderr stays the rank's: whatever the exporter says lands in the engine's log
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    except OSError as e:
        logger.warning("flashmoe metrics: cannot start the exporter process (%s); exporter disabled", e)
        shutil.rmtree(directory, ignore_errors=True)
        return None
    line = _first_line(proc, START_TIMEOUT_S)
    if not line.startswith(snapshots.READY):
        proc.kill()
        shutil.rmtree(directory, ignore_errors=True)
        logger.warning(
            "flashmoe metrics: cannot serve on %s:%d (%s); exporter disabled", addr, port, line.strip()
        )
        return None
    atexit.register(_stop, proc, directory)
    logger.info("flashmoe metrics: exporter on http://%s:%d/metrics (pid %d)", addr, port, proc.pid)
    _snapshot_path = snapshots.snapshot_path(directory)
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
