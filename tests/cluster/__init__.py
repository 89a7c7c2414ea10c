"""A real Kubernetes control plane for the tests and for ``make cluster``.

- :mod:`.control_plane`: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok
  as local processes, built from pinned Go modules (``hack/control-plane/build.sh``);
- :mod:`.nodes`: the simulated GPU and CPU nodes, every address in 127.0.0.0/8;
- :mod:`.kubelet` and :mod:`.images`: the kubelet stand-in that runs the pods' containers (the
  project's own images) as local processes;
- :mod:`.cluster`: all of it as one object, with kubectl, helm and the operator's Helm install;
- :mod:`.fixtures`: the pytest fixtures (one cluster per session, a namespace per test).
"""

from .cluster import CHART, Cluster, condition, dump, wait_for

__all__ = ["CHART", "Cluster", "condition", "dump", "wait_for"]
