"""/metrics: Prometheus text rendered from the segment by one collector.

No per-process metric files: every process counts into its row of the segment, and this
collector reads the segment when scraped, so any process (the admin listener, a test,
``inspect``) sees the same figures -- the ones ``snapshot.figures`` declares. A scraper
that asks for OpenMetrics gets it.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest, openmetrics
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from ankusa_shm.shm import snapshot
from ankusa_shm.shm.segment import Segment

PREFIX = "ankusa_"
OPENMETRICS = openmetrics.exposition.CONTENT_TYPE_LATEST
TEXT = CONTENT_TYPE_LATEST

_KINDS = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


class SegmentCollector(Collector):
    def __init__(self, seg: Segment) -> None:
        self._seg = seg

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for fig in snapshot.figures(snapshot.take(self._seg)):
            fam = families.get(fig.family)
            if fig.kind == "histogram":
                hist = HistogramMetricFamily(PREFIX + fig.family, fig.help)
                buckets = [(_le(le), n) for le, n in fig.buckets]
                hist.add_metric([], buckets, fig.sum)
                families[fig.family] = hist
                continue
            if fam is None:
                labels = [k for k, _ in fig.labels]
                fam = families[fig.family] = _KINDS[fig.kind](
                    PREFIX + fig.family, fig.help, labels=labels
                )
            assert isinstance(fam, CounterMetricFamily | GaugeMetricFamily)
            fam.add_metric([v for _, v in fig.labels], fig.value)
        yield from families.values()


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def render(seg: Segment, accept: str = "") -> tuple[bytes, str]:
    """The exposition and its content type: OpenMetrics if ``accept`` asks for it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SegmentCollector(seg))
    if "application/openmetrics-text" in accept:
        text: bytes = openmetrics.exposition.generate_latest(registry)  # type: ignore[no-untyped-call]
        return text, OPENMETRICS
    return generate_latest(registry), TEXT
