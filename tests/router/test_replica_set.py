"""The router's replica set as discovery drives it (``set_urls``), and its settings (pure:
nothing is polled)."""

from __future__ import annotations

import asyncio

import pytest

from kvpilot.router.config import RouterConfig
from kvpilot.router.replicas import ReplicaSet


def test_set_urls_keeps_known_replicas_and_rebuilds_the_ring() -> None:
    replicas = ReplicaSet([])
    assert replicas.all() == [] and replicas.ring is None and replicas.ready(None) == []
    replicas.set_urls(["http://a/", "http://b"])
    a = replicas.replicas["http://a"]
    a.in_flight, a.models, a.polled, a.max_model_len = 2, {"m"}, True, 512
    replicas.replicas["http://b"].models = {"m", "lora"}
    replicas.replicas["http://b"].max_model_len = 256
    assert [r.url for r in replicas.ready("m")] == ["http://a"]  # b not polled yet
    assert replicas.max_model_len("m") == 256 and replicas.max_model_len("lora") == 256
    replicas.set_urls(["http://c", "http://a"])
    assert replicas.replicas["http://a"] is a and a.in_flight == 2
    assert sorted(replicas.ring.names) == ["http://a", "http://c"]
    assert replicas.known_models() == {"m"}
    with pytest.raises(ValueError, match="given twice"):
        replicas.set_urls(["http://a", "http://a/"])


def test_wait_changed_returns_on_set_urls() -> None:
    async def scenario() -> bool:
        replicas = ReplicaSet(["http://a"])
        waiter = asyncio.ensure_future(replicas.wait_changed(60))
        await asyncio.sleep(0)
        replicas.set_urls(["http://a", "http://b"])
        await asyncio.wait_for(waiter, 10)
        return True

    assert asyncio.run(scenario())


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"routing_policy": "random"}, "--routing-policy must be one of kvpilot"),
        ({"kv_weight": -0.1}, "^--kv-weight must be >= 0, got -0.1$"),
        ({"load_factor": 0.5}, "--load-factor must be >= 1"),
        ({"wake_timeout_s": 0}, "^--wake-timeout must be > 0, got 0$"),
        ({"refresh_s": -1.0}, "^--refresh-interval must be > 0, got -1.0$"),
        ({"down_s": float("nan")}, "^--down-seconds must be a finite number, got nan$"),
    ],
)
def test_bad_settings_are_refused_by_name(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterConfig(endpoints=["http://a"], **settings)


@pytest.mark.parametrize(
    "url", ["notaurl", "127.0.0.1:8001", "ftp://host", "http://", "http:///v1", "http://h:port"]
)
def test_an_endpoint_that_is_not_an_http_url_with_a_host_is_refused_at_start(url: str) -> None:
    from kvpilot.cli import main

    with pytest.raises(SystemExit) as refused:
        main(["router", "--endpoint", "http://127.0.0.1:8001", "--endpoint", url])
    assert str(refused.value) == (
        "kvpilot router: --endpoint must be an http(s) URL with a host, e.g. "
        f"http://127.0.0.1:8001; got {url!r}"
    )
    for good in ("http://a", "https://a.example:8443/", "http://[::1]:8001"):
        assert RouterConfig(endpoints=[good]).endpoints == [good]


def test_router_help_shows_choices_and_defaults(capsys) -> None:
    from kvpilot.cli import main

    with pytest.raises(SystemExit) as shown:
        main(["router", "--help"])
    assert shown.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert "--routing-policy {kvpilot,consistent-hash,round-robin}" in text
    for shown_default in (
        "address to listen on (default: 127.0.0.1)",
        "port to listen on (default: 8080)",
        "(default: kvpilot)",
        "(default: 1.25)",
        "log level (default: info)",
    ):
        assert shown_default in text
    with pytest.raises(SystemExit) as refused:
        main(["router", "--endpoint", "http://a", "--routing-policy", "random"])
    assert refused.value.code == 2
    assert "invalid choice: 'random'" in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["round-robin", "consistent-hash"])
def test_the_comparison_policies_decide_without_tokens(policy: str) -> None:
    import prometheus_client

    from kvpilot.router.app import Router

    urls = ["http://a", "http://b", "http://c"]
    router = Router(
        RouterConfig(endpoints=urls, routing_policy=policy, tokenizer="unused"),
        prometheus_client.CollectorRegistry(),
    )
    for replica in router.replicas.all():
        replica.models, replica.polled = {"m"}, True

    async def pick(prompt: str) -> tuple[str, str]:
        plan = await router.plan("/v1/completions", {"model": "m", "prompt": prompt})
        assert (plan.token_ids, plan.untokenized) == (None, "policy")
        decision = router.decide(plan, set())
        return decision.replica, decision.reason

    picks = [asyncio.run(pick("the same prompt")) for _ in range(6)]
    if policy == "round-robin":
        assert picks == [(url, "round_robin") for url in urls * 2]
    else:
        assert len(set(picks)) == 1 and picks[0][1] == "hash"
