"""Prometheus text exposition (a /metrics scrape) as {(sample name, sorted labels): value}, for the tests
that read flashmoe's series the way an operator's scraper does."""

from prometheus_client.parser import text_string_to_metric_families


def metric_samples(text: str, prefix: str = "") -> dict[tuple[str, tuple], float]:
    """Every sample whose name starts with ``prefix``; labels as a sorted tuple of (name, value) pairs."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith(prefix)
    }
