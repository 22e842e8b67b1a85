"""Per-layer metrics (placeholder API; the metrics issue fills in the Prometheus export).

Contract used by the rest of the package:
- ``register_layer(name, backend) -> int``: a small integer layer id (also the kernel's ring label).
- ``record_host_call(layer_id, seconds, tokens)``: host-timed call (CPU reference backend).
- ``record_fallback(reason)``: a layer went to a fallback path.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_layers: list[tuple[str, str]] = []


def register_layer(name: str, backend: str) -> int:
    with _lock:
        _layers.append((name, backend))
        return len(_layers) - 1


def record_host_call(layer_id: int, seconds: float, tokens: int) -> None:
    pass


def record_fallback(reason: str) -> None:
    pass
