"""Per-layer Prometheus metrics: latency, SM utilization, token and byte traffic, fallbacks.

Sources:
- megakernel layers: the kernel's device ring and totals (:mod:`.ring`), attached
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
with several API servers), through :mod:`.bridge` on vLLM's single API server, and on a per-rank
exporter process (:mod:`.exporter`) when ``FLASHMOE_METRICS_PORT`` is set. The bridge and the exporter
read a snapshot this process writes as data once a second: Prometheus text is never formatted in the
engine's process (it held the GIL long enough to stall the step loop). ``FLASHMOE_METRICS=0`` turns all
of it off (read once per process).

This module holds the per-process state (registered layers, host-timed calls not yet folded in) and
the public functions; :mod:`.ring` is the kernel's record layout and decoder, :mod:`.poller` the
background thread and the device copies, :mod:`.families` the prometheus_client objects, :mod:`.snapshots`
the snapshot files and the collector that reads them.
"""

from __future__ import annotations

import atexit
import threading
from dataclasses import dataclass

import torch

from .. import config
from . import bridge, exporter
from . import ring as layout
from .exporter import default_rank, start_exporter
from .families import FAMILIES, LATENCY_BUCKETS_S, Families, child_value, histogram_buckets, observe_many
from .poller import POLL_INTERVAL_S, DeviceSource, PollerThread

_lock = threading.RLock()  # registration, attach, and one poll at a time
_families: Families | None = None
_layers: list[_LayerSeries] = []
_poller: PollerThread | None = None
_source: DeviceSource | None = None
_bridge_path: str | None = None
_dirty = False  # something changed since the bridge snapshot was written
_host_calls: list[tuple[int, float, int]] = []  # (layer_id, seconds, tokens) not yet in the metrics
_fallback_counts: dict[str, int] = {}  # reason -> layers, for the bridge snapshot


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
    """``FLASHMOE_METRICS``, read once per process (the kernel's records and the export agree)."""
    return config.metrics_enabled()


def register_layer(name: str, backend: str, *, ep_rank: int | None = None) -> int:
    """A small integer id for the layer (the kernel's ring label); creates its series.

    ``ep_rank``: this process's rank in the layer's EP group (default: the torch.distributed rank).
    """
    with _lock:
        if ep_rank is None:
            ep_rank = default_rank()
        layer_id = len(_layers)
        if layer_id >= layout.MAX_LAYERS:
            raise ValueError(f"more than {layout.MAX_LAYERS} flashmoe layers in one process")
        series = _LayerSeries(name, backend, ep_rank)
        _layers.append(series)
        if enabled():
            _create_children(_get_families(), series)
            if layer_id == 0:  # only where layers run: not in an API server that records a fallback
                start_exporter()
            _ensure_poller()
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
    with _lock:
        _get_families().fallbacks.labels(reason=reason).inc()
        _fallback_counts[reason] = _fallback_counts.get(reason, 0) + 1
        _dirty = True


def attach_device_source(ring: torch.Tensor, totals: torch.Tensor, *, interval_s: float = POLL_INTERVAL_S):
    """Export the kernel's records from ``ring`` and ``totals``; the op calls it for each megakernel layer.

    ``ring``: int64 [slots, 16], ``totals``: int64 [layers, 4] (layout in :mod:`.ring`), CUDA or CPU.
    The same pair again is a no-op; a new pair (buffers grown) replaces the earlier source, whose last
    records are read first. Returns the polling thread, or None when metrics are off.
    """
    global _source
    if not enabled():
        return None
    layout.check_buffers(ring, totals)
    with _lock:
        _get_families()
        poller = _ensure_poller(interval_s)
        if _source is not None and _source.ring is ring and _source.totals is totals:
            return poller
        if _source is not None:
            _poll_once()
            _source.close()
        _source = DeviceSource(ring, totals)
        return poller


def flush() -> None:
    """Read the device source and write the bridge snapshot now (tests, shutdown)."""
    with _lock:
        if _poller is not None:
            _poll_once()


def registry():
    """The flashmoe-only prometheus ``CollectorRegistry`` (what the snapshots are read from), or None when
    metrics are off. The same metrics are also in prometheus_client's default registry."""
    return _get_families().registry if enabled() else None


def install_worker_bridge() -> str | None:
    """In the process that serves ``/metrics`` (the vLLM plugin's ``register()``), before workers
    are spawned: see :mod:`.bridge`. Returns the bridge directory or None if unneeded."""
    if not enabled():
        return None
    return bridge.install_consumer()


