"""Engine arguments (vLLM's names and flag spellings) and the resolved scheduler/cache settings.

This module imports no torch: the CLI builds its parser from it without loading the engine.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvpilot.engine.accepted_flags import add_accepted_flags
from kvpilot.engine.layers.quantization import QUANTIZATION_METHODS
from kvpilot.engine.lora.request import parse_lora_modules
from kvpilot.engine.reasoning_config import ReasoningConfig
from kvpilot.engine.spec_decode.config import SpeculativeConfig

# CPU defaults, chosen on a 2-core machine with the 135M default model (docs/benchmarks.md):
# 64 sequences keep decode matmuls wide without letting per-step decode attention dominate, and
# 512 tokens already keep prefill matmuls at full speed (a CPU is compute-bound from a few
# hundred rows on, unlike a GPU) while a burst of prompts is prefilled a few at a time, in
# arrival order, instead of all in one step: the first ones get their first token sooner (median
# TTFT 0.72 s instead of 1.23 s for a burst of 16 x 128 tokens) and the running streams stall
# for ~0.25 s steps instead of ~1 s ones; a long prompt alone prefills ~3% slower (its chunks
# re-read its cached part).
CPU_MAX_NUM_SEQS = 64
CPU_MAX_NUM_BATCHED_TOKENS = 512
GPU_MAX_NUM_SEQS = 256
GPU_MAX_NUM_BATCHED_TOKENS = 8192
# Tokens per KV block when --block-size is not given. On a GPU vLLM's 16. On the CPU 8: half the
# unused slots in the running sequences' last blocks (KV waste at peak 1.9% instead of 4.7% on
# benchmarks/throughput.py's workload), with the same tokens and no slower (12.3-12.4 s against
# 12.5-13.0 s for that workload on one core, docs/benchmarks.md): the CPU kernel reads 8 or 16
# positions of a block at a time, in the same order.
GPU_BLOCK_SIZE = 16
CPU_BLOCK_SIZE = 8
# Default CPU KV budget: room for every sequence at full length, but never more than this many
# bytes (the cache is allocated, zeroed, up front).
CPU_DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3

DTYPES = ("auto", "float32", "float", "float16", "half", "bfloat16")
# vLLM's --kv-cache-dtype values: auto (the model dtype) or fp8 (fp8 and fp8_e4m3 are E4M3).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
ATTENTION_BACKENDS = ("torch", "triton")
DEVICES = ("auto", "cpu", "cuda")
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
# vLLM's --tokenizer-mode values kvpilot serves: both read the tokenizer with transformers
# (vLLM's "auto" picks mistral_common for Mistral models, which kvpilot does not use).
TOKENIZER_MODES = ("auto", "hf")
# vLLM's --load-format values kvpilot serves: auto reads a folder's safetensors or converts a
# .gguf file to them; safetensors and gguf insist on one of the two; dummy fills the weights with
# random values (no weights read or downloaded).
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# vLLM's --lora-dtype values (the LoRA weights' dtype; auto: the model's), and float32, which
# vLLM 0.32 refuses but which is the model dtype on the CPU.
LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")
# vLLM's --scheduling-policy: fcfs (arrival order), or priority (a request's ``priority``, lower
# first, then arrival; preemption takes the lowest-priority running request).
SCHEDULING_POLICIES = ("fcfs", "priority")

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
}


def parse_bytes(text: str | int) -> int:
    """Parse a memory size: a byte count (``1073741824``) or a number with a unit (``1GiB``, ``512MB``).

    Raises:
        ValueError: when the text is not a non-negative size.
    """
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a memory size: {text!r} (examples: 1073741824, 1GiB, 512MB)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _memory_size(text: str) -> int:
    """``parse_bytes`` as an argparse type: its own message, not argparse's "invalid
    parse_bytes value"."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_SUFFIXES = {"k": 1000, "m": 1000**2, "g": 1000**3, "K": 2**10, "M": 2**20, "G": 2**30}
_QUANTIZATION_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}


