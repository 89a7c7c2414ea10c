"""Reading the engines' metrics: every ready pod's ``/metrics``, or a Prometheus server.

Side effects live here; parsing is :func:`kvpilot.operator.signals.parse_metrics`.

Direct scraping (the default) fetches ``http://<podIP>:<port>/metrics`` from every ready pod
at once, each with its own timeout; a pod that fails is reported, not fatal. For large
clusters :class:`PrometheusSource` reads the same series from a Prometheus server with one
instant query instead.

**Address hook.** Pod IPs are not reachable from everywhere the operator runs (tests, an
operator outside the cluster). :class:`AddressMap` rewrites ``podIP:port`` to any base URL; it
comes from the environment variable ``KVPILOT_METRICS_ADDRESS_MAP``, a JSON object such as
``{"10.0.0.7:8000": "http://127.0.0.1:41234"}``. Addresses not in the map are used as they are.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvpilot.operator.signals import MetricSample, MetricsParseError, parse_metrics

ADDRESS_MAP_ENV = "KVPILOT_METRICS_ADDRESS_MAP"
DEFAULT_PORT = 8000
METRICS_PORT_NAME = "http"
SCRAPED_METRICS = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_bucket",
    "kvpilot:kv_cache_capacity_tokens",
    "kvpilot:max_concurrency",
)


@dataclass(frozen=True)
class PodTarget:
    """One ready engine pod to scrape.

    Attributes:
        name: pod name.
        ip: ``status.podIP``.
        port: the engine's HTTP port (the container port named ``http``, else 8000).
    """

    name: str
    ip: str
    port: int = DEFAULT_PORT

    @property
    def address(self) -> str:
        """``host:port`` as a URL writes it: an IPv6 address in brackets (``[fd00::7]:8000``)."""
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class AddressMap:
    """The documented hook: ``podIP:port`` -> base URL (scheme, host, port).

    Raises:
        ValueError: from :meth:`from_env` when the variable is not a JSON object of strings.
    """

    mapping: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> AddressMap:
        raw = environ.get(ADDRESS_MAP_ENV, "")
        if not raw:
            return cls()
        try:
            mapping = json.loads(raw)
        except json.JSONDecodeError as error:
            raise ValueError(f"{ADDRESS_MAP_ENV} is not JSON: {error}") from error
        if not isinstance(mapping, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
        ):
            raise ValueError(f'{ADDRESS_MAP_ENV} must map "ip:port" strings to URL strings')
        return cls(mapping)

    def metrics_url(self, target: PodTarget) -> str:
        """The URL of ``target``'s ``/metrics``."""
        base = self.mapping.get(target.address, f"http://{target.address}")
        return f"{base.rstrip('/')}/metrics"


def ready_targets(pods: Sequence[Mapping[str, Any]]) -> list[PodTarget]:
    """The pods (Kubernetes Pod objects as dicts) that are Ready, have an IP, and are not
    being deleted, as scrape targets."""
    targets = []
    for pod in pods:
        metadata, status = pod.get("metadata", {}), pod.get("status", {})
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions", [])
        )
        if not ready or not status.get("podIP") or metadata.get("deletionTimestamp"):
            continue
        targets.append(PodTarget(metadata["name"], status["podIP"], _http_port(pod)))
    return targets


def _http_port(pod: Mapping[str, Any]) -> int:
    for container in pod.get("spec", {}).get("containers", []):
        for port in container.get("ports", []):
            if port.get("name") == METRICS_PORT_NAME:
                return int(port["containerPort"])
    return DEFAULT_PORT


@dataclass(frozen=True)
class ScrapeResult:
    """One scrape round: the samples of the pods that answered, and why the others did not."""

    samples: list[MetricSample]
    errors: dict[str, str]


