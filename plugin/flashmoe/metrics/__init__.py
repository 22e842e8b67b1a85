"""Per-layer Prometheus metrics: latency, SM utilization, token and byte traffic, fallbacks.

Sources:
- megakernel layers: the kernel's device ring and totals (:mod:`flashmoe.metrics.ring`), attached
  once with :func:`attach_device_source` and read by a background thread about once a second;
- reference layers (the CPU backend): host-timed calls, :func:`record_host_call`.

Metrics (labels ``layer``, ``ep_rank``)::

    flashmoe_layer_latency_seconds        histogram  per call; megakernel: device time, a sample if
                                                     more than 4096 calls happen between two reads
    flashmoe_sm_utilization_ratio         gauge      busy block-time / (blocks x elapsed), last ~1 s (megakernel)
    flashmoe_calls_total                  counter    exact
    flashmoe_tokens_dispatched_total      counter    tokens this rank fed into the layer, exact
    flashmoe_token_rows_dispatched_total  counter    token copies sent to ranks, itself included (megakernel)
    flashmoe_remote_bytes_total           counter    bytes sent to other ranks, dispatch + combine (megakernel)
    flashmoe_fallback_total{reason}       counter    layers that went to a fallback path
    flashmoe_backend_info{backend,version} gauge     1 per layer

Where they show up: in prometheus_client's default registry (an in-process ``/metrics``, or the
multiprocess directory when ``PROMETHEUS_MULTIPROC_DIR`` is set: SGLang ``--enable-metrics``, vLLM
with several API servers), through :mod:`flashmoe.metrics.bridge` on vLLM's single API server, and
on a per-rank exporter when ``FLASHMOE_METRICS_PORT`` is set. ``FLASHMOE_METRICS=0`` turns all of it
off (read once per process).

prometheus_client is imported at the first layer registration, never at ``import flashmoe``: it
fixes single- vs multiprocess mode at import, and SGLang sets ``PROMETHEUS_MULTIPROC_DIR`` only
after loading plugins.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from dataclasses import dataclass

import torch

from ..config import env, env_flag, env_int
from . import bridge as metrics_bridge
from . import ring as metrics_ring

logger = logging.getLogger("flashmoe")

# 10 us .. 10 s: a decode-step megakernel call on Hopper is tens of microseconds; the CPU reference
# with a large prefill takes seconds.
LATENCY_BUCKETS_S = (
    1e-5, 2.5e-5, 5e-5, 7.5e-5, 1e-4, 1.5e-4, 2.5e-4, 5e-4, 7.5e-4,
    1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip
POLL_INTERVAL_S = 1.0
COPY_TIMEOUT_S = 5.0

_lock = threading.RLock()  # registration, attach, and one poll at a time
_enabled: bool | None = None
_families: _Families | None = None
_layers: list[_LayerSeries] = []
_pump: _Pump | None = None
_dirty = False  # something changed since the bridge snapshot was written
_host_calls: list[tuple[int, float, int]] = []  # (layer_id, seconds, tokens) not yet in the metrics


@dataclass
class _LayerSeries:
    """One registered layer and its labelled children (None when metrics are off)."""

    name: str
    backend: str
    ep_rank: int
    latency: object = None
    calls: object = None
    tokens: object = None
    rows: object = None
    remote_bytes: object = None
    utilization: object = None  # created at the first value, so no layer reads 0 before it ran


def enabled() -> bool:
    """``FLASHMOE_METRICS``, read once per process (the kernel build and the export agree)."""
    global _enabled
    if _enabled is None:
        _enabled = env_flag("FLASHMOE_METRICS")
    return _enabled


def register_layer(name: str, backend: str, *, ep_rank: int | None = None) -> int:
    """A small integer id for the layer (the kernel's ring label); creates its series.

    ``ep_rank``: this process's rank in the layer's EP group (default: the torch.distributed rank).
    """
    with _lock:
        if ep_rank is None:
            ep_rank = _default_rank()
        layer_id = len(_layers)
        if layer_id >= metrics_ring.MAX_LAYERS:
            raise ValueError(f"more than {metrics_ring.MAX_LAYERS} flashmoe layers in one process")
        series = _LayerSeries(name, backend, ep_rank)
        _layers.append(series)
        if enabled():
            _create_children(_get_families(), series)
            _ensure_pump()
            if layer_id == 0:
                _start_exporter()  # only where layers run: not in an API server that records a fallback
        return layer_id


def record_host_call(layer_id: int, seconds: float, tokens: int) -> None:
    """One host-timed call of a layer that does not run the megakernel (the CPU reference).

    Costs one list append on the caller's thread; the background thread folds the calls into the
    metrics about once a second (:func:`flush` does it now).
    """
    if _layers[layer_id].latency is not None:
        _host_calls.append((layer_id, seconds, tokens))  # atomic under the GIL


def record_fallback(reason: str) -> None:
    """A layer went to a fallback path; ``reason`` is the one-line refusal."""
    global _dirty
    if not enabled():
        return
    _get_families().fallbacks.labels(reason=reason).inc()
    _dirty = True


def attach_device_source(ring: torch.Tensor, totals: torch.Tensor, *, interval_s: float = POLL_INTERVAL_S):
    """Start exporting the kernel's records; called once when the device buffers are allocated.

    ``ring``: int64 [slots, 16], ``totals``: int64 [layers, 4] (layout in :mod:`flashmoe.metrics.ring`),
    CUDA or CPU. Replaces an earlier source (its last records are read first). Returns None when
    metrics are off.
    """
    if not enabled():
        return None
    metrics_ring.check_buffers(ring, totals)
    with _lock:
        _get_families()
        pump = _ensure_pump(interval_s)
        pump.set_source(ring, totals)
        return pump


def flush() -> None:
    """Read the device source and write the bridge snapshot now (tests, shutdown)."""
    with _lock:
        if _pump is not None:
            _pump.poll_once()


def registry():
    """The flashmoe-only prometheus ``CollectorRegistry`` (what the per-rank exporter serves), or
    None when metrics are off. The same metrics are also in prometheus_client's default registry."""
    return _get_families().registry if enabled() else None


def install_worker_bridge() -> str | None:
    """In the process that serves ``/metrics`` (the vLLM plugin's ``register()``), before workers
    are spawned: see :mod:`flashmoe.metrics.bridge`. Returns the bridge directory or None if unneeded."""
    if not enabled():
        return None
    return metrics_bridge.install_consumer()


def observe_many(histogram, values: torch.Tensor) -> None:
    """``histogram.observe(v)`` for each value, in O(buckets) prometheus calls.

    Uses the child's bucket values the way ``Histogram.observe`` does (stable since
    prometheus_client 0.4; tests/test_metrics.py checks the equivalence); falls back to a loop.
    """
    if values.numel() == 0:
        return
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values.tolist():
            histogram.observe(v)
        return
    values = values.to(torch.float64)
    # observe() counts v in the first bucket with v <= bound; the last bound is +Inf.
    index = torch.searchsorted(torch.tensor(bounds, dtype=torch.float64), values, side="left")
    counts = torch.bincount(index, minlength=len(bounds))
    for i in counts.nonzero().flatten().tolist():
        buckets[i].inc(int(counts[i]))
    total.inc(float(values.sum()))


class _Families:
    """The metric objects: created once per process, registered in the default registry (what
    ``/metrics`` and the multiprocess directory see) and in a flashmoe-only registry (what the
    per-rank exporter and the bridge snapshot serve)."""

    def __init__(self):
        import prometheus_client as prom

        self.registry = prom.CollectorRegistry(auto_describe=True)
        per_layer = ("layer", "ep_rank")
        self.latency = prom.Histogram(
            "flashmoe_layer_latency_seconds",
            "MoE layer call latency (megakernel: device time of sampled calls; reference: host time)",
            per_layer,
            buckets=LATENCY_BUCKETS_S,
            registry=None,
        )
        self.utilization = prom.Gauge(
            "flashmoe_sm_utilization_ratio",
            "Busy block-time over blocks x elapsed of the megakernel calls read in the last poll",
            per_layer,
            multiprocess_mode="mostrecent",
            registry=None,
        )
        self.calls = prom.Counter("flashmoe_calls_total", "MoE layer calls", per_layer, registry=None)
        self.tokens = prom.Counter(
            "flashmoe_tokens_dispatched_total",
            "Tokens this rank fed into the layer",
            per_layer,
            registry=None,
        )
        self.rows = prom.Counter(
            "flashmoe_token_rows_dispatched_total",
            "Token copies dispatch sent to ranks (one per destination rank, this rank included)",
            per_layer,
            registry=None,
        )
        self.remote_bytes = prom.Counter(
            "flashmoe_remote_bytes_total",
            "Bytes sent to other ranks (dispatch + combine)",
            per_layer,
            registry=None,
        )
        self.fallbacks = prom.Counter(
            "flashmoe_fallback_total",
            "Layers served by a fallback path instead of the megakernel",
            ("reason",),
            registry=None,
        )
        self.info = prom.Gauge(
            "flashmoe_backend_info",
            "1 for each flashmoe layer; labels name its backend",
            (*per_layer, "backend", "version"),
            multiprocess_mode="max",
            registry=None,
        )
        for metric in (
            self.latency,
            self.utilization,
            self.calls,
            self.tokens,
            self.rows,
            self.remote_bytes,
            self.fallbacks,
            self.info,
        ):
            self.registry.register(metric)
            prom.REGISTRY.register(metric)


def _get_families() -> _Families:
    global _families
    with _lock:
        if _families is None:
            _families = _Families()
            if metrics_bridge.producer_path() is not None:
                _ensure_pump()  # writes the bridge snapshot
        return _families


def _create_children(fam: _Families, s: _LayerSeries) -> None:
    from .. import __version__

    labels = (s.name, str(s.ep_rank))
    s.latency = fam.latency.labels(*labels)
    s.calls = fam.calls.labels(*labels)
    s.tokens = fam.tokens.labels(*labels)
    if s.backend == "megakernel":
        s.rows = fam.rows.labels(*labels)
        s.remote_bytes = fam.remote_bytes.labels(*labels)
    fam.info.labels(*labels, s.backend, __version__).set(1)


def _series_for_device(layer_id: int) -> _LayerSeries:
    """The layer a kernel record names; one not registered here gets a placeholder name."""
    while len(_layers) <= layer_id:
        series = _LayerSeries(f"layer_id_{len(_layers)}", "megakernel", _default_rank())
        _layers.append(series)
        _create_children(_get_families(), series)
    series = _layers[layer_id]
    if series.rows is None:  # registered under another backend name; the kernel ran it anyway
        fam = _get_families()
        series.rows = fam.rows.labels(series.name, str(series.ep_rank))
        series.remote_bytes = fam.remote_bytes.labels(series.name, str(series.ep_rank))
    return series


def _apply_host_calls() -> None:
    global _dirty
    calls = _host_calls[:]
    if not calls:
        return
    del _host_calls[: len(calls)]  # appends that raced with the copy stay for the next poll
    by_layer: dict[int, list[tuple[float, int]]] = {}
    for layer_id, seconds, tokens in calls:
        by_layer.setdefault(layer_id, []).append((seconds, tokens))
    for layer_id, rows in by_layer.items():
        s = _layers[layer_id]
        observe_many(s.latency, torch.tensor([r[0] for r in rows], dtype=torch.float64))
        s.calls.inc(len(rows))
        s.tokens.inc(sum(r[1] for r in rows))
    _dirty = True


def _apply_device(windows: list[metrics_ring.LayerWindow], deltas: list[metrics_ring.TotalsDelta]) -> None:
    global _dirty
    fam = _get_families()
    for w in windows:
        s = _series_for_device(w.layer_id)
        observe_many(s.latency, w.latencies_s)
        util = w.sm_utilization
        if util is not None:
            if s.utilization is None:
                s.utilization = fam.utilization.labels(s.name, str(s.ep_rank))
            s.utilization.set(util)
    for d in deltas:
        s = _series_for_device(d.layer_id)
        s.calls.inc(d.calls)
        s.tokens.inc(d.tokens_in)
        s.rows.inc(d.rows_dispatched)
        s.remote_bytes.inc(d.remote_bytes)
    if windows or deltas:
        _dirty = True


class _Pump(threading.Thread):
    """The background thread: folds in host-timed calls, reads the device source, writes the
    bridge snapshot."""

    def __init__(self, interval_s: float, bridge_path: str | None):
        super().__init__(name="flashmoe-metrics", daemon=True)
        self.interval_s = interval_s
        self.bridge_path = bridge_path
        self._stop_event = threading.Event()
        self._snapshot: metrics_ring.HostSnapshot | None = None
        self._decoder: metrics_ring.RingDecoder | None = None
        self._totals: metrics_ring.TotalsTracker | None = None
        self._cuda_thread_ready = False
        self._warned = False

    def set_source(self, ring: torch.Tensor, totals: torch.Tensor) -> None:
        with _lock:
            if self._snapshot is not None:
                self.poll_once()
                self._snapshot.close()
            self._snapshot = metrics_ring.HostSnapshot(ring, totals)
            self._decoder = metrics_ring.RingDecoder(ring.shape[0], totals.shape[0])
            self._totals = metrics_ring.TotalsTracker(totals.shape[0])

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            try:
                self.poll_once()
            except Exception:  # never take the server down; say it once
                if not self._warned:
                    logger.exception("flashmoe metrics: poll failed (further failures are not logged)")
                    self._warned = True

    def poll_once(self) -> None:
        global _dirty
        with _lock:
            _apply_host_calls()
            if self._snapshot is not None:
                self._read_device()
            if self.bridge_path is not None and _dirty:
                _dirty = False
                metrics_bridge.write_snapshot(self.bridge_path, _get_families().registry)

    def _read_device(self) -> None:
        snap = self._snapshot
        if snap._cuda and threading.current_thread() is self and not self._cuda_thread_ready:
            if not metrics_ring.relax_capture_checks_for_this_thread():
                logger.warning(
                    "flashmoe metrics: could not put the metrics thread in thread-local CUDA graph capture mode; "
                    "a graph captured in global mode while it copies may fail"
                )
            self._cuda_thread_ready = True
        if not snap.take(COPY_TIMEOUT_S):
            logger.warning(
                "flashmoe metrics: device metrics copy did not finish in %.0f s; skipped", COPY_TIMEOUT_S
            )
            return
        windows = self._decoder.decode(snap.first, snap.second)
        deltas = self._totals.update(snap.totals)
        _apply_device(windows, deltas)

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=2 * COPY_TIMEOUT_S)
        try:
            self.poll_once()  # the last records and the final snapshot
        except Exception:
            logger.debug("flashmoe metrics: final poll failed", exc_info=True)
        if self.bridge_path is not None:
            metrics_bridge.remove_snapshot(self.bridge_path)
        if self._snapshot is not None:
            self._snapshot.close()


def _ensure_pump(interval_s: float = POLL_INTERVAL_S) -> _Pump:
    global _pump
    with _lock:
        if _pump is None:
            _pump = _Pump(interval_s, metrics_bridge.producer_path())
            _pump.start()
            atexit.register(_pump.stop)
        else:
            _pump.interval_s = interval_s
        return _pump


def _start_exporter() -> None:
    """The per-rank HTTP exporter, if ``FLASHMOE_METRICS_PORT`` asks for one."""
    port = env_int("FLASHMOE_METRICS_PORT")
    if port <= 0:
        return
    import prometheus_client

    port += _local_rank()
    addr = env("FLASHMOE_METRICS_ADDR")
    try:
        prometheus_client.start_http_server(port, addr=addr, registry=_families.registry)
        logger.info("flashmoe metrics: exporter on http://%s:%d/metrics", addr, port)
    except OSError as e:
        logger.warning("flashmoe metrics: cannot serve on %s:%d (%s); exporter disabled", addr, port, e)


def _default_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _local_rank() -> int:
    """LOCAL_RANK if a launcher set it, else the CUDA device in use, else the global rank."""
    if os.environ.get("LOCAL_RANK", "").isdigit():
        return int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return _default_rank()
