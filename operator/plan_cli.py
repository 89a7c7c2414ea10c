"""``kvpilot plan``: size a model for a GPU type and print the plan the operator would use.

Examples::

    kvpilot plan hf://meta-llama/Meta-Llama-3-70B --gpu H100-80GB --max-model-len 8192
    kvpilot plan ./Qwen2.5-72B/config.json --gpu A100-80GB --concurrency 16
    kvpilot plan --gpu cpu --memory 4Gi          # the built-in default model on CPU
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from kvpilot.operator.gpus import CATALOGUE, CPU, CUSTOM
from kvpilot.operator.spec import DTYPES, SpecError


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
        choices=(*CATALOGUE, CUSTOM, CPU),
        help="GPU type from the catalogue, custom (with --gpu-memory-gib), or cpu",
    )
    parser.add_argument("--gpu-memory-gib", type=float, default=None, help="memory of a custom GPU")
    parser.add_argument("--per-node", type=int, default=None, help="GPUs per node (default 8)")
    parser.add_argument("--memory", default="4Gi", help="CPU mode: memory limit (default 4Gi)")
    parser.add_argument("--revision", default=None, help="hub branch, tag or commit")
    parser.add_argument("--max-model-len", type=int, default=None, help="tokens per sequence")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
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
    from kvpilot.operator.model_source import load_model_spec
    from kvpilot.operator.planner import PlanError, plan_for_spec
    from kvpilot.operator.spec import SpecError, parse_spec

    try:
        spec = parse_spec(_spec_dict(args))
        plan = plan_for_spec(spec, load_model_spec(spec.model), concurrency=args.concurrency)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except PlanError as exc:
        print(f"cannot plan: {exc.reason}: {exc.message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(plan.to_status(), indent=2))
    else:
        _print_table(args.model or spec.model.display_name, plan)
    return 0


def _spec_dict(args: argparse.Namespace) -> dict:
    """The command line as an LLMDeployment spec, so it is validated and planned like one."""
    spec: dict = {"model": _model_dict(args.model, args.revision)}
    engine = {
        "maxModelLen": args.max_model_len,
        "dtype": args.dtype,
        "maxNumSeqs": args.max_num_seqs,
        "maxNumBatchedTokens": args.max_num_batched_tokens,
    }
    spec["engine"] = {k: v for k, v in engine.items() if v is not None}
    if args.gpu == CPU:
        spec["resources"] = {"limits": {"memory": args.memory}}
    else:
        gpu = {"type": args.gpu, "perNode": args.per_node, "memoryGiB": args.gpu_memory_gib}
        spec["gpu"] = {k: v for k, v in gpu.items() if v is not None}
    if args.tensor_parallel_size is not None:
        spec["tensorParallelSize"] = args.tensor_parallel_size
    if args.gpu_memory_utilization is not None:
        spec["gpuMemoryUtilization"] = args.gpu_memory_utilization
    return spec


def _model_dict(model: str | None, revision: str | None) -> dict:
    out: dict = {} if revision is None else {"revision": revision}
    if model is None or model.startswith(("hf://", "file://", "pvc://")):
        return {**out, "source": model} if model else out
    path = pathlib.Path(model).expanduser()
    if path.is_file() and path.suffix == ".json":
        return {**out, "config": json.loads(path.read_text())}
    if path.exists():
        return {**out, "source": f"file://{path.resolve()}"}
    if path.suffix in (".json", ".gguf") or model.startswith(("/", ".", "~")):
        # A local path with a typo, not a hub id to fetch (with retries) from the network.
        raise SpecError("model", f"{model}: no such file or folder")
    return {**out, "source": f"hf://{model}"}


def _print_table(model: str, plan) -> None:
    from rich.console import Console
    from rich.table import Table

    gib = 1024**3
    table = Table(title=f"{model} on {plan.gpu_type}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    utilization = plan.gpu_memory_utilization
    rows = [
        ("parameters", f"{plan.num_parameters / 1e9:.2f} B"),
        ("dtype", plan.dtype),
        ("tensorParallelSize", str(plan.tensor_parallel_size)),
        ("gpusPerReplica", str(plan.gpus_per_replica)),
        ("gpuMemoryUtilization", "-" if utilization is None else f"{utilization:.2f}"),
        ("maxModelLen", f"{plan.max_model_len:,} tokens"),
        ("weights per GPU", f"{plan.weight_bytes_per_gpu / gib:.2f} GiB"),
        ("activations + runtime per GPU", f"{plan.reserve_bytes_per_gpu / gib:.2f} GiB"),
        ("KV cache per GPU", f"{plan.kv_cache_bytes_per_gpu / gib:.2f} GiB"),
        ("KV bytes per token per GPU", f"{plan.kv_bytes_per_token:,}"),
        ("KV capacity", f"{plan.kv_capacity_tokens:,} tokens"),
        ("max concurrency at maxModelLen", f"{plan.max_concurrency}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
