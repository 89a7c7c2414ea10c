"""The router's settings, one dataclass; ``cli.py`` builds it from the flags (imports nothing
heavy, so ``kvpilot --help`` stays fast)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvpilot.router.scoring import (
    DEFAULT_LOAD_FACTOR,
    KV_WEIGHT,
    LOAD_WEIGHT,
    PREFIX_WEIGHT,
    WAITING_WEIGHT,
    Weights,
)

ROUTING_POLICIES = ("kvpilot", "consistent-hash", "round-robin")
"""``kvpilot``: the score of ``scoring.py`` (prefix affinity and load); ``consistent-hash``:
consistent hashing with bounded loads on the prompt's first characters (KubeAI's method, and
the ``kvpilot`` policy's own fallback); ``round-robin``: each replica in turn (a plain
Service). The last two are there to compare against."""

FLAGS = {
    "tokenizer": "--tokenizer",
    "routing_policy": "--routing-policy",
    "load_factor": "--load-factor",
    "prefix_weight": "--prefix-weight",
    "load_weight": "--load-weight",
    "waiting_weight": "--waiting-weight",
    "kv_weight": "--kv-weight",
    "down_s": "--down-seconds",
    "refresh_s": "--refresh-interval",
    "wake_timeout_s": "--wake-timeout",
    "wake_poll_s": "--wake-poll-interval",
    "connect_timeout_s": "--connect-timeout",
    "api_key": "--api-key",
}
"""``kvpilot router``'s flag for each tuned ``RouterConfig`` field (what its errors name)."""


@dataclass
class RouterConfig:
    """What ``kvpilot router`` was started with.

    Attributes:
        endpoints: the replicas' base URLs (local mode); may be empty when something else
            (Kubernetes discovery) calls ``ReplicaSet.set_urls``.
        tokenizer: a tokenizer folder, Hub id, or the built-in model's name for prefix
            affinity; None: consistent hashing.
        routing_policy: one of ``ROUTING_POLICIES``.
        load_factor: bounded load (>= 1): no replica above this factor of the mean.
        prefix_weight, load_weight, waiting_weight, kv_weight: the score's weights
            (``scoring.py``), each >= 0.
        down_s: seconds a replica that refused a connection is routed around.
        refresh_s: seconds between polls of the replicas' ``/metrics``, ``/v1/models`` and
            ``/kv_events`` (the engines' load in the score is this old at most).
        connect_timeout_s: seconds to connect to a replica.
        wake_timeout_s: seconds a request for a model without a ready replica is held (after
            asking the wake hook) before it is answered 503.
        wake_poll_s: seconds between polls of the replicas while requests are held.
        api_key: the key of the router's own polls of ``/v1/models`` (LoRA adapter names).
        kubernetes: discover the replicas from the Kubernetes API (``router/kubernetes.py``)
            instead of ``endpoints``.
        namespace: the namespace of the LLMDeployments (``kubernetes``).
        llmdeployments: the LLMDeployments to serve; empty: every one in ``namespace``.

    Raises:
        ValueError: an endpoint that is not an http(s) URL with a host, ``load_factor`` < 1, a
            negative weight, an unknown policy, or a non-positive interval or timeout (each
            named by its flag).
    """

    endpoints: list[str] = field(default_factory=list)
    tokenizer: str | None = None
    routing_policy: str = "kvpilot"
    load_factor: float = DEFAULT_LOAD_FACTOR
    prefix_weight: float = PREFIX_WEIGHT
    load_weight: float = LOAD_WEIGHT
    waiting_weight: float = WAITING_WEIGHT
    kv_weight: float = KV_WEIGHT
    down_s: float = 10.0
    refresh_s: float = 1.0
    connect_timeout_s: float = 3.0
    wake_timeout_s: float = 300.0
    wake_poll_s: float = 0.5
    api_key: str | None = field(default=None, repr=False)
    kubernetes: bool = False
    namespace: str = "default"
    llmdeployments: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kubernetes and self.endpoints:
            raise ValueError("--endpoint and --kubernetes exclude each other")
        for url in self.endpoints:
            check_endpoint(url)
        for name in (
            "load_factor",
            "prefix_weight",
            "load_weight",
            "waiting_weight",
            "kv_weight",
            "down_s",
            "refresh_s",
            "connect_timeout_s",
            "wake_timeout_s",
            "wake_poll_s",
        ):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(
                    f"{FLAGS[name]} must be a finite number, got {getattr(self, name)}"
                )
        if self.load_factor < 1:
            raise ValueError(f"--load-factor must be >= 1, got {self.load_factor}")
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(
                f"--routing-policy must be one of {', '.join(ROUTING_POLICIES)}, "
                f"got {self.routing_policy!r}"
            )
        for name in ("prefix_weight", "load_weight", "waiting_weight", "kv_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{FLAGS[name]} must be >= 0, got {getattr(self, name)}")
        for name in ("refresh_s", "connect_timeout_s", "wake_timeout_s", "wake_poll_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{FLAGS[name]} must be > 0, got {getattr(self, name)}")

    @property
    def weights(self) -> Weights:
        """The score's weights.

        Raises:
            ValueError: a negative weight.
        """
        return Weights(self.prefix_weight, self.load_weight, self.waiting_weight, self.kv_weight)


def check_endpoint(url: str) -> None:
    """Refuse an ``--endpoint`` that is not an http(s) URL with a host (and a valid port).

    Raises:
        ValueError: naming the flag and the value.
    """
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 - a port that is not a number in 0-65535 raises
    except ValueError:
        port_ok = False
    else:
        port_ok = True
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise ValueError(
            "--endpoint must be an http(s) URL with a host, e.g. http://127.0.0.1:8001; "
            f"got {url!r}"
        )
