"""The simulated nodes of the test cluster: GPU node pools and a CPU pool (pure data).

kwok (``sigs.k8s.io/kwok``) keeps these Node objects alive (status, heartbeats, leases) and
moves the pods scheduled onto them to Running; it manages only nodes with ``KWOK_LABEL``.

Every address is a loopback address of this machine: node ``k`` of the cluster with subnet
``s`` has the InternalIP ``127.0.s.k`` and the pod CIDR ``127.s.k.0/24`` (``127.(s+100).k.0/24``
from the 101st node), from which kwok gives its pods their IPs, so whatever binds to a pod's IP
is reachable at that address, two clusters on one machine never share an address, and nothing
ever points outside 127.0.0.0/8.

GPU nodes carry what the NVIDIA device plugin and GPU Feature Discovery put on real ones: the
``nvidia.com/gpu`` capacity, the ``nvidia.com/gpu.product``/``.memory``/``.count`` labels, and
the ``nvidia.com/gpu`` NoSchedule taint clouds add to GPU node pools.
"""

from __future__ import annotations

import dataclasses
from typing import Any

KWOK_LABEL = "type"
KWOK_LABEL_VALUE = "kwok"
POOL_LABEL = "kvpilot.dev/test-node-pool"
GPU_RESOURCE = "nvidia.com/gpu"


@dataclasses.dataclass(frozen=True)
class NodePool:
    """``count`` identical nodes.

    Attributes:
        name: pool name (node names are ``kwok-<name>-<i>``).
        count: nodes in the pool.
        gpu_product: GPU Feature Discovery's ``nvidia.com/gpu.product`` value, or None for a
            CPU-only pool.
        gpu_memory_mib: ``nvidia.com/gpu.memory`` (MiB per GPU).
        gpus: ``nvidia.com/gpu`` capacity per node.
        cpu: CPU capacity (cores) per node.
        memory: memory capacity per node (a Kubernetes quantity).
    """

    name: str
    count: int
    gpu_product: str | None = None
    gpu_memory_mib: int = 0
    gpus: int = 0
    cpu: int = 32
    memory: str = "256Gi"


DEFAULT_POOLS = (
    NodePool("h100", 2, "NVIDIA-H100-80GB-HBM3", 81_559, 8),
    NodePool("l4", 2, "NVIDIA-L4", 23_034, 8),
    NodePool("cpu", 2),
)
"""Two GPU types (8 GPUs a node) and CPU-only nodes."""


def node_ip(index: int, subnet: int = 1) -> str:
    """The InternalIP of the cluster's ``index``-th node (from 1)."""
    return f"127.0.{subnet}.{index}"


def pod_cidr(index: int, subnet: int = 1) -> str:
    """The pod CIDR of the cluster's ``index``-th node (from 1)."""
    return f"127.{subnet}.{index}.0/24"


def node_objects(
    pools: tuple[NodePool, ...] = DEFAULT_POOLS, subnet: int = 1
) -> list[dict[str, Any]]:
    """The Node objects of ``pools``, numbered across pools from 1 (at most 254 nodes);
    ``subnet`` (1..99) tells clusters on one machine apart.

    Raises:
        ValueError: more than 254 nodes (the addressing scheme's limit), or a bad subnet.
    """
    if not 1 <= subnet <= 99:
        raise ValueError("subnet must be in 1..99")
    nodes = []
    index = 0
    for pool in pools:
        for i in range(pool.count):
            index += 1
            if index > 254:
                raise ValueError("at most 254 simulated nodes")
            nodes.append(_node(pool, f"kwok-{pool.name}-{i}", index, subnet))
    return nodes


def _node(pool: NodePool, name: str, index: int, subnet: int) -> dict[str, Any]:
    labels = {
        KWOK_LABEL: KWOK_LABEL_VALUE,
        POOL_LABEL: pool.name,
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
    }
    capacity = {"cpu": str(pool.cpu), "memory": pool.memory, "pods": "110"}
    taints = []
    if pool.gpu_product is not None:
        labels |= {
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": pool.gpu_product,
            "nvidia.com/gpu.memory": str(pool.gpu_memory_mib),
            "nvidia.com/gpu.count": str(pool.gpus),
        }
        capacity[GPU_RESOURCE] = str(pool.gpus)
        taints.append({"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"})
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", "kwok.x-k8s.io/node": "fake"},
        },
        "spec": {
            "podCIDR": pod_cidr(index, subnet),
            "podCIDRs": [pod_cidr(index, subnet)],
            "taints": taints,
        },
        "status": {
            "capacity": capacity,
            "allocatable": dict(capacity),
            "addresses": [
                {"type": "InternalIP", "address": node_ip(index, subnet)},
                {"type": "Hostname", "address": name},
            ],
        },
    }
