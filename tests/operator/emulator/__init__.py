"""A Kubernetes API server emulator for tests, built on kmock 0.8 with the semantics it lacks.

- :mod:`.server`: :class:`KubeEmulator` (kmock server, discovery, HTTP -> store, call log)
- :mod:`.store`: :class:`ObjectStore` (uids, resourceVersions, generation, subresources,
  finalizers, garbage collection, CRDs, watch history)
- :mod:`.schema`: defaulting and validation of custom resources against their CRD
- :mod:`.patches`, :mod:`.selectors`, :mod:`.tables`, :mod:`.paths`: pure helpers
- :mod:`.harness`: run it in a thread, write kubeconfigs, run ``kvpilot operator``, wait

Every resource request is recorded in ``KubeEmulator.calls`` (verb, group, resource,
subresource, namespace, name, and the bearer token as user). Faults are injected with kmock's
DSL, which answers before the store does, e.g. the next two PATCHes of deployments refused::

    cluster.emulator["patch", kmock.resource("apps", "v1", "deployments")][:2] << 409

Typical use in a synchronous test::

    with running_emulator() as cluster:
        kubeconfig = cluster.write_kubeconfig(tmp_path / "kubeconfig")
        ...  # kubectl --kubeconfig, kubernetes client, operator_process(...)
        cluster.store.get(("apps", "v1", "deployments"), "default", "name")
"""

from .harness import (
    ADMIN_TOKEN,
    OPERATOR_TOKEN,
    OperatorProcess,
    RunningEmulator,
    create_ready_pod,
    free_port,
    operator_process,
    running_emulator,
    running_operator,
    settled,
    wait_for,
)
from .resources import DEPLOYMENTS, EVENTS, LLMD, PDBS, SERVICES, llm_deployment
from .server import ApiCall, KubeEmulator
from .store import ApiError, ObjectStore

__all__ = [
    "DEPLOYMENTS",
    "EVENTS",
    "LLMD",
    "PDBS",
    "SERVICES",
    "ADMIN_TOKEN",
    "OPERATOR_TOKEN",
    "ApiCall",
    "ApiError",
    "KubeEmulator",
    "ObjectStore",
    "OperatorProcess",
    "RunningEmulator",
    "create_ready_pod",
    "free_port",
    "llm_deployment",
    "operator_process",
    "running_emulator",
    "running_operator",
    "settled",
    "wait_for",
]