def _get_families() -> Families:
    global _families
    with _lock:
        if _families is None:
            _families = Families()
            if bridge.producer_path() is not None:
                _ensure_poller()  # writes the bridge snapshot
        return _families


def _create_children(fam: Families, s: _LayerSeries) -> None:
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
        series = _LayerSeries(f"layer_id_{len(_layers)}", "megakernel", default_rank())
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


def _apply_device(windows: list[layout.LayerWindow], deltas: list[layout.TotalsDelta]) -> None:
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


def _poll_once() -> None:
    """Fold in host-timed calls, read the device source, write the bridge snapshot (the thread's poll)."""
    global _dirty
    with _lock:
        _apply_host_calls()
        if _source is not None:
            _apply_device(*_source.read())
        target = _snapshot_target()
        if target is not None and _dirty:
            _dirty = False
            bridge.write_snapshot(target, _snapshot())


def _snapshot_target() -> str | None:
    """Where this process's snapshot goes: its exporter process's file, else the bridge's, else nowhere."""
    return exporter.snapshot_path() or _bridge_path


def _snapshot() -> dict:
    """This process's flashmoe series for the bridge (:func:`bridge.write_snapshot`), read off the metric
    children. Formatting them as Prometheus text here (``write_to_textfile``: ~40 ms of Python for 48
    layers) held the GIL long enough to stall the engine's step loop once a second (benchmarks/kernel-notes.md,
    "What the serving profile showed"); the serving process formats them at scrape time instead."""
    from prometheus_client.utils import floatToGoString

    from .. import __version__

    samples: dict[str, list] = {name: [] for name in FAMILIES}
    hist = samples["flashmoe_layer_latency_seconds"]
    bounds = [floatToGoString(b) for b in LATENCY_BUCKETS_S] + ["+Inf"]
    for s in _layers:
        if s.latency is None:
            continue
        labels = {"layer": s.name, "ep_rank": str(s.ep_rank)}
        counts, total = histogram_buckets(s.latency)
        cumulative = 0.0
        for le, n in zip(bounds, counts, strict=True):
            cumulative += n
            hist.append(["flashmoe_layer_latency_seconds_bucket", {**labels, "le": le}, cumulative])
        hist.append(["flashmoe_layer_latency_seconds_count", labels, cumulative])
        hist.append(["flashmoe_layer_latency_seconds_sum", labels, total])
        for family, child in (
            ("flashmoe_calls", s.calls),
            ("flashmoe_tokens_dispatched", s.tokens),
            ("flashmoe_token_rows_dispatched", s.rows),
            ("flashmoe_remote_bytes", s.remote_bytes),
        ):
            if child is not None:
                samples[family].append([f"{family}_total", labels, child_value(child)])
        if s.utilization is not None:
            samples["flashmoe_sm_utilization_ratio"].append(
                ["flashmoe_sm_utilization_ratio", labels, child_value(s.utilization)]
            )
        info = {**labels, "backend": s.backend, "version": __version__}
        samples["flashmoe_backend_info"].append(["flashmoe_backend_info", info, 1.0])
    for reason, n in _fallback_counts.items():
        samples["flashmoe_fallback"].append(["flashmoe_fallback_total", {"reason": reason}, float(n)])
    return {
        "families": [
            {"name": name, "type": FAMILIES[name][0], "help": FAMILIES[name][1], "samples": rows}
            for name, rows in samples.items()
            if rows
        ]
    }


def _on_stop() -> None:
    target = _snapshot_target()
    if target is not None:
        bridge.remove_snapshot(target)
    if _source is not None:
        _source.close()


def _ensure_poller(interval_s: float = POLL_INTERVAL_S) -> PollerThread:
    global _poller, _bridge_path
    with _lock:
        if _poller is None:
            _bridge_path = bridge.producer_path()
            _poller = PollerThread(_poll_once, _on_stop, interval_s)
            _poller.start()
            atexit.register(_poller.stop)
        else:
            _poller.set_interval(interval_s)
        return _poller


__all__ = [
    "LATENCY_BUCKETS_S",
    "attach_device_source",
    "enabled",
    "flush",
    "install_worker_bridge",
    "observe_many",
    "record_fallback",
    "record_host_call",
    "register_layer",
    "registry",
]
