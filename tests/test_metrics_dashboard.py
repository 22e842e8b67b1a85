"""The Grafana dashboard (deploy/grafana/flashmoe-dashboard.json) queries only series flashmoe exports
and plots what the issue asks for: per-layer latency and SM utilization."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from flashmoe import metrics

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "flashmoe-dashboard.json"
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}


def _exported_series() -> set[str]:
    if metrics.registry() is None:
        pytest.skip("FLASHMOE_METRICS=0 in this environment")
    return {fam.name + suffix for fam in metrics.registry().collect() for suffix in SUFFIXES[fam.type]}


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"variable {var['name']}", var["definition"]))
    return out


def test_dashboard_queries_only_exported_series_and_balances_brackets():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = _exported_series()
    queries = _queries(dashboard)
    assert queries
    for title, expr in queries:
        names = set(re.findall(r"\bflashmoe_[a-z_]+", expr))
        assert names, f"{title}: no flashmoe series in {expr!r}"
        assert names <= exported, (
            f"{title}: {sorted(names - exported)} not exported (have {sorted(exported)})"
        )
        for open_, close in ("()", "{}", "[]"):
            assert expr.count(open_) == expr.count(close), f"{title}: unbalanced {open_}{close} in {expr!r}"


def test_dashboard_plots_per_layer_latency_and_sm_utilization():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    per_layer = [(t, e) for t, e in _queries(dashboard) if "by (le, layer)" in e or "by (layer)" in e]
    assert any(
        "flashmoe_layer_latency_seconds_bucket" in e and "histogram_quantile" in e for _, e in per_layer
    )
    util = [
        p
        for p in dashboard["panels"]
        if any("flashmoe_sm_utilization_ratio" in t["expr"] for t in p.get("targets", []))
    ]
    assert util and all(p["fieldConfig"]["defaults"]["unit"] == "percentunit" for p in util)
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
