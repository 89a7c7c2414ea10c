"""The Ray executor (``--distributed-executor-backend ray``): one Ray actor per rank, placed in
one placement group, on as many nodes as the cluster offers.

vLLM's recipe for models larger than one node: tensor parallelism inside a node, pipeline
parallelism across nodes, Ray for placing and supervising the workers. The executor connects to
the cluster at ``RAY_ADDRESS`` (or one this process already joined), else starts a local one. It reserves one bundle per rank in a placement group (``{"GPU": 1}`` per
bundle on GPUs, ``{"CPU": 1}`` on the CPU) and waits for the group to be placed, so a
replica's ranks are co-scheduled or not started at all. Ranks are numbered node by node (the
driver's node first), so that with ``tensor_parallel_size`` = GPUs per node each pipeline stage
sits on one node and only the stage-to-stage activations cross nodes. The ranks then join one
``torch.distributed`` world (gloo on CPU, NCCL on GPUs) at rank 0's node, exactly as the
``mp`` executor's processes do, and every step goes to every actor as the same
:class:`~kvpilot.engine.executor.worker_input.WorkerInput` (only what changed).

Failure: a dead actor (its process killed, its node lost) fails its pending call with Ray's
``ActorDiedError``; a rank that raises fails with its traceback; a rank that stops answering is
declared dead when a step passes ``distributed_timeout_s + STEP_TIMEOUT_MARGIN_S`` or a health
check passes ``HEALTH_CHECK_TIMEOUT_S``. Each becomes an :class:`EngineDeadError` naming the
rank, its node and the cause; every actor is then killed and the placement group removed (the
survivors may be blocked in a collective with the dead one).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any

from kvpilot.engine.executor.abstract import DistributedExecutor, EngineDeadError
from kvpilot.engine.executor.multiproc_executor import (
    STEP_TIMEOUT_MARGIN_S,
    check_parallel_config,
)
from kvpilot.engine.executor.worker import Worker, WorkerConfig
from kvpilot.engine.executor.worker_input import WorkerInputEncoder
from kvpilot.ports import free_port

logger = logging.getLogger("kvpilot.engine")

# Seconds to wait for the placement group before refusing to start (too few GPUs/CPUs).
PLACEMENT_GROUP_TIMEOUT_S = 300.0
# Seconds an idle actor may take to answer a health check before it is declared dead.
HEALTH_CHECK_TIMEOUT_S = 30.0
# Seconds to wait, once one rank failed, for another to report that it died (the root cause).
_ROOT_CAUSE_GRACE_S = 5.0


class RayWorkerWrapper:
    """The actor around one rank's :class:`Worker` (vLLM's name); built empty, so that every
    rank's placement is known before any of them loads weights."""

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def node(self) -> tuple[str, str, int]:
        """``(node id, node IP address, pid)`` of this actor."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def free_port(self) -> int:
        """A free TCP port on this actor's node (the rendezvous, on rank 0)."""
        import ray

        return free_port(ray.util.get_node_ip_address())

    def init_worker(self, config: WorkerConfig, rank: int, init_method: str) -> None:
        """Build the rank's worker; Ray shows each actor only its own GPU (index 0)."""
        self.worker = Worker(config, rank, init_method, local_rank=0)

    def execute_method(self, method: str, args: tuple, reply: bool) -> Any:
        """``Worker.method(*args)``; its result when ``reply``, else None (saves the transfer)."""
        result = getattr(self.worker, method)(*args)
        return result if reply else None

    def ping(self) -> bool:
        return True


