"""``kvpilot plan``: size a model for a GPU type and print the plan the operator would use.

Examples::

    kvpilot plan hf://meta-llama/Meta-Llama-3-70B --gpu H100 --max-model-len 8192
    kvpilot plan ./Qwen2.5-72B/config.json --gpu a100-80gb --concurrency 16
    kvpilot plan --gpu cpu --memory 4Gi          # the built-in default model on CPU

The command line becomes an ``LLMDeployment`` spec (``_SPEC_FIELDS``), validated and planned as
the operator would; errors name the flags that were typed, not the spec's field paths.
``--gpu`` is forgiving (``gpus.resolve_gpu_name``: any case, ``H100`` for ``H100-80GB``); the
CRD's ``spec.gpu.type`` is an enum and stays exact.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

from kvpilot.operator.crd import KV_CACHE_DTYPES, QUANTIZATION_METHODS, SPEC_DTYPES
from kvpilot.operator.gpus import CATALOGUE, CPU, CUSTOM, resolve_gpu_name
from kvpilot.operator.spec import SpecError

# Each option that becomes a spec field: argparse dest -> its path under ``spec``. The one map
# both ways: ``_spec_dict`` writes the fields, ``_in_flags`` names them back as ``--flags``.
_SPEC_FIELDS = {
    "gpu": "gpu.type",
    "gpu_memory_gib": "gpu.memoryGiB",
    "per_node": "gpu.perNode",
    "memory": "resources.limits.memory",
    "revision": "model.revision",
    "max_model_len": "engine.maxModelLen",
    "dtype": "engine.dtype",
    "kv_cache_dtype": "engine.kvCacheDtype",
    "quantization": "engine.quantization",
    "max_num_seqs": "engine.maxNumSeqs",
    "max_num_batched_tokens": "engine.maxNumBatchedTokens",
    "tensor_parallel_size": "tensorParallelSize",
    "gpu_memory_utilization": "gpuMemoryUtilization",
}
# Spec terms in messages -> command-line terms: the fields above as flags, plus what stands for
# the positional model argument and for CPU mode ("no spec.gpu" is --gpu cpu here).
_CLI_TERMS = {
    **{f"spec.{path}": f"--{dest.replace('_', '-')}" for dest, path in _SPEC_FIELDS.items()},
    "spec.model.source": "model",
    "spec.model.config": "model",
    "no spec.gpu": "--gpu cpu",
    "spec.gpu": "--gpu",
}
# Longest first, and never a prefix of a longer name (spec.gpu in spec.gpuMemoryUtilization).
_SPEC_TERM = re.compile(
    "(?:"
    + "|".join(re.escape(term) for term in sorted(_CLI_TERMS, key=len, reverse=True))
    + r")(?!\w|\.\w)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``kvpilot plan``'s arguments to ``parser``."""
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="hf://org/name, a hub id (org/name), file:///path, a local folder, config.json or "
        ".gguf file (default: the built-in SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--gpu",
        required=True,
        type=_gpu_name,
        help=f"GPU type: {', '.join(CATALOGUE)}; custom (with --gpu-memory-gib); or cpu. Any "
        "case; a unique first part stands for the whole name (H100 = H100-80GB)",
    )
    parser.add_argument("--gpu-memory-gib", type=float, default=None, help="memory of a custom GPU")
    parser.add_argument("--per-node", type=int, default=None, help="GPUs per node (default 8)")
    parser.add_argument("--memory", default="4Gi", help="CPU mode: memory limit (default 4Gi)")
    parser.add_argument("--revision", default=None, help="hub branch, tag or commit")
    parser.add_argument("--max-model-len", type=int, default=None, help="tokens per sequence")
    parser.add_argument("--dtype", default="auto", choices=SPEC_DTYPES)
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV cache dtype (fp8: one byte per element, twice the tokens)",
    )
    parser.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=QUANTIZATION_METHODS,
        help="weight quantization (default the checkpoint's; fp8 also quantizes an unquantized one)",
    )
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="sequences of --max-model-len tokens the KV cache must hold at once (default 1)",
    )
    parser.add_argument("--json", action="store_true", help="print status.plan as JSON")


def run(args: argparse.Namespace) -> int:
    """Plan and print; exit code 1 with the reason when the model cannot be served as asked."""
    from kvpilot.operator.model_source import load_model_shape
    from kvpilot.operator.planner import PlanError, plan_for_spec
    from kvpilot.operator.spec import SpecError, parse_spec

    try:
        spec = parse_spec(_spec_dict(args))
        plan = plan_for_spec(spec, load_model_shape(spec.model), concurrency=args.concurrency)
    except SpecError as exc:
        print(f"error: {_in_flags(exc.field)}: {_in_flags(exc.message)}", file=sys.stderr)
        return 2
    except PlanError as exc:
        print(f"cannot plan: {exc.reason}: {_in_flags(exc.message)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(plan.to_status(), indent=2))
    else:
        _print_table(args.model or spec.model.display_name, plan)
    return 0


def _gpu_name(name: str) -> str:
    try:
        return resolve_gpu_name(name, (*CATALOGUE, CUSTOM, CPU))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _spec_dict(args: argparse.Namespace) -> dict:
    """The command line as an LLMDeployment spec, so it is validated and planned like one.

    ``--gpu cpu`` is CPU mode (no ``spec.gpu``, the memory limit is the budget); with a GPU the
    memory limit does not size anything and is left out.
    """
    spec: dict = {"model": _model_dict(args.model)}
    skipped = "gpu." if args.gpu == CPU else "resources."
    for dest, path in _SPEC_FIELDS.items():
        value = getattr(args, dest)
        if value is None or path.startswith(skipped):
            continue
        *parents, key = path.split(".")
        node = spec
        for parent in parents:
            node = node.setdefault(parent, {})
        node[key] = value
    return spec


def _in_flags(text: str) -> str:
    """``text`` with the spec's field paths replaced by the command line's flags."""
    return _SPEC_TERM.sub(lambda match: _CLI_TERMS[match.group()], text)


def _model_dict(model: str | None) -> dict:
    if model is None:
        return {}
    if model.startswith("hf://"):
        return {"source": model}
    if model.startswith("pvc://"):
        raise SpecError("model", "kvpilot plan cannot read a claim: pass the model's config.json")
    path = pathlib.Path(model.removeprefix("file://")).expanduser()
    if path.is_file() and path.suffix == ".json":
        try:
            config = json.loads(path.read_text())
        except ValueError as exc:
            raise SpecError("model", f"{model} is not JSON: {exc}") from exc
        if config is None:  # not "no config": that would plan the built-in model
            raise SpecError("model", f"{model}: must be an object, got null")
        return {"config": config}
    if path.is_dir() and not (path / "config.json").is_file():
        raise SpecError("model", f"no config.json in {model}")
    if path.exists():
        return {"source": f"file://{path.resolve()}"}
    if path.suffix in (".json", ".gguf") or model.startswith(("/", ".", "~", "file://")):
        # A local path with a typo, not a hub id to fetch (with retries) from the network.
        raise SpecError("model", f"{model}: no such file or folder")
    return {"source": f"hf://{model}"}


def _print_table(model: str, plan) -> None:
    from rich.console import Console
    from rich.table import Table

    gib = 1024**3
    # Sizes are per GPU, or per replica in CPU mode (one process, no GPU).
    per = "per replica" if plan.gpu_type == CPU else "per GPU"
    if plan.pipeline_parallel_size > 1:
        per += " (largest stage)"
    table = Table(title=f"{model} on {plan.gpu_type}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    utilization = plan.gpu_memory_utilization
    active = (
        plan.num_parameters if plan.num_active_parameters is None else plan.num_active_parameters
    )
    rows = [
        ("parameters (total)", f"{plan.num_parameters / 1e9:.2f} B"),
        ("parameters (active per token)", f"{active / 1e9:.2f} B"),
        ("dtype", plan.dtype),
        ("quantization", plan.quantization or "-"),
        ("kvCacheDtype", plan.kv_cache_dtype),
        ("tensorParallelSize", str(plan.tensor_parallel_size)),
        ("pipelineParallelSize", str(plan.pipeline_parallel_size)),
        ("nodesPerReplica", str(plan.nodes_per_replica)),
        ("gpusPerReplica", str(plan.gpus_per_replica)),
        ("gpuMemoryUtilization", "-" if utilization is None else f"{utilization:.2f}"),
        ("maxModelLen", f"{plan.max_model_len:,} tokens"),
        (f"weights {per}", f"{plan.weight_bytes_per_gpu / gib:.2f} GiB"),
        (f"activations + runtime {per}", f"{plan.reserve_bytes_per_gpu / gib:.2f} GiB"),
        (f"KV cache {per}", f"{plan.kv_cache_bytes_per_gpu / gib:.2f} GiB"),
        (f"KV bytes per token {per}", f"{plan.kv_bytes_per_token:,}"),
        ("KV capacity", f"{plan.kv_capacity_tokens:,} tokens"),
        ("max concurrency at maxModelLen", f"{plan.max_concurrency}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
