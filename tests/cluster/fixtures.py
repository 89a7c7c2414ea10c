"""pytest fixtures of the real control plane (a plugin loaded by ``tests/conftest.py``).

``kube``: one cluster for the whole session, started on first use (the binaries are built
first if this machine has none, see ``hack/control-plane/build.sh``) and stopped at the end;
its logs stay under pytest's base temp folder (``pytest --basetemp``) for a failed run.
``namespace``: a fresh namespace per test. ``tiny_model_source``: a ``file://`` model source
of a tiny random Llama checkpoint the engine pods can load (the default SmolLM2 is a real
model but slower to start).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import pathlib
import shutil
from collections.abc import Callable, Iterator

import pytest

from kvpilot.engine.model_loader.resolve import get_cache_dir

from .cluster import Cluster


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    cluster = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()


_subnets = itertools.count(2)


@contextlib.contextmanager
def own_cluster(folder: pathlib.Path) -> Iterator[Cluster]:
    """A second cluster for tests that change cluster-wide state (an operator watching every
    namespace, the CRD itself), on pod addresses of its own (``127.N.*``)."""
    cluster = Cluster(folder, subnet=next(_subnets))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses the cluster ``cluster``: ``make test`` runs them in a pytest
    process of their own, so the control plane's processes are not running beside the
    engine's CPU-bound tests."""
    for item in items:
        if "kube" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)


def _test_namespace(kube: Cluster, request: pytest.FixtureRequest, prefix: str) -> Iterator[str]:
    name = kube.create_namespace(prefix)
    yield name
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        print(kube.describe_namespace(name))
    kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def namespace(kube: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A new namespace; when the test fails, what is in it is printed (objects, Events, the
    logs of its pods) for the report. It is deleted afterwards (not waited for), which stops
    its pods' processes."""
    prefix = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:20].strip("-")
    yield from _test_namespace(kube, request, prefix or "t")


@dataclasses.dataclass(frozen=True)
class SharedOperator:
    """A test module's operator: it watches every namespace named ``<prefix>-*`` (a glob);
    its pod runs in ``namespace``."""

    prefix: str
    namespace: str


_modules = itertools.count(1)


@pytest.fixture(scope="module")
def shared_operator(kube: Cluster, crd: dict) -> Iterator[SharedOperator]:
    """One operator (the chart, installed once) for the tests of a module that need nothing of
    it but reconciling their own objects: installing one per test costs seconds each. Tests
    that restart it or read its counters install their own (``kube.operator``)."""
    prefix = f"m{next(_modules)}"
    home = kube.create_namespace(f"{prefix}-operator")
    with kube.operator(home, watch=(f"{prefix}-*",)):
        yield SharedOperator(prefix, home)
    kube.kubectl("delete", "namespace", home, "--wait=false", check=False)


@pytest.fixture
def watched(
    kube: Cluster, shared_operator: SharedOperator, request: pytest.FixtureRequest
) -> Iterator[str]:
    """A new namespace the module's shared operator watches (otherwise as ``namespace``)."""
    yield from _test_namespace(kube, request, shared_operator.prefix)


def pod_visible_model(folder: pathlib.Path, name: str) -> str:
    """A ``file://`` source for a model folder that engine pods can read.

    A pod's ``/tmp`` is an emptyDir of its own (the kubelet stand-in maps it, as a container
    runtime would), so a model under pytest's temporary folder would not be visible in it: the
    folder is copied to ``$KVPILOT_CACHE_DIR/test-models/NAME``, a path no pod mounts over,
    as if the model were baked into the node's image.
    """
    target = get_cache_dir() / "test-models" / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(folder, target)
    return f"file://{target}"


@pytest.fixture(scope="session")
def tiny_model_source(tiny_model_dir) -> str:
    return pod_visible_model(tiny_model_dir("llama"), "tiny-llama")


@pytest.fixture(scope="session")
def crd(kube: Cluster) -> dict:
    """The chart's CRD, applied once for the session (server-side, as ``kubectl apply``)."""
    return kube.install_crd()


CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "operator" / "configs"


@pytest.fixture(scope="session")
def model_config_source() -> Callable[[str], str]:
    """Factory: ``model_config_source("Meta-Llama-3-8B") -> file://...``, a folder holding only
    that public model's config.json (``tests/operator/configs/``): enough to plan it, not to
    serve it (pair it with an image that runs no engine)."""
    made: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in made:
            folder = get_cache_dir() / "test-models" / f"config-{name}"
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy(CONFIGS / f"{name}.json", folder / "config.json")
            made[name] = f"file://{folder}"
        return made[name]

    return make
