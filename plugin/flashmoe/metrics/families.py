"""The prometheus_client metric objects, and the one place that reaches into prometheus_client internals.

prometheus_client is imported when :class:`Families` is first built (at the first layer registration), never
at ``import flashmoe``: it fixes single- vs multiprocess mode at import, and SGLang sets
``PROMETHEUS_MULTIPROC_DIR`` only after loading plugins.
"""

from __future__ import annotations

import torch

# 10 us .. 10 s: a decode-step megakernel call on Hopper is tens of microseconds; the CPU reference
# with a large prefill takes seconds.
LATENCY_BUCKETS_S = (
    1e-5, 2.5e-5, 5e-5, 7.5e-5, 1e-4, 1.5e-4, 2.5e-4, 5e-4, 7.5e-4,
    1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip


# Family name -> (type, help). Counters are named without ``_total`` (prometheus_client adds it to the sample).
FAMILIES = {
    "flashmoe_layer_latency_seconds": (
        "histogram",
        "MoE layer call latency (megakernel: device time of sampled calls; reference: host time)",
    ),
    "flashmoe_sm_utilization_ratio": (
        "gauge",
        "Busy block-time over blocks x elapsed of the megakernel calls read in the last poll",
    ),
    "flashmoe_calls": ("counter", "MoE layer calls"),
    "flashmoe_tokens_dispatched": ("counter", "Tokens this rank fed into the layer"),
    "flashmoe_token_rows_dispatched": (
        "counter",
        "Token copies dispatch sent to ranks (one per destination rank, this rank included)",
    ),
    "flashmoe_remote_bytes": ("counter", "Bytes sent to other ranks (dispatch + combine)"),
    "flashmoe_fallback": ("counter", "Layers served by a fallback path instead of the megakernel"),
    "flashmoe_backend_info": ("gauge", "1 for each flashmoe layer; labels name its backend"),
}


def child_value(child) -> float:
    """A Counter or Gauge child's current value, as its sample shows it."""
    return child._value.get()


def histogram_buckets(child) -> tuple[list[float], float]:
    """A Histogram child's per-bucket counts (not cumulative; the last is +Inf) and its sum."""
    return [b.get() for b in child._buckets], child._sum.get()


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


class Families:
    """The metric objects: created once per process, registered in the default registry (what
    ``/metrics`` and the multiprocess directory see) and in a flashmoe-only registry (what the
    per-rank exporter and the bridge snapshot serve)."""

    def __init__(self):
        import prometheus_client as prom

        self.registry = prom.CollectorRegistry(auto_describe=True)
        per_layer = ("layer", "ep_rank")
        self.latency = prom.Histogram(
            "flashmoe_layer_latency_seconds",
            FAMILIES["flashmoe_layer_latency_seconds"][1],
            per_layer,
            buckets=LATENCY_BUCKETS_S,
            registry=None,
        )
        self.utilization = prom.Gauge(
            "flashmoe_sm_utilization_ratio",
            FAMILIES["flashmoe_sm_utilization_ratio"][1],
            per_layer,
            multiprocess_mode="mostrecent",
            registry=None,
        )
        self.calls = prom.Counter(
            "flashmoe_calls_total", FAMILIES["flashmoe_calls"][1], per_layer, registry=None
        )
        self.tokens = prom.Counter(
            "flashmoe_tokens_dispatched_total",
            FAMILIES["flashmoe_tokens_dispatched"][1],
            per_layer,
            registry=None,
        )
        self.rows = prom.Counter(
            "flashmoe_token_rows_dispatched_total",
            FAMILIES["flashmoe_token_rows_dispatched"][1],
            per_layer,
            registry=None,
        )
        self.remote_bytes = prom.Counter(
            "flashmoe_remote_bytes_total",
            FAMILIES["flashmoe_remote_bytes"][1],
            per_layer,
            registry=None,
        )
        self.fallbacks = prom.Counter(
            "flashmoe_fallback_total",
            FAMILIES["flashmoe_fallback"][1],
            ("reason",),
            registry=None,
        )
        self.info = prom.Gauge(
            "flashmoe_backend_info",
            FAMILIES["flashmoe_backend_info"][1],
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