async def scrape_pods(
    targets: Sequence[PodTarget],
    timestamp: float,
    *,
    address_map: AddressMap | None = None,
    timeout_seconds: float = 2.0,
    session: aiohttp.ClientSession | None = None,
) -> ScrapeResult:
    """Fetch and parse every target's ``/metrics`` concurrently.

    Args:
        targets: ready pods.
        timestamp: stamped on every sample of this round, seconds.
        address_map: the address hook; ``AddressMap.from_env()`` when None.
        timeout_seconds: total time allowed per pod, seconds.
        session: an aiohttp session to reuse; a short-lived one when None.

    Returns:
        Samples of the pods that answered with valid metrics; pod name -> error for the rest.
    """
    address_map = address_map if address_map is not None else AddressMap.from_env()
    if session is None:
        async with aiohttp.ClientSession() as own:
            return await scrape_pods(
                targets,
                timestamp,
                address_map=address_map,
                timeout_seconds=timeout_seconds,
                session=own,
            )
    timeout = aiohttp.ClientTimeout(total=timeout_seconds)

    async def one(target: PodTarget) -> MetricSample | str:
        url = address_map.metrics_url(target)
        try:
            async with session.get(url, timeout=timeout) as response:
                if response.status != 200:
                    return f"GET {url}: HTTP {response.status}"
                text = await response.text()
            return parse_metrics(text, pod=target.name, timestamp=timestamp)
        except TimeoutError:
            return f"GET {url}: no answer in {timeout_seconds:g}s"
        except aiohttp.ClientError as error:
            return f"GET {url}: {error}"
        except MetricsParseError as error:
            return str(error)

    results = await asyncio.gather(*(one(t) for t in targets))
    samples = [r for r in results if isinstance(r, MetricSample)]
    errors = {t.name: r for t, r in zip(targets, results, strict=True) if isinstance(r, str)}
    return ScrapeResult(samples, errors)


@dataclass(frozen=True)
class PrometheusSource:
    """Reads the engines' series from a Prometheus server instead of the pods.

    One instant query (``GET /api/v1/query``) selects every series the autoscaler reads for
    the pods of one ``LLMDeployment``; the answer is turned back into exposition text per pod
    and parsed like a direct scrape, so both sources give the same samples.

    Attributes:
        url: Prometheus' base URL, e.g. ``http://prometheus.monitoring:9090``.
        pod_label: the series label that holds the pod name (``pod`` with the usual
            kube-prometheus relabelling).
        namespace_label: the series label that holds the namespace.
    """

    url: str
    pod_label: str = "pod"
    namespace_label: str = "namespace"

    def query(self, namespace: str, pods: Sequence[str]) -> str:
        """The PromQL selector for ``pods`` of ``namespace``."""
        names = "|".join(SCRAPED_METRICS)
        # Pod names are DNS labels: only "." is special in the regular expression.
        pod_regex = "|".join(pod.replace(".", "\\\\.") for pod in pods)
        return (
            f'{{__name__=~"{names}",{self.namespace_label}="{namespace}",'
            f'{self.pod_label}=~"{pod_regex}"}}'
        )

    async def scrape(
        self,
        namespace: str,
        pods: Sequence[str],
        timestamp: float,
        *,
        timeout_seconds: float = 5.0,
    ) -> ScrapeResult:
        """Query Prometheus for ``pods`` and return one sample per pod that has all series.

        Raises:
            aiohttp.ClientError, TimeoutError: Prometheus did not answer.
            ValueError: the answer is not a Prometheus vector result.
        """
        timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        params = {"query": self.query(namespace, pods)}
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                f"{self.url.rstrip('/')}/api/v1/query", params=params, timeout=timeout
            ) as response,
        ):
            body = await response.json()
        if body.get("status") != "success" or body["data"]["resultType"] != "vector":
            raise ValueError(f"Prometheus query failed: {body.get('error', body)}")
        lines: dict[str, list[str]] = defaultdict(list)
        for series in body["data"]["result"]:
            labels = dict(series["metric"])
            name, pod = labels.pop("__name__"), labels.pop(self.pod_label, None)
            if pod is None:
                continue
            rendered = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
            lines[pod].append(f"{name}{{{rendered}}} {series['value'][1]}")
        samples, errors = [], {}
        for pod in pods:
            try:
                samples.append(parse_metrics("\n".join(lines[pod]) + "\n", pod, timestamp))
            except MetricsParseError as error:
                errors[pod] = str(error)
        return ScrapeResult(samples, errors)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
