"""``make cluster``: the test suite's cluster, for a person, until Ctrl-C.

Builds the control plane once (``hack/control-plane/build.sh``), starts it with its simulated
GPU and CPU nodes and the kubelet stand-in, installs the Helm chart (the operator watching
every namespace), and prints the ``KUBECONFIG`` to export in another shell. Then:

    kubectl apply -f examples/smollm2-cpu.yaml
    kubectl get llmd,pods -o wide -w

Pods run as local processes on loopback addresses (``127.1.N.M``); their logs are under the
work folder's ``pods/``. Stop with Ctrl-C: everything it started stops with it.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import signal
import sys
import tempfile
import threading

from .cluster import CHART, TOOLS, Cluster


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make cluster", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workdir",
        type=pathlib.Path,
        help="folder for certificates, data and logs (default: a new temporary folder, "
        "removed at exit)",
    )
    parser.add_argument("--no-operator", action="store_true", help="do not install the Helm chart")
    args = parser.parse_args(argv)
    if not (TOOLS / "helm").exists():
        parser.error(f"{TOOLS / 'helm'} is missing: run `make tools` first")
    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="kvpilot-cluster-"))
    if args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"starting the control plane in {workdir} ...", flush=True)
    cluster = Cluster(workdir)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    try:
        cluster.start()
        if not args.no_operator:
            print("installing the kvpilot chart (release kvpilot, namespace kvpilot-system) ...")
            cluster.helm(
                "install", "kvpilot", str(CHART), "--namespace", "kvpilot-system",
                "--create-namespace", "--wait", "--timeout", "5m",
            )  # fmt: skip
        print(cluster.kubectl("get", "nodes", "-L", "nvidia.com/gpu.product").stdout)
        print(
            "The cluster is up. In another shell:\n\n"
            f"  export KUBECONFIG={cluster.kubeconfig}\n"
            f"  export PATH={TOOLS}:$PATH\n"
            "  kubectl apply -f examples/smollm2-cpu.yaml\n"
            "  kubectl get llmd,pods -o wide -w\n\n"
            f"Pod logs: {workdir / 'pods'}/<namespace>_<pod>_<uid>/logs/. Ctrl-C stops everything.",
            flush=True,
        )
        stopped.wait()
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping ...", flush=True)
        cluster.stop()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
