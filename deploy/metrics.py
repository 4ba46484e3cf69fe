"""The HTTP ingress's /metrics: its own registry and every registered service's metrics.

Each service process (router, verifier, drafter pool; cluster/actors.py) serves its
own Prometheus registry over HTTP and registers the address as `meta["metrics"]`
in the state store. The ingress asks a router for those addresses
(`RouterHost.metrics_targets`), fetches them all at once with a short timeout,
labels every sample with `service` (the kind) and `instance` (the service id), and
merges the families: one HELP and TYPE per family, every service's samples under it.
A service that does not answer is left out and counted in
`specserve_metrics_scrape_errors_total{service}`.
"""

from __future__ import annotations

import asyncio
import urllib.request
from typing import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_S = 2.0
CONTENT_TYPE = "text/plain; version=0.0.4"

# (service kind, service id, metrics host:port), as RouterHost.metrics_targets lists them
Target = tuple[str, str, str]


class _Families:
    """Metric families merged by name; yields them to generate_latest as a Collector."""

    def __init__(self):
        self.families: dict[str, Metric] = {}

    def add(self, text: str, labels: dict[str, str]) -> None:
        """Every family of exposition `text`, each sample with `labels` added (a sample's own
        label of the same name is kept as `exported_<name>`, as Prometheus does). Raises
        ValueError if the text does not parse; nothing of it is added then."""
        self.extend(list(text_string_to_metric_families(text)), labels)

    def extend(self, families: Iterable[Metric], labels: dict[str, str]) -> None:
        for family in families:
            merged = self.families.get(family.name)
            if merged is None:
                merged = self.families[family.name] = Metric(family.name, family.documentation, family.type,
                                                             family.unit)
            elif merged.type != family.type:  # one name, two types: the first one seen wins
                continue
            for sample in family.samples:
                own = dict(sample.labels)
                for name in labels:
                    if name in own:
                        own[f"exported_{name}"] = own.pop(name)
                merged.samples.append(sample._replace(labels={**own, **labels}))

    def collect(self) -> Iterable[Metric]:
        return self.families.values()

    def text(self) -> str:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return generate_latest(registry).decode()


def merge(texts: Iterable[tuple[dict[str, str], str]]) -> str:
    """One exposition text of several: (labels to add to each sample, exposition text) pairs.
    A text that does not parse is left out."""
    families = _Families()
    for labels, text in texts:
        try:
            families.add(text, labels)
        except ValueError:
            continue
    return families.text()


def fetch(address: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> str:
    """The exposition text a service serves at `address` (host:port)."""
    host, _, port = address.rpartition(":")
    if ":" in host and not host.startswith("["):  # a bare IPv6 address
        host = f"[{host}]"
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as reply:
        return reply.read().decode("utf-8")


class ServiceScraper:
    """Gathers the services' metrics for the ingress, counting those that do not answer."""

    def __init__(self, timeout_s: float = SCRAPE_TIMEOUT_S):
        self.timeout_s = timeout_s
        self.registry = CollectorRegistry()
        self.errors = Counter("specserve_metrics_scrape_errors", "Services whose metrics did not answer or "
                              "did not parse when /metrics was asked", ["service"], registry=self.registry)

    async def exposition(self, own: Sequence[CollectorRegistry], targets: Sequence[Target]) -> str:
        """The registries `own` (unlabelled, this scraper's included) and every target's metrics."""
        texts = await asyncio.gather(*(self._scrape(t) for t in targets))
        families = _Families()
        for (kind, service_id, _), text in zip(targets, texts):
            if text is None:
                continue
            try:
                families.add(text, {"service": kind, "instance": service_id})
            except ValueError:
                self.errors.labels(kind).inc()
        # our own, with this call's scrape errors, first and unlabelled; then the services'
        out = _Families()
        for registry in (*own, self.registry):
            out.add(generate_latest(registry).decode(), {})
        out.extend(families.collect(), {})
        return out.text()

    async def _scrape(self, target: Target) -> str | None:
        kind, _, address = target
        try:
            return await asyncio.wait_for(asyncio.to_thread(fetch, address, self.timeout_s), self.timeout_s + 0.5)
        except Exception:  # noqa: BLE001 - gone, slow or refusing: left out, counted
            self.errors.labels(kind).inc()
            return None

    def router_failed(self) -> None:
        """The router that lists the services did not answer: only our own metrics are served."""
        self.errors.labels("router").inc()
