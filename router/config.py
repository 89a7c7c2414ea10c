"""The router's settings, one dataclass; ``cli.py`` builds it from the flags (imports nothing
heavy, so ``kvpilot --help`` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.router.scoring import DEFAULT_LOAD_FACTOR, LOAD_WEIGHT, PREFIX_WEIGHT


@dataclass
class RouterConfig:
    """What ``kvpilot router`` was started with.

    Attributes:
        endpoints: the replicas' base URLs.
        tokenizer: a tokenizer folder, Hub id, or the built-in model's name for prefix
            affinity; None: consistent hashing.
        load_factor: bounded load (>= 1): no replica above this factor of the mean.
        prefix_weight, load_weight: the score's weights (``scoring.py``).
        down_s: seconds a replica that refused a connection is routed around.
        refresh_s: seconds between polls of the replicas' ``/metrics`` and ``/v1/models``.
        connect_timeout_s: seconds to connect to a replica.
        api_key: the key of the router's own polls of ``/v1/models`` (LoRA adapter names).
        kubernetes: discover the replicas from the Kubernetes API (``router/kubernetes.py``)
            instead of ``endpoints``.
        namespace: the namespace of the LLMDeployments (``kubernetes``).
        llmdeployments: the LLMDeployments to serve; empty: every one in ``namespace``.
        wake_timeout_s: how long a request for a deployment at zero replicas is held while it
            wakes, seconds; then a 503 with ``Retry-After``.
    """

    endpoints: list[str]
    tokenizer: str | None = None
    load_factor: float = DEFAULT_LOAD_FACTOR
    prefix_weight: float = PREFIX_WEIGHT
    load_weight: float = LOAD_WEIGHT
    down_s: float = 10.0
    refresh_s: float = 5.0
    connect_timeout_s: float = 3.0
    api_key: str | None = field(default=None, repr=False)
    kubernetes: bool = False
    namespace: str = "default"
    llmdeployments: list[str] = field(default_factory=list)
    wake_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.kubernetes and self.endpoints:
            raise ValueError("--endpoint and --kubernetes exclude each other")
        if not self.kubernetes and not self.endpoints:
            raise ValueError("the router needs at least one --endpoint, or --kubernetes")
        if self.wake_timeout_s < 0:
            raise ValueError(f"--wake-timeout must be >= 0, got {self.wake_timeout_s}")
        if self.load_factor < 1:
            raise ValueError(f"--load-factor must be >= 1, got {self.load_factor}")
