"""What a caller names to run a request with an adapter (vLLM's ``LoRARequest``), and the
``--lora-modules`` entries that name adapters at start-up.

This module imports no torch: the CLI parses ``--lora-modules`` with it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter to apply to one request.

    Attributes:
        lora_name: the adapter's name; the server's ``model`` field selects it.
        lora_int_id: a positive integer unique to the adapter (vLLM's id; 0 means the base).
        lora_path: a local folder with ``adapter_config.json`` and
            ``adapter_model.safetensors`` (what PEFT's ``save_pretrained`` writes), or a
            Hugging Face Hub id of one; a ``pathlib.Path`` is stored as its string.

    Raises:
        ValueError: an empty name or path, or an id that is not a positive integer.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id <= 0
        ):
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if isinstance(self.lora_path, os.PathLike):
            object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry (vLLM's ``LoRAModulePath``).

    Attributes:
        name: the adapter's name (what requests put in ``model``).
        path: its folder or Hugging Face Hub id.
    """

    name: str
    path: str


def parse_lora_module(text: str) -> LoRAModulePath:
    """Parse ``name=path`` or a JSON object ``{"name": ..., "path": ...}`` (vLLM's two forms).

    Raises:
        ValueError: neither form, or an empty name or path.
    """
    if not isinstance(text, str):
        raise ValueError(f"lora_modules entries must be strings, got {text!r}")
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"lora_modules entry {text!r} is not valid JSON: {exc}") from None
        name, path = entry.get("name"), entry.get("path")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            name = None
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(
            f"lora_modules entry {text!r} must be name=path or "
            '{"name": "...", "path": "..."} with a non-empty name and path'
        )
    return LoRAModulePath(name.strip(), path.strip())


def parse_lora_modules(entries: Iterable[str] | None) -> list[LoRAModulePath]:
    """Parse every ``--lora-modules`` entry.

    Raises:
        ValueError: a malformed entry, or a name given twice.
    """
    modules = [parse_lora_module(text) for text in entries or ()]
    names = [m.name for m in modules]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(f"lora_modules names the adapter {name!r} twice")
    return modules