def _token_count(text: str) -> int:
    """A count of tokens as vLLM's flags read it: an integer, or with a suffix, lowercase in
    powers of 1,000 (``32k``: 32,000; ``1.5k``: 1,500), uppercase in powers of 1,024 (``32K``:
    32,768). An argparse type."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a number of tokens: {text!r} (e.g. 2048, 32k, 32K)")
    number, suffix = match.groups()
    value = float(number) * _SUFFIXES.get(suffix, 1)
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"not a whole number of tokens: {text!r}")
    return int(value)


def _max_model_len(text: str) -> int | None:
    """``--max-model-len``: a token count (``_token_count``), or ``auto`` / ``-1`` for the
    default (None: the model's ``max_position_embeddings``, stretched by a linear, dynamic or
    YaRN ``rope_scaling`` factor as vLLM stretches it)."""
    return None if text.strip() in ("auto", "-1") else _token_count(text)


def _check_generation_overrides(overrides: dict[str, Any]) -> None:
    """The values of ``override_generation_config`` that the engine reads, checked as a
    request's would be (``SamplingParams``); ``max_new_tokens`` a positive integer.

    Raises:
        ValueError: ``override_generation_config <entry> ...`` naming the entry.
    """
    from kvpilot.engine.model_loader.generation_config import MAX_NEW_TOKENS, SAMPLING_FIELDS
    from kvpilot.engine.sampling_params import SamplingParams, is_int

    sampling = {key: overrides[key] for key in SAMPLING_FIELDS if overrides.get(key) is not None}
    for key, value in sampling.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"override_generation_config {key} must be a number, got {value!r}")
    try:
        SamplingParams(**sampling)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"override_generation_config {exc}") from None
    limit = overrides.get(MAX_NEW_TOKENS)
    if limit is not None and not (is_int(limit) and limit > 0):
        raise ValueError(
            f"override_generation_config {MAX_NEW_TOKENS} must be a positive integer, got {limit!r}"
        )


def _tokenizer_mode(text: str) -> str:
    if text not in TOKENIZER_MODES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: kvpilot reads every tokenizer with transformers (auto or hf); vLLM's "
            "other modes (mistral_common and the like) are not supported"
        )
    return text


def _quantization(text: str) -> str:
    """``--quantization``, with vLLM's kernel-specific names taken as their method
    (``awq_marlin``: ``awq``)."""
    return _QUANTIZATION_ALIASES.get(text, text)


class _ServedModelNames(argparse.Action):
    """``--served-model-name a b``: every name in ``served_model_names``, the first (the one
    responses report) in ``served_model_name``."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        namespace.served_model_names = list(values)
        setattr(namespace, self.dest, values[0])


def name_flags(message: str, flags: Mapping[str, str]) -> str:
    """``message`` with each argument name of ``flags`` it holds as a whole word (``max_model_len``)
    spelled as the flag a command-line user wrote (``--max-model-len``); a name in double quotes
    (a JSON key, as in ``--reasoning-config``'s ``"reasoning_parser"``) is left as it is.

    Args:
        message: an error message that names arguments as Python does.
        flags: ``{argument name: flag}``.
    """
    if not flags:
        return message
    names = "|".join(re.escape(name) for name in sorted(flags, key=len, reverse=True))
    return re.sub(
        rf"(?<![\w\-./\"])({names})(?![\w\-/\"]|\.\w)", lambda m: flags[m.group(1)], message
    )