class RayExecutor(DistributedExecutor):
    """Runs ``tensor_parallel_size x pipeline_parallel_size`` ranks as Ray actors.

    Args:
        config: worker settings; on CPU, ``num_threads`` None gives each rank one thread (its
            bundle's one CPU).

    Raises:
        ValueError: an unshardable size (see :func:`check_parallel_config`), or a placement
            group the cluster cannot place within ``PLACEMENT_GROUP_TIMEOUT_S`` (the message
            names the bundles and the cluster's resources).
        EngineDeadError: an actor failed to start (its traceback is in the message).
    """

    def __init__(self, config: WorkerConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        check_parallel_config(config, local=False)
        on_gpu = config.device.type == "cuda"
        if config.num_threads is None and not on_gpu:
            config = replace(config, num_threads=1)
        self.config = config
        self._failure: str | None = None
        self._encoder = WorkerInputEncoder()
        self._ray = ray
        self._started_ray = _connect(config.world_size, on_gpu)
        bundle = {"GPU": 1.0} if on_gpu else {"CPU": 1.0}
        self._placement_group = placement_group([bundle] * config.world_size, strategy="PACK")
        ready, _ = ray.wait([self._placement_group.ready()], timeout=PLACEMENT_GROUP_TIMEOUT_S)
        if not ready:
            resources = ray.cluster_resources()
            self._stop()
            raise ValueError(
                f"Ray could not place {config.world_size} bundles of {bundle} "
                f"(tensor_parallel_size {config.tensor_parallel_size} x pipeline_parallel_size "
                f"{config.pipeline_parallel_size}) within {PLACEMENT_GROUP_TIMEOUT_S:.0f} s; "
                f"the cluster has {resources}"
            )
        actor_cls = ray.remote(num_cpus=0 if on_gpu else 1, num_gpus=1 if on_gpu else 0)(
            RayWorkerWrapper
        )
        actors = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement_group, placement_group_bundle_index=bundle_index
                ),
            ).remote()
            for bundle_index in range(config.world_size)
        ]
        self._actors = actors
        places = self._get([a.node.remote() for a in actors], "start-up", timeout_s=None)
        order = _rank_order([node_id for node_id, _, _ in places], ray.get_runtime_context())
        self._actors = [actors[i] for i in order]
        self._places = [places[i] for i in order]
        rendezvous = self._get([self._actors[0].free_port.remote()], "start-up", None)[0]
        init_method = f"tcp://{self._places[0][1]}:{rendezvous}"
        self._get(
            [
                actor.init_worker.remote(config, rank, init_method)
                for rank, actor in enumerate(self._actors)
            ],
            "start-up",
            timeout_s=None,
        )
        logger.info(
            "Ray workers: %d actors on %d node(s) (%s), %d weight bytes per rank",
            len(self._actors),
            len({node_id for node_id, _, _ in self._places}),
            ", ".join(f"rank {r}: {ip} pid {pid}" for r, (_, ip, pid) in enumerate(self._places)),
            max(self.collective_rpc("weight_bytes")),
        )

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the actors, by rank (on their nodes)."""
        return [pid for _, _, pid in self._places]

    @property
    def worker_node_ids(self) -> list[str]:
        """Ray node ids of the actors, by rank."""
        return [node_id for node_id, _, _ in self._places]

    def collective_rpc(self, method: str, *args: Any, reply_rank: int | None = None) -> list[Any]:
        """Call ``Worker.method(*args)`` on every rank and wait for all of them.

        Args:
            method: a :class:`~kvpilot.engine.executor.worker.Worker` method name.
            args: its arguments (serialized by Ray for each actor).
            reply_rank: only this rank sends its result back (the others send None); None:
                every rank does.

        Returns:
            The results by rank.

        Raises:
            EngineDeadError: an actor died or raised, or gave no answer within
                ``distributed_timeout_s + STEP_TIMEOUT_MARGIN_S``; every actor is then killed.
        """
        self._raise_if_dead()
        refs = [
            actor.execute_method.remote(method, args, reply_rank in (None, rank))
            for rank, actor in enumerate(self._actors)
        ]
        return self._get(refs, method, self.config.distributed_timeout_s + STEP_TIMEOUT_MARGIN_S)

    def check_health(self) -> None:
        self._raise_if_dead()
        self._get([a.ping.remote() for a in self._actors], "health check", HEALTH_CHECK_TIMEOUT_S)

    def shutdown(self) -> None:
        self._stop()

    def _raise_if_dead(self) -> None:
        if self._failure is not None:
            raise EngineDeadError(self._failure)

    def _get(self, refs: list, method: str, timeout_s: float | None) -> list[Any]:
        """The results of one call per rank (``refs[rank]``), failing the engine as soon as one
        rank dies or raises, or when ``timeout_s`` (None: no limit) passes."""
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                ranks = ", ".join(str(rank_of[ref]) for ref in pending)
                self._fail(
                    f"Ray worker rank(s) {ranks} stopped answering: no reply to {method} "
                    f"within {timeout_s:.0f} s"
                )
            ref = ready[0]
            rank = rank_of[ref]
            try:
                results[rank] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._fail(self._death_message(rank, method, exc))
            except ray.exceptions.RayError as exc:
                # A peer's death surfaces in the survivors as a collective error: name the
                # dead rank, the root cause, when one reports it in time.
                failed = f"Ray worker rank {rank} ({self._where(rank)}) failed during {method}"
                cause = self._first_death(pending, rank_of, method)
                self._fail(f"{cause}\n({failed}:\n{exc})" if cause else f"{failed}:\n{exc}")
        return results

    def _first_death(self, pending: list, rank_of: dict, method: str) -> str | None:
        """Once one rank failed: the death message of a pending rank whose actor died, or the
        pending ranks still silent ``_ROOT_CAUSE_GRACE_S`` later; None when they all answered."""
        ray = self._ray
        ready, silent = ray.wait(pending, num_returns=len(pending), timeout=_ROOT_CAUSE_GRACE_S)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                return self._death_message(rank_of[ref], method, exc)
            except ray.exceptions.RayError:
                continue
        if silent:
            ranks = ", ".join(str(rank_of[ref]) for ref in silent)
            return (
                f"Ray worker rank(s) {ranks} had not answered {method} "
                f"{_ROOT_CAUSE_GRACE_S:.0f} s after another rank failed (stopped, or waiting on "
                "a collective with it)"
            )
        return None

    def _where(self, rank: int) -> str:
        if not getattr(self, "_places", None):
            return "placing"
        node_id, ip, pid = self._places[rank]
        return f"pid {pid} on node {ip} {node_id[:8]}"

    def _death_message(self, rank: int, method: str, exc: Exception) -> str:
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (
            f"Ray worker rank {rank} ({self._where(rank)}) died during {method}: "
            f"{type(exc).__name__}: {cause}"
        )

    def _fail(self, message: str) -> None:
        """Record the failure, kill every actor, raise."""
        if self._failure is None:
            self._failure = f"{message}\nThe engine is shut down."
            logger.error("%s", self._failure)
        self._stop()
        raise EngineDeadError(self._failure)

    def _stop(self) -> None:
        """Kill the actors (killed, not asked: survivors may be blocked in a collective),
        remove the placement group, and stop Ray if this executor started it; idempotent."""
        ray = self._ray
        for actor in getattr(self, "_actors", []):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._actors = []
        group = getattr(self, "_placement_group", None)
        if group is not None:
            try:
                ray.util.remove_placement_group(group)
            except Exception:  # noqa: BLE001 - already removed, or Ray is down
                pass
            self._placement_group = None
        if getattr(self, "_started_ray", False) and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False


def _connect(world_size: int, on_gpu: bool) -> bool:
    """Join the cluster at ``RAY_ADDRESS``, or the one this process is connected to, or start a
    local one; whether this call started Ray.

    A local CPU cluster gets at least ``world_size`` CPUs so every rank's bundle fits (on a
    machine with fewer cores the ranks then share them). Ray binds a local cluster to this
    node's outward address (so that other nodes could join); with
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the environment before Ray is imported it stays
    on 127.0.0.1 (the tests and benchmarks do so).
    """
    import ray

    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        return False
    num_cpus = None if on_gpu else max(os.cpu_count() or 1, world_size)
    ray.init(num_cpus=num_cpus, include_dashboard=False)
    return True


def _rank_order(node_ids: list[str], runtime_context: Any) -> list[int]:
    """Bundle indices in rank order: the driver's node first, then each node in the order of
    its first bundle, keeping a node's bundles together (a stage's ranks on one node)."""
    driver_node = runtime_context.get_node_id()
    first_seen: dict[str, int] = {}
    for index, node_id in enumerate(node_ids):
        first_seen.setdefault(node_id, index)
    return sorted(
        range(len(node_ids)),
        key=lambda i: (node_ids[i] != driver_node, first_seen[node_ids[i]], i),
    )
