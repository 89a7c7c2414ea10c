"""``kvpilot ray-node``: one node of a multi-node replica's Ray cluster (LeaderWorkerSet pods).

Examples (what the operator renders, :mod:`kvpilot.operator.leaderworkerset`)::

    kvpilot ray-node leader --nodes 2 -- serve MODEL --tensor-parallel-size 8 \\
        --pipeline-parallel-size 2 --distributed-executor-backend ray
    kvpilot ray-node worker --address "$LWS_LEADER_ADDRESS"

``leader`` starts a Ray head (``ray start --head``), waits until ``--nodes`` nodes (itself
included) are alive, then replaces itself with ``kvpilot <the arguments after -->`` with
``RAY_ADDRESS`` pointing at the head, so the engine's Ray executor places its ranks on the
group's nodes. ``worker`` replaces itself with ``ray start --address HOST:PORT --block``: the
pod lives as long as its Ray node. Either process exiting ends the pod's container, and the
LeaderWorkerSet (``RecreateGroupOnPodRestart``) recreates the whole group. This is vLLM's
multi-node serving recipe (its ``multi-node-serving.sh``) as a subcommand of the engine image.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

DEFAULT_PORT = 6379
"""The head's GCS port (Ray's default)."""


def _options() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(
        prog="kvpilot ray-node ROLE",
        description="leader: a Ray head, then the command after -- once --nodes have joined; "
        "worker: a Ray node joining --address",
    )
    options.add_argument("--nodes", type=int, default=1)
    options.add_argument("--address")
    options.add_argument("--port", type=int, default=DEFAULT_PORT)
    options.add_argument("--node-ip-address")
    options.add_argument("--wait-timeout", type=float, default=900.0)
    return options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the role and its flags (parsed by :func:`parse_role_args`, so that everything after
    ``--`` reaches the leader's command untouched)."""
    parser.add_argument("role", choices=("leader", "worker"), help="this pod's part")
    parser.add_argument(
        "rest",
        nargs=argparse.REMAINDER,
        metavar="...",
        help=(
            "leader: [--nodes N] [--port PORT] [--node-ip-address IP] [--wait-timeout S] "
            "-- KVPILOT_COMMAND...; worker: --address HOST[:PORT] [--node-ip-address IP]. "
            "--nodes: Ray nodes to wait for, the leader included (default 1); --port: the "
            f"head's GCS port (default {DEFAULT_PORT}); --node-ip-address: this node's address "
            "as Ray advertises it (default: Ray's choice); --wait-timeout: seconds to wait for "
            "the other nodes (default 900, then exit code 1)"
        ),
    )


def parse_role_args(rest: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split ``rest`` at the first ``--``: (the role's options, the command after it).

    Raises:
        SystemExit: an unknown or malformed option (argparse's message).
    """
    if "--" in rest:
        cut = rest.index("--")
    else:
        # The top-level parser may have taken the ``--`` itself (``leader -- serve ...``): the
        # command starts at the first word that is neither an option nor an option's value
        # (every option takes one value).
        cut = 0
        while cut < len(rest) and rest[cut].startswith("-"):
            cut += 1 if "=" in rest[cut] or rest[cut] in ("-h", "--help") else 2
        cut = min(cut, len(rest))
        rest = [*rest[:cut], "--", *rest[cut:]]
    return _options().parse_args(rest[:cut]), rest[cut + 1 :]


def ray_executable() -> list[str]:
    """Ray's command line as this interpreter runs it (``python -m ray.scripts.scripts``, what
    the ``ray`` console script calls), so the Ray of the engine's own environment is used.

    Raises:
        SystemExit: Ray is not installed (``pip install 'kvpilot[ray]'``).
    """
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise SystemExit("kvpilot ray-node: Ray is not installed (pip install 'kvpilot[ray]')")
    return [sys.executable, "-m", "ray.scripts.scripts"]


def head_command(ray: list[str], port: int, node_ip: str | None = None) -> list[str]:
    """``ray start --head`` on ``port``, without the dashboard or usage reporting."""
    return [
        *ray, "start", "--head", f"--port={port}", "--include-dashboard=false",
        "--disable-usage-stats", *([f"--node-ip-address={node_ip}"] if node_ip else []),
    ]  # fmt: skip


def worker_command(ray: list[str], address: str, node_ip: str | None = None) -> list[str]:
    """``ray start`` joining ``address`` (``HOST`` gets the default port), in the foreground."""
    if ":" not in address:
        address = f"{address}:{DEFAULT_PORT}"
    return [
        *ray, "start", f"--address={address}", "--block", "--disable-usage-stats",
        *([f"--node-ip-address={node_ip}"] if node_ip else []),
    ]  # fmt: skip


def serve_command(command: list[str]) -> list[str]:
    """The ``kvpilot`` process the leader becomes: ``kvpilot COMMAND...``.

    Raises:
        SystemExit: no command was given.
    """
    if not command:
        raise SystemExit("kvpilot ray-node leader: give the kvpilot command after --")
    return [sys.executable, "-m", "kvpilot", *command]


def wait_for_nodes(address: str, nodes: int, timeout: float) -> int:
    """Poll the Ray cluster at ``address`` until ``nodes`` nodes are alive; returns the count.

    Raises:
        TimeoutError: fewer were alive after ``timeout`` seconds.
    """
    import ray

    ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    try:
        deadline = time.monotonic() + timeout
        alive = 0
        while True:
            alive = sum(1 for node in ray.nodes() if node.get("Alive"))
            if alive >= nodes:
                return alive
            if time.monotonic() > deadline:
                raise TimeoutError(f"{alive} of {nodes} Ray nodes joined within {timeout:g} s")
            print(f"kvpilot ray-node: {alive} of {nodes} Ray nodes alive", flush=True)
            time.sleep(2.0)
    finally:
        ray.shutdown()


def run(args: argparse.Namespace) -> int:
    """Run the leader or the worker (see the module docstring); returns an exit code."""
    options, command = parse_role_args(list(args.rest))
    ray = ray_executable()
    if args.role == "worker":
        if not options.address:
            raise SystemExit("kvpilot ray-node worker: --address is required")
        argv = worker_command(ray, options.address, options.node_ip_address)
        os.execv(argv[0], argv)
    serve = serve_command(command)
    if options.nodes < 1:
        raise SystemExit("kvpilot ray-node leader: --nodes must be at least 1")
    if subprocess.run(head_command(ray, options.port, options.node_ip_address)).returncode:
        print("kvpilot ray-node: the Ray head did not start (see above)", file=sys.stderr)
        return 1
    address = f"{options.node_ip_address or '127.0.0.1'}:{options.port}"
    try:
        alive = wait_for_nodes(address, options.nodes, options.wait_timeout)
    except TimeoutError as exc:
        print(f"kvpilot ray-node: {exc}", file=sys.stderr)
        return 1
    print(f"kvpilot ray-node: {alive} Ray nodes alive; starting kvpilot {' '.join(command)}")
    sys.stdout.flush()
    os.execve(serve[0], serve, {**os.environ, "RAY_ADDRESS": address})
    return 0  # not reached
