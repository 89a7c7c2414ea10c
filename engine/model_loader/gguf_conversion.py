"""Convert a GGUF checkpoint into a plain Hugging Face folder (dequantized safetensors).

transformers reads the GGUF (weights dequantized to float32, tokenizer and chat template from the
GGUF metadata); we save the result with ``save_pretrained`` so later starts read safetensors
directly (~0.1 s instead of ~15 s). The folder is written under a temporary name and renamed
into place, so a crash mid-conversion never leaves a half-written cache behind.
"""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import tempfile
from typing import Any

from kvpilot.engine.model_loader.generation_config import add_sampling_defaults

logger = logging.getLogger(__name__)


def convert_gguf(
    gguf_path: pathlib.Path,
    out_dir: pathlib.Path,
    sampling_defaults: dict[str, Any] | None = None,
) -> pathlib.Path:
    """Dequantize ``gguf_path`` into the Hugging Face folder ``out_dir`` unless it exists.

    Args:
        gguf_path: a ``.gguf`` file of an architecture transformers can read.
        out_dir: the folder to create: config.json, model.safetensors (float32),
            generation_config.json and the tokenizer files (with the chat template).
        sampling_defaults: recommended sampling to add to generation_config.json
            (``temperature``, ``top_p``, ...), or None.

    Returns:
        ``out_dir``.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        ValueError: transformers cannot read the file (the message names it).
    """
    if (out_dir / "config.json").is_file():
        return out_dir
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info(
        "Converting %s to safetensors in %s (once; later starts reuse it)", gguf_path, out_dir
    )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype="float32"
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        except (ValueError, KeyError, OSError) as exc:
            raise ValueError(f"cannot convert GGUF file {gguf_path}: {exc}") from exc
        # The dequantized weights are plain float32; without dropping the GGUF marker,
        # save_pretrained refuses (or later loads expect a quantizer).
        del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        if sampling_defaults:
            add_sampling_defaults(tmp_dir, sampling_defaults)
        del model
        tmp_dir.chmod(0o755)  # mkdtemp made it private; the cache is an ordinary folder
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:
            # Another process finished the same conversion first: keep its copy.
            if not (out_dir / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir
