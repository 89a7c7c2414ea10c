"""Scraping engines' /metrics served by local HTTP servers, and the Prometheus source."""

import asyncio
import json

import pytest
from aiohttp import web

from kvpilot.operator.scraper import (
    ADDRESS_MAP_ENV,
    AddressMap,
    PodTarget,
    PrometheusSource,
    ready_targets,
    scrape_pods,
)
from kvpilot.operator.signals import parse_metrics


@pytest.fixture
async def serve():
    """``await serve(handler)`` -> base URL of a local HTTP server answering ``/metrics``."""
    runners = []

    async def start(handler, path="/metrics"):
        app = web.Application()
        app.router.add_get(path, handler)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


def pod(name, ip, *, ready=True, port=None, deleting=False):
    containers = [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]
    metadata = {"name": name}
    if deleting:
        metadata["deletionTimestamp"] = "2026-11-30T10:00:00Z"
    return {
        "metadata": metadata,
        "spec": {"containers": containers if port else [{"name": "engine"}]},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_ready_targets_skip_unready_and_deleting_pods():
    pods = [
        pod("a", "10.0.0.1", port=9000),
        pod("b", "10.0.0.2", ready=False),
        pod("c", "10.0.0.3", deleting=True),
        pod("d", None),
        pod("e", "10.0.0.5"),
    ]
    assert ready_targets(pods) == [PodTarget("a", "10.0.0.1", 9000), PodTarget("e", "10.0.0.5")]


def test_address_map_from_env():
    mapping = AddressMap.from_env({ADDRESS_MAP_ENV: '{"10.0.0.1:8000": "http://127.0.0.1:5/"}'})
    assert mapping.metrics_url(PodTarget("a", "10.0.0.1")) == "http://127.0.0.1:5/metrics"
    assert mapping.metrics_url(PodTarget("b", "10.0.0.2", 81)) == "http://10.0.0.2:81/metrics"
    with pytest.raises(ValueError, match="not JSON"):
        AddressMap.from_env({ADDRESS_MAP_ENV: "10.0.0.1=foo"})
    with pytest.raises(ValueError, match="must map"):
        AddressMap.from_env({ADDRESS_MAP_ENV: '{"10.0.0.1:8000": 5}'})


async def test_scrape_reads_every_pod_and_reports_the_broken_ones(serve, exposition):
    async def healthy(kv, running):
        async def handler(request):
            return web.Response(
                text=exposition(kv=kv, running=running, waiting=1), content_type="text/plain"
            )

        return await serve(handler)

    async def failing(request):
        return web.Response(status=503, text="starting")

    async def hanging(request):
        await asyncio.sleep(5)
        return web.Response(text="")

    async def garbage(request):
        return web.Response(text="<html>hello</html>")

    urls = {
        "10.1.0.1:8000": await healthy(0.25, 2),
        "10.1.0.2:8000": await healthy(0.75, 6),
        "10.1.0.3:8000": await serve(failing),
        "10.1.0.4:8000": await serve(hanging),
        "10.1.0.5:8000": await serve(garbage),
    }
    targets = [PodTarget(f"p-{i}", f"10.1.0.{i}") for i in range(1, 6)]
    result = await scrape_pods(targets, 42.0, address_map=AddressMap(urls), timeout_seconds=0.5)
    assert [(s.pod, s.kv_cache_usage, s.num_requests_running) for s in result.samples] == [
        ("p-1", 0.25, 2),
        ("p-2", 0.75, 6),
    ]
    assert all(s.timestamp == 42.0 for s in result.samples)
    assert set(result.errors) == {"p-3", "p-4", "p-5"}
    assert "HTTP 503" in result.errors["p-3"]
    assert "no answer in 0.5s" in result.errors["p-4"]
    assert "not Prometheus text" in result.errors["p-5"] or "lacks" in result.errors["p-5"]


async def test_unreachable_pod_is_an_error_not_an_exception():
    # Port 9 on loopback: nothing listens there, the connection is refused.
    result = await scrape_pods(
        [PodTarget("gone", "127.0.0.1", 9)], 0.0, address_map=AddressMap(), timeout_seconds=1.0
    )
    assert result.samples == [] and "127.0.0.1:9" in result.errors["gone"]


async def test_prometheus_source_gives_the_same_samples_as_scraping(serve, exposition):
    texts = {
        "llm-0": exposition(kv=0.5, running=4, waiting=2, preemptions=3, ttft=(0.2, 0.7)),
        "llm-1": exposition(kv=0.9, running=8, waiting=0, capacity=65536),
    }
    queries = []

    async def query(request):
        # Answer as Prometheus' HTTP API does: the series of a scrape, with target labels added.
        queries.append(request.query["query"])
        result = []
        for name, text in texts.items():
            for line in text.splitlines():
                if line.startswith("#") or "_created" in line:
                    continue
                series, value = line.rsplit(" ", 1)
                metric_name, _, labels = series.partition("{")
                metric = {
                    "__name__": metric_name,
                    "pod": name,
                    "namespace": "team-a",
                    "job": "kvpilot",
                }
                for pair in labels.rstrip("}").split(","):
                    key, _, quoted = pair.partition("=")
                    metric[key] = json.loads(quoted)
                result.append({"metric": metric, "value": [1700000000.0, value]})
        return web.json_response(
            {"status": "success", "data": {"resultType": "vector", "result": result}}
        )

    base = await serve(query, path="/api/v1/query")
    source = PrometheusSource(base)
    result = await source.scrape("team-a", ["llm-0", "llm-1", "llm-2"], 7.0)
    assert 'namespace="team-a"' in queries[0] and 'pod=~"llm-0|llm-1|llm-2"' in queries[0]
    direct = {name: parse_metrics(text, name, 7.0) for name, text in texts.items()}
    assert {s.pod: s for s in result.samples} == direct
    assert "lacks" in result.errors["llm-2"]


async def test_an_ipv6_pod_is_scraped_at_its_bracketed_address(exposition):
    """Issue 15, bug 7: ``http://<podIP>:<port>`` without brackets is no URL for an IPv6 pod.
    A real HTTP server on the IPv6 loopback stands for the pod; nothing maps its address."""
    app = web.Application()
    app.router.add_get("/metrics", lambda _request: web.Response(text=exposition(kv=0.4)))
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "::1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        target = PodTarget("v6", "::1", port)
        assert target.address == f"[::1]:{port}"
        assert AddressMap().metrics_url(target) == f"http://[::1]:{port}/metrics"
        result = await scrape_pods([target], 1.0, address_map=AddressMap())
        assert result.errors == {}
        (sample,) = result.samples
        assert (sample.pod, sample.kv_cache_usage) == ("v6", pytest.approx(0.4))
    finally:
        await runner.cleanup()