def kv_cache_dtype_bytes(kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """Bytes of one cached K or V element: the model dtype's for ``auto``, 1 for the fp8 ones.

    The engine sizes its cache by it; the operator's planner can size KV memory by the same
    rule without importing torch.

    Raises:
        ValueError: a ``kv_cache_dtype`` not in ``KV_CACHE_DTYPES``.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; expected one of {', '.join(KV_CACHE_DTYPES)}"
        )
    return model_dtype_bytes if kv_cache_dtype == "auto" else 1


def resolve_block_size(block_size: int | None, *, on_gpu: bool) -> int:
    """Tokens per KV cache block as the engine runs it: ``block_size`` when set, else the
    device's default (``GPU_BLOCK_SIZE``, ``CPU_BLOCK_SIZE``), as vLLM leaves ``--block-size``
    to the platform."""
    if block_size is not None:
        return block_size
    return GPU_BLOCK_SIZE if on_gpu else CPU_BLOCK_SIZE


def resolve_max_num_batched_tokens(
    max_num_batched_tokens: int | None,
    max_model_len: int,
    *,
    enable_chunked_prefill: bool,
    on_gpu: bool,
) -> int:
    """The token budget of one scheduler step (tokens), as the engine runs it.

    The one rule both the engine and the operator's planner use, so that the flags the planner
    renders are flags the engine accepts: the device default (``GPU_MAX_NUM_BATCHED_TOKENS`` or
    ``CPU_MAX_NUM_BATCHED_TOKENS``) unless set; without chunked prefill a whole prompt of up to
    ``max_model_len`` tokens must fit in one step, so the default grows to ``max_model_len``
    (vLLM's scheduler does the same) and a smaller explicit budget is refused.

    Raises:
        ValueError: an explicit budget below ``max_model_len`` without chunked prefill.
    """
    default = GPU_MAX_NUM_BATCHED_TOKENS if on_gpu else CPU_MAX_NUM_BATCHED_TOKENS
    batched = max_num_batched_tokens or default
    if not enable_chunked_prefill:
        if max_num_batched_tokens is None:
            return max(batched, max_model_len)
        if batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({batched}) must be >= max_model_len "
                f"({max_model_len}) without chunked prefill"
            )
    return batched


@dataclass
class EngineArgs:
    """Everything a user may set about the engine; field names are vLLM's ``EngineArgs`` names.

    ``None`` means "choose a default": ``max_model_len`` from the model config
    (``max_position_embeddings``), ``block_size`` / ``max_num_seqs`` / ``max_num_batched_tokens``
    per device,
    ``kv_cache_memory`` (bytes) from ``max_num_seqs * max_model_len`` tokens capped at
    ``CPU_DEFAULT_KV_CACHE_MEMORY`` on the CPU; on GPU the KV cache takes ``gpu_memory_utilization``
    of the device memory minus what a profiling forward pass used, unless ``kv_cache_memory`` is
    set (vLLM's ``kv_cache_memory_bytes``, which is accepted as another name for it).
    ``hf_overrides`` (a dict, or its JSON text) replaces entries of the model's config.json
    before anything reads it (a nested config such as ``text_config`` is updated key by key);
    ``override_generation_config`` (the same) replaces entries of its generation config.
    ``num_gpu_blocks_override`` sets the number of KV blocks on any device, in place of the
    budget (vLLM's, for tests and reproductions). ``reasoning_config`` (a ``ReasoningConfig``,
    its dict or JSON text) and ``reasoning_parser`` (a ``--reasoning-parser`` name, which fills
    the config's strings left empty, as in vLLM) tell the engine where a think block starts and
    ends, for requests with a ``thinking_token_budget``; validation leaves a ``ReasoningConfig``
    or None in ``reasoning_config``. ``hf_token`` (a token, or True for the one
    ``huggingface-cli login`` stored), ``tokenizer_revision`` and ``ignore_patterns`` (globs of
    repository files not to download) apply to Hub downloads. ``max_cpu_loras`` (None, or 0 or
    less: ``max_loras``) bounds the LoRA adapters kept in host memory and ``lora_dtype`` is
    their weights' dtype (``auto``: the model's), as vLLM's ``LoRAConfig``.

    Raises:
        ValueError: from ``validate()`` (called by ``__post_init__``), naming the argument.
    """

    model: str | None = None
    revision: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_memory: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    distributed_timeout_seconds: int = 600
    attention_backend: str | None = None
    served_model_name: str | None = None
    generation_config: str = "auto"
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    lora_modules: list[str] | None = None
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    reasoning_parser: str | None = None
    reasoning_config: ReasoningConfig | dict[str, Any] | str | None = None
    quantization: str | None = None
    download_dir: str | None = None
    tokenizer_mode: str = "auto"
    load_format: str = "auto"
    hf_overrides: dict[str, Any] | str | None = None
    override_generation_config: dict[str, Any] | str | None = None
    num_gpu_blocks_override: int | None = None
    scheduling_policy: str = "fcfs"
    hf_token: str | bool | None = None
    tokenizer_revision: str | None = None
    ignore_patterns: list[str] | None = None
    # Accepted as vLLM takes them; nothing to change here: kvpilot serves the architectures it
    # implements (a model repository's own code never runs) and always runs eagerly.
    trust_remote_code: bool = False
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every argument's type and range.

        Raises:
            ValueError: naming the first bad argument and its value.
        """

        def bad(name: str, msg: str, show_value: bool = True) -> None:
            got = f", got {getattr(self, name)!r}" if show_value else ""
            raise ValueError(f"{name} {msg}{got}")

        def positive_int(name: str, optional: bool = True) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                bad(name, "must be a positive integer")

        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        if not isinstance(self.calculate_kv_scales, bool):
            bad("calculate_kv_scales", "must be a boolean")
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            bad(
                "calculate_kv_scales",
                "needs an fp8 KV cache: set kv_cache_dtype to fp8 (it is 'auto')",
                show_value=False,
            )
        if self.kv_cache_memory_bytes is not None:
            positive_int("kv_cache_memory_bytes")
            if self.kv_cache_memory not in (None, self.kv_cache_memory_bytes):
                bad(
                    "kv_cache_memory_bytes",
                    f"is another name for kv_cache_memory, set to {self.kv_cache_memory}",
                )
            self.kv_cache_memory = self.kv_cache_memory_bytes
        if self.tokenizer_mode not in TOKENIZER_MODES:
            bad(
                "tokenizer_mode",
                f"must be one of {', '.join(TOKENIZER_MODES)} (kvpilot reads every tokenizer "
                "with transformers)",
            )
        if self.load_format not in LOAD_FORMATS:
            bad(
                "load_format",
                f"must be one of {', '.join(LOAD_FORMATS)} (kvpilot reads safetensors; a .gguf "
                "model is converted to them)",
            )
        is_gguf = isinstance(self.model, str) and self.model.endswith(".gguf")
        if self.load_format == "gguf" and not is_gguf:
            bad("load_format", "gguf needs a .gguf file as the model", show_value=False)
        if self.load_format == "safetensors" and is_gguf:
            bad("load_format", "safetensors cannot read a .gguf model (use auto or gguf)", False)
        for name in ("hf_overrides", "override_generation_config"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    bad(name, f"is not JSON ({exc})")
                setattr(self, name, value)
            if value is not None and not isinstance(value, dict):
                bad(name, "must be a JSON object")
        if self.override_generation_config:
            _check_generation_overrides(self.override_generation_config)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            bad("scheduling_policy", f"must be one of {', '.join(SCHEDULING_POLICIES)}")
        if self.hf_token is not None and not isinstance(self.hf_token, str | bool):
            bad("hf_token", "must be a token or True (the stored login)", show_value=False)
        if self.ignore_patterns is not None and (
            isinstance(self.ignore_patterns, str)
            or not all(isinstance(p, str) for p in self.ignore_patterns)
        ):
            bad("ignore_patterns", "must be a list of globs")
        if self.device not in DEVICES:
            bad("device", f"must be one of {', '.join(DEVICES)}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            bad("quantization", f"must be one of {', '.join(QUANTIZATION_METHODS)} (or unset)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        for name in (
            "max_model_len",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "kv_cache_memory",
            "num_gpu_blocks_override",
        ):
            positive_int(name)
        positive_int("tensor_parallel_size", optional=False)
        positive_int("pipeline_parallel_size", optional=False)
        positive_int("distributed_timeout_seconds", optional=False)
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            bad(
                "distributed_executor_backend",
                f"must be one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}",
            )
        positive_int("max_loras", optional=False)
        positive_int("max_lora_rank", optional=False)
        if self.lora_dtype not in LORA_DTYPES:
            bad("lora_dtype", f"must be one of {', '.join(LORA_DTYPES)}")
        # vLLM's LoRAConfig rule: 0 or less (or None) is the default, max_loras; below
        # max_loras is refused, with LoRA on only (vLLM builds no LoRA config without it).
        if self.max_cpu_loras is not None:
            if isinstance(self.max_cpu_loras, bool) or not isinstance(self.max_cpu_loras, int):
                bad("max_cpu_loras", "must be an integer (0 or less: max_loras)")
            if self.max_cpu_loras <= 0:
                self.max_cpu_loras = None
            elif self.enable_lora and self.max_cpu_loras < self.max_loras:
                bad(
                    "max_cpu_loras",
                    f"({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})",
                    show_value=False,
                )
        if not isinstance(self.enable_expert_parallel, bool):
            bad("enable_expert_parallel", "must be a boolean")
        for name in ("enable_lora", "trust_remote_code", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a boolean")
        if self.download_dir is not None and not isinstance(self.download_dir, str):
            bad("download_dir", "must be a folder's path")
        if self.lora_modules is not None:
            if isinstance(self.lora_modules, str) or not isinstance(
                self.lora_modules, list | tuple
            ):
                bad("lora_modules", "must be a list of name=path entries")
            parse_lora_modules(self.lora_modules)
            if self.lora_modules and not self.enable_lora:
                bad("lora_modules", "needs enable_lora")
        if self.enable_lora and self.tensor_parallel_size > 1:
            bad("enable_lora", "is not supported with tensor_parallel_size > 1 yet", False)
        if self.enable_lora and self.pipeline_parallel_size > 1:
            bad("enable_lora", "is not supported with pipeline_parallel_size > 1 yet", False)
        if not isinstance(self.gpu_memory_utilization, int | float) or not (
            0.0 < self.gpu_memory_utilization <= 1.0
        ):
            bad("gpu_memory_utilization", "must be in (0, 1]")
        if (
            isinstance(self.long_prefill_token_threshold, bool)
            or not isinstance(self.long_prefill_token_threshold, int)
            or self.long_prefill_token_threshold < 0
        ):
            bad("long_prefill_token_threshold", "must be an integer >= 0 (0: no cap)")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            bad("attention_backend", f"must be one of {', '.join(ATTENTION_BACKENDS)}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            bad("generation_config", "must be 'auto', 'vllm' or a folder")
        if self.speculative_config is not None:
            # Parsed here so that a bad config is refused before any model is loaded.
            self.speculative_config = SpeculativeConfig.from_json(self.speculative_config)
            if self.speculative_config.method == "draft_model" and self.pipeline_parallel_size > 1:
                bad(
                    "speculative_config",
                    "method 'draft_model' needs pipeline_parallel_size 1 (use 'ngram')",
                )
        if self.reasoning_parser is not None and not isinstance(self.reasoning_parser, str):
            bad("reasoning_parser", "must be a reasoning parser's name")
        self.reasoning_config = ReasoningConfig.from_json(
            self.reasoning_config, self.reasoning_parser
        )
        if (
            self.max_model_len is not None
            and self.max_num_batched_tokens is not None
            and not self.enable_chunked_prefill
            and self.max_num_batched_tokens < self.max_model_len
        ):
            bad(
                "max_num_batched_tokens",
                f"must be >= max_model_len ({self.max_model_len}) without chunked prefill, "
                "or a long prompt could never be scheduled",
            )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the engine flags, spelled as vLLM spells them, to ``parser`` and return it."""
        group = parser.add_argument_group("engine")
        group.add_argument(
            "--model",
            default=None,
            help="local folder or hub id (default: SmolLM2-135M-Instruct, built in)",
        )
        group.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
        group.add_argument(
            "--tokenizer", default=None, help="tokenizer folder or hub id (default: the model's)"
        )
        group.add_argument(
            "--dtype",
            default="auto",
            choices=DTYPES,
            help="weights, activations and (--kv-cache-dtype auto) KV cache dtype (auto: float32 on CPU, bfloat16/float16 on GPU)",
        )
        group.add_argument(
            "--kv-cache-dtype",
            default="auto",
            choices=KV_CACHE_DTYPES,
            help="KV cache storage: auto (the model dtype) or fp8 (fp8 = fp8_e4m3, or "
            "fp8_e5m2), with per-tensor scales from the checkpoint, 1.0 otherwise: half the "
            "bytes of float16/bfloat16, twice the tokens in the same memory",
        )
        group.add_argument(
            "--calculate-kv-scales",
            action="store_true",
            default=False,
            help="with an fp8 KV cache, set each layer's k/v scales from the first step's "
            "keys and values (max |k| / 200, max |v| / 100) instead of the checkpoint's",
        )
        group.add_argument(
            "--device", default="auto", choices=DEVICES, help="auto: cuda when available, else cpu"
        )
        group.add_argument(
            "--quantization",
            "-q",
            type=_quantization,
            default=None,
            choices=QUANTIZATION_METHODS,
            help="weight quantization method (default: the checkpoint's quantization_config); "
            "must match the checkpoint's, except fp8, which also quantizes an unquantized "
            "checkpoint while loading; vLLM's awq_marlin and gptq_marlin are awq and gptq",
        )
        group.add_argument(
            "--download-dir",
            default=None,
            help="folder the Hugging Face Hub downloads go to (default: the Hub's cache)",
        )
        group.add_argument(
            "--tokenizer-mode",
            default="auto",
            type=_tokenizer_mode,
            metavar="{auto,hf}",
            help="vLLM's tokenizer modes that kvpilot serves: both read the tokenizer with "
            "transformers (its fast tokenizer when there is one)",
        )
        group.add_argument(
            "--load-format",
            default="auto",
            choices=LOAD_FORMATS,
            help="auto: a folder's safetensors, or a .gguf file converted to them once; "
            "safetensors / gguf: only that kind; dummy: random weights, none read or "
            "downloaded (for profiling and sizing, as vLLM's dummy)",
        )
        group.add_argument(
            "--hf-overrides",
            default=None,
            metavar="JSON",
            help="entries of the model's config.json to replace, as JSON, e.g. "
            "'{\"max_position_embeddings\": 4096}'",
        )
        group.add_argument(
            "--override-generation-config",
            default=None,
            metavar="JSON",
            help="entries that replace the generation config's sampling defaults, e.g. "
            '\'{"temperature": 0.5, "max_new_tokens": 256}\' (with --generation-config vllm: '
            "the only defaults)",
        )
        group.add_argument(
            "--num-gpu-blocks-override",
            type=int,
            default=None,
            help="number of KV cache blocks, in place of what the memory budget gives (any "
            "device; for tests and reproductions)",
        )
        group.add_argument(
            "--scheduling-policy",
            default="fcfs",
            choices=SCHEDULING_POLICIES,
            help="fcfs: requests in arrival order; priority: by each request's priority "
            "(lower first, then arrival), preempting the lowest-priority running request",
        )
        group.add_argument(
            "--hf-token",
            nargs="?",
            const=True,
            default=None,
            help="Hugging Face Hub token for gated models (without a value: the token "
            "huggingface-cli login stored; default: HF_TOKEN)",
        )
        group.add_argument(
            "--tokenizer-revision",
            default=None,
            help="hub revision of --tokenizer (branch, tag or commit)",
        )
        group.add_argument(
            "--ignore-patterns",
            nargs="+",
            default=None,
            metavar="GLOB",
            help="repository files not to download from the Hub (default: consolidated*)",
        )
        group.add_argument(
            "--trust-remote-code",
            action=argparse.BooleanOptionalAction,
            default=False,
            help="accepted as vLLM takes it; changes nothing: kvpilot serves the architectures "
            "it implements and never runs a model repository's own code",
        )
        group.add_argument(
            "--enforce-eager",
            action=argparse.BooleanOptionalAction,
            default=False,
            help="accepted as vLLM takes it; changes nothing: kvpilot always runs eagerly (no "
            "CUDA graphs, no torch.compile)",
        )
        group.add_argument(
            "--seed",
            type=int,
            default=0,
            help="seed of the sampler for requests without their own seed",
        )
        group.add_argument(
            "--max-model-len",
            type=_max_model_len,
            default=None,
            help="longest prompt + output in tokens, as vLLM reads it: 2048, 32k (32,000), 32K "
            "(32,768); auto or -1: the default, the model's max_position_embeddings (times its "
            "rope_scaling factor for linear, dynamic and YaRN scaling)",
        )
        group.add_argument(
            "--block-size",
            type=int,
            default=None,
            help=f"tokens per KV cache block (default: {GPU_BLOCK_SIZE} on a GPU, "
            f"{CPU_BLOCK_SIZE} on the CPU)",
        )
        group.add_argument(
            "--max-num-seqs",
            type=int,
            default=None,
            help=f"most sequences in one step (default {GPU_MAX_NUM_SEQS} on GPU, {CPU_MAX_NUM_SEQS} on CPU)",
        )
        group.add_argument(
            "--max-num-batched-tokens",
            type=_token_count,
            default=None,
            help=f"token budget of one step (default {GPU_MAX_NUM_BATCHED_TOKENS} on GPU, {CPU_MAX_NUM_BATCHED_TOKENS} on CPU)",
        )
        group.add_argument(
            "--kv-cache-memory",
            "--kv-cache-memory-bytes",
            type=_memory_size,
            default=None,
            help="KV cache size in bytes, e.g. 2GiB (vLLM's --kv-cache-memory-bytes; default: "
            "on CPU enough for max-num-seqs full-length sequences, at most 2 GiB; on GPU "
            "what --gpu-memory-utilization leaves, which this replaces when set)",
        )
        group.add_argument(
            "--gpu-memory-utilization",
            type=float,
            default=0.9,
            help="fraction of GPU memory for weights, activations and KV cache",
        )
        group.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="reuse KV blocks of identical prompt prefixes",
        )
        group.add_argument(
            "--enable-chunked-prefill",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="split long prompts over several steps",
        )
        group.add_argument(
            "--long-prefill-token-threshold",
            type=int,
            default=0,
            help="cap on one request's prompt tokens per step (0: no cap)",
        )
        group.add_argument(
            "--tensor-parallel-size",
            "-tp",
            type=int,
            default=1,
            help="number of devices to shard each pipeline stage over",
        )
        group.add_argument(
            "--pipeline-parallel-size",
            "-pp",
            type=int,
            default=1,
            help="number of pipeline stages the layers are split into (world size: "
            "tensor-parallel-size x pipeline-parallel-size)",
        )
        group.add_argument(
            "--distributed-executor-backend",
            default="mp",
            choices=DISTRIBUTED_EXECUTOR_BACKENDS,
            help="how the ranks run: mp: processes on this node; ray: Ray actors in a placement "
            "group, on the cluster at RAY_ADDRESS or a local one",
        )
        group.add_argument(
            "--distributed-timeout-seconds",
            type=int,
            default=600,
            help="seconds a collective waits for a silent rank before the engine is declared dead",
        )
        group.add_argument(
            "--enable-expert-parallel",
            action=argparse.BooleanOptionalAction,
            default=False,
            help="mixture-of-experts models: place whole experts on the tensor-parallel ranks "
            "instead of a slice of every expert on each",
        )
        group.add_argument(
            "--attention-backend",
            default=None,
            choices=ATTENTION_BACKENDS,
            help="attention implementation, also used by the norm, rotary and activation layers "
            "(default: torch on CPU, triton on GPU)",
        )
        group.add_argument(
            "--served-model-name",
            nargs="+",
            action=_ServedModelNames,
            default=None,
            metavar="NAME",
            help="model name(s) the API answers to; the first is reported (default: the model's)",
        )
        group.add_argument(
            "--generation-config",
            default="auto",
            help="default sampling parameters (temperature, top_p, top_k, min_p, "
            "repetition_penalty) for requests that leave them unset: auto: the model's "
            "generation_config.json; vllm: the engine's own; or a folder with that file",
        )
        group.add_argument(
            "--enable-lora",
            action=argparse.BooleanOptionalAction,
            default=False,
            help="serve LoRA adapters (--lora-modules, /v1/load_lora_adapter)",
        )
        group.add_argument(
            "--max-loras",
            type=int,
            default=1,
            help="LoRA adapters resident at once, and distinct adapters in one batch",
        )
        group.add_argument(
            "--max-lora-rank", type=int, default=16, help="largest LoRA adapter rank accepted"
        )
        group.add_argument(
            "--max-cpu-loras",
            type=int,
            default=None,
            help="LoRA adapters whose weights stay in host memory, at least --max-loras "
            "(default, and 0 or less: --max-loras); beyond it the least recently used one that "
            "no unfinished request uses is dropped, and read again from its path when needed",
        )
        group.add_argument(
            "--lora-dtype",
            default="auto",
            choices=LORA_DTYPES,
            help="dtype of the LoRA weights (auto: the model's --dtype)",
        )
        group.add_argument(
            "--lora-modules",
            nargs="+",
            default=None,
            metavar="NAME=PATH",
            help='LoRA adapters to load at start: name=path (a PEFT folder or Hub id) or JSON {"name": ..., "path": ...}',
        )
        group.add_argument(
            "--speculative-config",
            default=None,
            help="speculative decoding, as JSON (vLLM's shape): "
            '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or '
            '\'{"method": "draft_model", "model": "DIR", "num_speculative_tokens": 4}\'',
        )
        group.add_argument(
            "--reasoning-config",
            default=None,
            metavar="JSON",
            help="where a think block starts and ends, for requests' thinking_token_budget, as "
            'JSON (vLLM\'s shape): \'{"reasoning_start_str": "<think>", "reasoning_end_str": '
            "\"</think>\"}'; empty strings take --reasoning-parser's tags (with that flag alone "
            "they are its tags); reasoning_end_str is what a spent budget forces",
        )
        add_accepted_flags(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Build from a namespace parsed with ``add_cli_args``; other attributes are ignored.

        Raises:
            ValueError: from ``validate()``, naming each argument by its flag
                (``--max-model-len``, ``name_flags``).
        """
        try:
            return cls(
                **{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
            )
        except ValueError as exc:
            raise ValueError(name_flags(str(exc), ENGINE_FLAGS)) from None


ENGINE_FLAGS = {
    f.name: "--" + f.name.replace("_", "-") for f in fields(EngineArgs) if "_" in f.name
}
"""``{EngineArgs field: its flag}`` for the fields whose name is no English word
(``max_model_len``: ``--max-model-len``), for ``name_flags``; every flag is vLLM's spelling of
the field."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Resolved scheduling limits of one engine (all in tokens or sequences)."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int
    # Distinct LoRA adapters among running requests; 0: LoRA is off.
    max_loras: int = 0


@dataclass(frozen=True)
class CacheConfig:
    """Resolved KV cache geometry of one engine.

    Attributes:
        block_size: tokens per block.
        num_blocks: blocks in the pool.
        bytes_per_token: K and V of one token over all layers (bytes).
        enable_prefix_caching: whether full blocks are hashed and reused.
        cache_dtype: the ``kv_cache_dtype`` setting (vLLM's ``CacheConfig.cache_dtype``):
            ``auto`` or an fp8 name.
    """

    block_size: int
    num_blocks: int
    bytes_per_token: int
    enable_prefix_caching: bool
    cache_dtype: str = "auto"

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole cache holds."""
        return self.num_blocks * self.block_size
