"""The metrics thread and the device copies it makes.

:class:`DeviceSource` copies the kernel's ring (twice) and totals to host memory and decodes them
(:mod:`.ring`); :class:`PollerThread` calls a poll function about once a second and once more at
exit. On CUDA the copies go to registered host memory on a stream of their own and are awaited
through an event, never a device sync; CPU tensors work too (the tests fill them by hand).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable

import torch

from . import ring as layout

logger = logging.getLogger("flashmoe")

POLL_INTERVAL_S = 1.0
COPY_TIMEOUT_S = 5.0

# cudaStreamCaptureModeThreadLocal (driver_types.h).
_CAPTURE_MODE_THREAD_LOCAL = 1


class DeviceSource:
    """One ring/totals pair the kernel writes: each :meth:`read` returns what is new since the last."""

    def __init__(self, ring: torch.Tensor, totals: torch.Tensor):
        self.ring, self.totals = ring, totals
        self._snapshot = HostSnapshot(ring, totals)
        self._decoder = layout.RingDecoder(ring.shape[0], totals.shape[0])
        self._tracker = layout.TotalsTracker(totals.shape[0])
        self._thread_ready: threading.Thread | None = None

    def read(self) -> tuple[list[layout.LayerWindow], list[layout.TotalsDelta]]:
        snap = self._snapshot
        me = threading.current_thread()
        if snap.is_cuda and isinstance(me, PollerThread) and self._thread_ready is not me:
            if not relax_capture_checks_for_this_thread():
                logger.warning(
                    "flashmoe metrics: could not put the metrics thread in thread-local CUDA graph capture mode; "
                    "a graph captured in global mode while it copies may fail"
                )
            self._thread_ready = me
        if not snap.take(COPY_TIMEOUT_S):
            logger.warning(
                "flashmoe metrics: device metrics copy did not finish in %.0f s; skipped", COPY_TIMEOUT_S
            )
            return [], []
        return self._decoder.decode(snap.first, snap.second), self._tracker.update(snap.totals)

    def close(self) -> None:
        self._snapshot.close()


class PollerThread(threading.Thread):
    """Calls ``poll`` every ``interval_s`` seconds; :meth:`stop` (registered at exit) polls once more."""

    def __init__(
        self, poll: Callable[[], None], on_stop: Callable[[], None], interval_s: float = POLL_INTERVAL_S
    ):
        super().__init__(name="flashmoe-metrics", daemon=True)
        self._interval_s = interval_s
        self._poll = poll
        self._on_stop = on_stop
        self._stop_event = threading.Event()
        # Set by set_interval: the thread drops the wait it is in, so a new interval counts from now
        # rather than after the old one runs out (a 1 s wait must not fire inside a 1 h interval).
        self._interval_changed = threading.Event()
        self._warned = False

    def set_interval(self, interval_s: float) -> None:
        if interval_s != self._interval_s:
            self._interval_s = interval_s
            self._interval_changed.set()

    def run(self) -> None:
        while True:
            woken = self._interval_changed.wait(self._interval_s)
            if self._stop_event.is_set():
                return
            if woken:
                self._interval_changed.clear()
                continue
            try:
                self._poll()
            except Exception:  # never take the server down; say it once
                if not self._warned:
                    logger.exception("flashmoe metrics: poll failed (further failures are not logged)")
                    self._warned = True

    def stop(self) -> None:
        self._stop_event.set()
        self._interval_changed.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=2 * COPY_TIMEOUT_S)
        try:
            self._poll()  # the last records and the final snapshot
        except Exception:
            logger.debug("flashmoe metrics: final poll failed", exc_info=True)
        self._on_stop()


class HostSnapshot:
    """Copies ring (twice) and totals to host buffers it owns; CUDA or CPU source alike.

    On CUDA the buffers are page-locked with ``cudaHostRegister`` (not torch's caching host
    allocator, whose per-copy events other threads would then query) and the copies run on a
    stream of their own, concurrently with whatever the compute streams are doing.
    """

    def __init__(self, ring: torch.Tensor, totals: torch.Tensor):
        layout.check_buffers(ring, totals)
        self._ring, self._totals = ring, totals
        self.first = torch.empty(ring.shape, dtype=torch.int64)
        self.second = torch.empty(ring.shape, dtype=torch.int64)
        self.totals = torch.empty(totals.shape, dtype=torch.int64)
        self.is_cuda = ring.is_cuda
        self._registered: list[int] = []
        if self.is_cuda:
            for buf in (self.first, self.second, self.totals):
                _host_register(buf)
                self._registered.append(buf.data_ptr())
            self._stream = torch.cuda.Stream(device=ring.device)
            self._done = torch.cuda.Event()

    def take(self, timeout_s: float) -> bool:
        """Fill ``first``, ``totals``, ``second`` (in that order); False if the copy did not finish in time."""
        if not self.is_cuda:
            self.first.copy_(self._ring)
            self.totals.copy_(self._totals)
            self.second.copy_(self._ring)
            return True
        with torch.cuda.device(self._ring.device), torch.cuda.stream(self._stream):
            self.first.copy_(self._ring, non_blocking=True)
            self.totals.copy_(self._totals, non_blocking=True)
            self.second.copy_(self._ring, non_blocking=True)
            self._done.record(self._stream)
        deadline = time.monotonic() + timeout_s
        while not self._done.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        return True

    def close(self) -> None:
        if self.is_cuda:
            # The event query returned or timed out; wait for our own stream only before unpinning.
            self._stream.synchronize()
            for ptr in self._registered:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            self._registered.clear()


def _host_register(buf: torch.Tensor) -> None:
    rc = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister of the metrics host buffer failed (cudaError {rc})")


def relax_capture_checks_for_this_thread() -> bool:
    """Switch the calling thread to ``cudaStreamCaptureModeThreadLocal``.

    vLLM and SGLang capture CUDA graphs in the default global mode, in which an event query or copy
    issued by *any* thread during the capture invalidates it. In thread-local mode our thread's
    calls are checked only against captures it started itself (none), as PyTorch's NCCL watchdog
    does. The mode lives in each CUDA runtime instance, so it is set in every libcudart loaded.
    Returns False if none could be found.
    """
    done = False
    for cudart in _loaded_cudarts():
        mode = ctypes.c_int(_CAPTURE_MODE_THREAD_LOCAL)
        done |= cudart.cudaThreadExchangeStreamCaptureMode(ctypes.byref(mode)) == 0
    return done


def _loaded_cudarts() -> list:
    """The CUDA runtime libraries in this process (torch's, and any an extension brought)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    except OSError:
        paths = []
    libs = []
    for path in paths or [None]:  # None: cudart linked statically into an already-loaded library
        try:
            lib = ctypes.CDLL(path)
            lib.cudaThreadExchangeStreamCaptureMode  # noqa: B018 (probe the symbol)
        except (OSError, AttributeError):
            continue
        libs.append(lib)
    return libs
