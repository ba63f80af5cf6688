"""/metrics: Prometheus text rendered from the segment by one collector.

No per-process metric files: every process counts into its row of the segment, and this
collector reads the segment when scraped, so any process (the admin listener, a test,
``inspect``) sees the same figures -- the ones ``snapshot.figures`` declares.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ankusa_shm.shm import snapshot
from ankusa_shm.shm.segment import Segment

PREFIX = "ankusa_"


class SegmentCollector(Collector):
    def __init__(self, seg: Segment) -> None:
        self._seg = seg

    def collect(self) -> Iterator[Metric]:
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for fig in snapshot.figures(snapshot.take(self._seg)):
            fam = families.get(fig.family)
            if fam is None:
                kind = CounterMetricFamily if fig.kind == "counter" else GaugeMetricFamily
                labels = [k for k, _ in fig.labels]
                fam = families[fig.family] = kind(PREFIX + fig.family, fig.help, labels=labels)
            fam.add_metric([v for _, v in fig.labels], fig.value)
        yield from families.values()


def render(seg: Segment) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SegmentCollector(seg))
    return generate_latest(registry)
