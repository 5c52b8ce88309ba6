"""Reading a real Prometheus endpoint in tests."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(address: str) -> dict[tuple[str, frozenset], float]:
    """``{(sample name, labels): value}`` of the endpoint ``host:port`` (``/metrics``, text format)."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    """The sample ``name`` with exactly ``labels`` (KeyError when absent)."""
    return samples[(name, frozenset({k: str(v) for k, v in labels.items()}.items()))]
