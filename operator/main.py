"""``kvpilot operator``: run the LLMDeployment controller (kopf).

Builds one runtime (:func:`kvpilot.operator.handlers.build_runtime`: the API client, the model
config cache, metrics, settings and the Event sink) and runs kopf with the handlers of
:mod:`kvpilot.operator.handlers` (reconcile), :mod:`kvpilot.operator.autoscaling_handlers` (the
wake handler) and :mod:`kvpilot.operator.periodic` (resync and autoscaling ticks), a liveness
endpoint for the kubelet's probe, the namespaces to watch (``--namespace`` repeated, names or
kopf globs such as ``team-*``; or ``--all-namespaces``), standalone or peering mode, and the
operator's own Prometheus metrics (:mod:`kvpilot.operator.operator_metrics`) on
``--metrics-port``.

Credentials: in a pod, the service account (in-cluster config); elsewhere ``$KUBECONFIG`` or
``~/.kube/config``. kopf logs in the same way through the kubernetes client.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
from collections.abc import Callable

LOG_LEVELS = ("debug", "info", "warning", "error")
_GLOB = re.compile(r"[*?\[]")


def has_globs(namespaces: list[str]) -> bool:
    """Whether any ``--namespace`` is a kopf glob (``*``, ``?`` or ``[...]``) rather than a name."""
    return any(_GLOB.search(namespace) for namespace in namespaces)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kvpilot operator`` options to ``parser``."""
    scope = parser.add_argument_group("what to watch (one of)")
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        metavar="NAMESPACE",
        help="watch LLMDeployments in this namespace (repeatable); a glob such as 'team-*' "
        "watches every namespace it matches, then and later (needs list/watch on namespaces)",
    )
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="watch LLMDeployments cluster-wide"
    )
    peering = parser.add_argument_group("several operator replicas")
    peering.add_argument(
        "--standalone",
        action="store_true",
        help="no peering: this process handles every object (the Helm chart's mode)",
    )
    peering.add_argument(
        "--peering", metavar="NAME", help="kopf peering object to coordinate replicas through"
    )
    peering.add_argument(
        "--priority", type=int, default=0, help="peering priority; the highest one is active"
    )
    parser.add_argument(
        "--liveness",
        metavar="URL",
        help="serve kopf's liveness probe at this URL, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=9090,
        help="port of the operator's Prometheus /metrics (0: do not serve); default 9090",
    )
    parser.add_argument(
        "--metrics-host", default="0.0.0.0", help="address /metrics listens on; default 0.0.0.0"
    )
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="default info")
    parser.add_argument(
        "--resync-interval",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="reconcile every LLMDeployment at least this often, even without events "
        "(repairs drift of its children); default 300",
    )
    parser.add_argument(
        "--retry-delay",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="wait before retrying a reconcile that hit API conflicts or outages; default 10",
    )
    autoscaling = parser.add_argument_group("autoscaling (spec.autoscaling.mode: kvpilot)")
    autoscaling.add_argument(
        "--autoscale-interval",
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="seconds between scaling decisions for each LLMDeployment; default 15",
    )
    autoscaling.add_argument(
        "--scrape-timeout",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="time allowed for one engine /metrics scrape (or Prometheus query); default 2",
    )
    autoscaling.add_argument(
        "--prometheus-url",
        metavar="URL",
        help="read engine metrics from this Prometheus instead of scraping the pods",
    )
    parser.add_argument(
        "--router",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="deploy the kvpilot router in front of each LLMDeployment (unless its "
        "spec.router.enabled is false); --no-router: status.endpoint is the engines' Service",
    )
    parser.add_argument(
        "--engine-image",
        default=os.environ.get("KVPILOT_ENGINE_IMAGE"),
        help="engine image for LLMDeployments without spec.image "
        "(default: $KVPILOT_ENGINE_IMAGE, else the image matching this kvpilot version)",
    )


def _check(parser_error: Callable[[str], None], args: argparse.Namespace) -> None:
    if bool(args.namespace) == bool(args.all_namespaces):
        parser_error(
            "choose the namespaces to watch: --namespace NAME (repeatable) or --all-namespaces"
        )
    if args.standalone and args.peering:
        parser_error("--standalone and --peering exclude each other")
    for name in ("resync_interval", "retry_delay", "autoscale_interval", "scrape_timeout"):
        if getattr(args, name) <= 0:
            parser_error(f"--{name.replace('_', '-')} must be positive")
    if not 0 <= args.metrics_port <= 65535:
        parser_error("--metrics-port must be in 0..65535")


def run(args: argparse.Namespace) -> int:
    """Run the operator until SIGTERM/SIGINT; returns the exit code."""
    import kopf
    import kubernetes
    import prometheus_client

    from kvpilot.operator import autoscaling_handlers, handlers, periodic
    from kvpilot.operator.apply import KubeClient
    from kvpilot.operator.images import ENGINE_IMAGE
    from kvpilot.operator.operator_metrics import OperatorMetrics

    def fail(message: str) -> None:
        raise SystemExit(f"kvpilot operator: error: {message}")

    _check(fail, args)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        try:
            kubernetes.config.load_kube_config()
        except (kubernetes.config.ConfigException, OSError) as exc:
            fail(
                f"no cluster to talk to ({exc}): run it in a pod, or point KUBECONFIG (or "
                "~/.kube/config) at a cluster"
            )

    prometheus_client.disable_created_metrics()  # no *_created series in /metrics, as vLLM
    metrics = OperatorMetrics()
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.metrics_host)
    config = handlers.HandlerConfig(
        engine_image=args.engine_image or ENGINE_IMAGE,
        resync_interval=args.resync_interval,
        retry_delay=args.retry_delay,
        watch_leader_worker_sets=handlers.leader_worker_sets_installed(KubeClient()),
        router=args.router,
    )
    runtime = handlers.build_runtime(config, metrics)
    registry = kopf.OperatorRegistry()
    handlers.register(registry, runtime)
    autoscaler = autoscaling_handlers.AutoscalingLoop(
        autoscaling_handlers.AutoscalerConfig(
            interval=args.autoscale_interval,
            scrape_timeout=args.scrape_timeout,
            prometheus_url=args.prometheus_url,
        ),
        runtime,
    )
    autoscaling_handlers.register(registry, autoscaler)

    async def resync(body: dict) -> None:
        meta = body["metadata"]
        await asyncio.to_thread(
            handlers.reconcile, runtime, meta["namespace"], meta["name"], "timer"
        )

    jobs = periodic.Periodic(
        [
            periodic.Job(
                "resync", args.resync_interval, resync, initial_delay=args.resync_interval
            ),
            periodic.Job("autoscale", args.autoscale_interval, autoscaler.tick),
        ]
    )
    jobs.forgotten.append(lambda key: autoscaler.forget(*key))
    periodic.register(registry, jobs, handlers.GROUP, handlers.VERSION, handlers.PLURAL)
    settings = handlers.operator_settings(scanning=args.all_namespaces or has_globs(args.namespace))
    kopf.run(
        registry=registry,
        settings=settings,
        standalone=args.standalone,
        peering_name=args.peering,
        priority=args.priority,
        liveness_endpoint=args.liveness,
        clusterwide=args.all_namespaces,
        namespaces=args.namespace,
    )
    return 0
