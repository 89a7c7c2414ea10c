"""What a container image would run, for the kubelet stand-in (pure).

There is no container runtime here, so an image cannot be pulled or started. The project's own
images are the exception: they hold this same kvpilot, so their containers can run as local
processes of this checkout's interpreter. Their ENTRYPOINT and CMD are read from the
Dockerfiles in ``docker/`` (the image's own definition), and Kubernetes' rules combine them with
the container's ``command`` and ``args``:

- ``command`` replaces ENTRYPOINT, ``args`` replaces CMD; a ``command`` without ``args`` drops
  CMD as well.

Any other image has no process: its containers count as started and ready at once, as kwok's
default stages treat every pod.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

DOCKER = pathlib.Path(__file__).resolve().parents[2] / "docker"
IMAGES = {"kvpilot-engine": "engine.Dockerfile", "kvpilot-operator": "operator.Dockerfile"}
"""Image repository name (without registry or tag) -> its Dockerfile in ``docker/``."""


def repository(image: str) -> str:
    """The last path part of an image reference without tag or digest
    (``ghcr.io/kvpilot/kvpilot-engine:0.1.0`` -> ``kvpilot-engine``)."""
    name = image.split("@", 1)[0].rsplit("/", 1)[-1]
    return name.split(":", 1)[0]


def dockerfile_entrypoint(dockerfile: pathlib.Path) -> tuple[list[str], list[str]]:
    """(ENTRYPOINT, CMD) of the final stage of ``dockerfile`` (exec form only).

    Raises:
        ValueError: a shell-form ENTRYPOINT or CMD (not a JSON array).
    """
    entrypoint: list[str] = []
    cmd: list[str] = []
    for line in dockerfile.read_text().splitlines():
        word, _, rest = line.strip().partition(" ")
        if word.upper() == "FROM":
            entrypoint, cmd = [], []
        elif word.upper() in ("ENTRYPOINT", "CMD"):
            try:
                value = json.loads(rest)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{dockerfile}: {word} must use the exec (JSON) form") from exc
            if word.upper() == "ENTRYPOINT":
                entrypoint, cmd = value, []
            else:
                cmd = value
    return entrypoint, cmd


def container_argv(container: dict[str, Any]) -> tuple[list[str], list[str]] | None:
    """The process a container of one of the project's images runs, as (program, arguments),
    or None for other images.

    ``kvpilot`` at the start becomes this interpreter's ``-m kvpilot``: the program is part of
    the image, so paths in it are never mapped to the pod's volumes; the arguments are the
    container's own.
    """
    dockerfile = IMAGES.get(repository(container.get("image", "")))
    if dockerfile is None:
        return None
    entrypoint, cmd = dockerfile_entrypoint(DOCKER / dockerfile)
    command = container.get("command")
    args = container.get("args")
    if command:
        argv = list(command) + list(args or [])
    else:
        argv = entrypoint + list(args if args is not None else cmd)
    if argv and argv[0] == "kvpilot":
        return [sys.executable, "-m", "kvpilot"], argv[1:]
    return argv[:1], argv[1:]
