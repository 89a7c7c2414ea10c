"""NOTES.txt, printed after `helm install`, gives next steps that work with this repository."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess

import yaml

from kvpilot.operator import manifests, router_manifests

REPO = pathlib.Path(__file__).resolve().parents[2]


def _notes(helm: pathlib.Path, *args: str) -> str:
    # --dry-run=client renders NOTES.txt without a cluster.
    done = subprocess.run(
        [str(helm), "install", "kvp", str(REPO / "charts" / "kvpilot"), "--dry-run=client",
         "--namespace", "kvpilot-system", *args],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "KUBECONFIG": os.devnull},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.partition("NOTES:")[2]


def test_notes_steps_match_the_example_and_the_operator(helm: pathlib.Path) -> None:
    notes = _notes(helm)
    assert "kubectl -n kvpilot-system rollout status deployment/kvp-kvpilot-operator" in notes
    assert "watching every namespace" in notes
    (example_path,) = set(re.findall(r"kubectl apply -f (\S+)", notes))
    example = yaml.safe_load((REPO / example_path).read_text())
    name = example["metadata"]["name"]
    # The router's Service (status.endpoint; the engines' without the router) serves HTTP_PORT.
    service = router_manifests.service(name, "default")
    port = service["spec"]["ports"][0]["port"]
    assert f"kubectl port-forward svc/{service['metadata']['name']} {port}:{port}" in notes
    assert f"http://127.0.0.1:{port}/v1/chat/completions" in notes
    assert f"kubectl scale llmd {name} --replicas=2" in notes
    plain = manifests.service(name, "default")["metadata"]["name"]
    assert f"port-forward svc/{plain} " in _notes(helm, "--set", "router.enabled=false")


def test_notes_name_the_watched_namespaces(helm: pathlib.Path) -> None:
    notes = _notes(helm, "--set", "operator.watchNamespaces={team-a,team-b}")
    assert "watching team-a, team-b." in notes
