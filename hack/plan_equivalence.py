"""Plans and errors of the planner at a git revision against the working tree's, over a grid.

Usage::

    .venv/bin/python hack/plan_equivalence.py --before 01607b3

The planner and ``ModelShape`` of ``--before`` are loaded from ``git show`` as modules of their
own; both plan every argument set of the grid (every config in ``tests/operator/configs`` that
the old ``ModelShape`` reads, the GPU catalogue with 4 and 8 GPUs per node, CPU mode, dtypes,
context lengths, tensor parallel sizes, utilizations and concurrencies). Each argument set
falls into one class, printed with its count:

- ``same plan``: every field the old ``Plan`` has is equal, the new plan is pipelined only
  where the old one was, over as many nodes (a ``Plan`` without ``nodes_per_replica`` had one
  node a stage);
- ``now on one node``: the same plan, pipelined over one node's GPUs where the old one put
  each stage on a node of its own;
- ``same error``: the same reason and message (an ``UnsupportedArchitecture`` message may list
  more supported architectures);
- ``now pipelined``: the old planner found no fit on one node (``ModelTooLarge`` or
  ``InsufficientKVCache``, no tensor parallel size fixed below the GPUs per node); the new plan
  has pipeline parallel size > 1;
- ``now supported``: the old planner refused the model itself (MoE, quantized checkpoint); the
  new one plans it, or refuses it for its size;
- anything else is a regression; the script exits 1 and prints the first few.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import pathlib
import subprocess
import sys
import tempfile
import time

from kvpilot.engine.model_shape import ModelShape
from kvpilot.operator.gpus import CATALOGUE, GiB, gpu_type
from kvpilot.operator.planner import PlanError, plan

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = REPO / "tests" / "operator" / "configs"


def _load_before(revision: str, folder: pathlib.Path):
    """The old ``model_shape`` and ``planner`` modules, importing each other, not the tree's."""
    modules = {}
    for name, path, rewrite in (
        ("_before_model_shape", "engine/model_shape.py", ()),
        (
            "_before_planner",
            "operator/planner.py",
            (("from kvpilot.engine.model_shape import", "from _before_model_shape import"),),
        ),
    ):
        text = subprocess.run(
            ["git", "show", f"{revision}:{path}"],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for old, new in rewrite:
            text = text.replace(old, new)
        file = folder / f"{name}.py"
        file.write_text(text)
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        modules[name] = module
    return modules["_before_model_shape"], modules["_before_planner"]


def _outcome(planner, model, kwargs):
    try:
        return planner.plan(model, **kwargs)
    except Exception as exc:  # PlanError of either module
        return (getattr(exc, "reason", type(exc).__name__), getattr(exc, "message", str(exc)))


def _grid():
    gpus = [None] + [gpu_type(name, per_node=per_node) for name in CATALOGUE for per_node in (4, 8)]
    for gpu in gpus:
        for dtype, max_model_len, tp, utilization, concurrency in itertools.product(
            ("auto", "float32"),
            (None, 2048, 8192, 32768),
            (None, 1, 2, 4, 8),
            (None, 0.95),
            (1, 8, 64),
        ):
            if gpu is None:
                if utilization is not None or tp not in (None, 1):
                    continue
                for memory in (2 * GiB, 16 * GiB, 64 * GiB):
                    yield {
                        "gpu": None,
                        "memory_bytes": memory,
                        "dtype": dtype,
                        "max_model_len": max_model_len,
                        "tensor_parallel_size": tp,
                        "concurrency": concurrency,
                    }
                continue
            yield {
                "gpu": gpu,
                "dtype": dtype,
                "max_model_len": max_model_len,
                "tensor_parallel_size": tp,
                "gpu_memory_utilization": utilization,
                "concurrency": concurrency,
            }


def _classify(old, new, kwargs, before_plan_type) -> str:
    gpu = kwargs["gpu"]
    if isinstance(old, before_plan_type):
        if isinstance(new, tuple):
            return "regression"
        fields = [f.name for f in dataclasses.fields(before_plan_type)]
        if (
            not all(getattr(old, f) == getattr(new, f) for f in fields)
            or getattr(old, "pipeline_parallel_size", 1) != new.pipeline_parallel_size
        ):
            return "regression"
        # Before nodes_per_replica, every pipeline stage had a node of its own.
        old_nodes = getattr(old, "nodes_per_replica", new.pipeline_parallel_size)
        if new.nodes_per_replica == old_nodes:
            return "same plan"
        return "now on one node" if new.nodes_per_replica == 1 else "regression"
    if old[0] in ("UnsupportedArchitecture", "UnsupportedQuantization") and (
        not isinstance(new, tuple) or new[0] != old[0]
    ):
        return "now supported"
    if isinstance(new, tuple):
        if old[0] != new[0]:
            return "regression"
        if old[1] == new[1]:
            return "same error"
        head = old[1].split("supported: ")[0]
        return (
            "same error"
            if old[0] == "UnsupportedArchitecture" and new[1].startswith(head)
            else "regression"
        )
    fixed_below_node = (
        kwargs.get("tensor_parallel_size") is not None
        and gpu is not None
        and kwargs["tensor_parallel_size"] < gpu.per_node
    )
    if (
        old[0] in ("ModelTooLarge", "InsufficientKVCache")
        and new.pipeline_parallel_size > 1
        and not fixed_below_node
    ):
        return "now pipelined"
    return "regression"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="git revision of the old planner")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        before_shape, before_planner = _load_before(args.before, pathlib.Path(folder))
        models = []
        for path in sorted(CONFIGS.glob("*.json")):
            config = json.loads(path.read_text())
            try:
                models.append((path.stem, before_shape.ModelShape.from_hf_config(config)))
            except ValueError as exc:
                print(f"skipped {path.stem}: the old ModelShape cannot read it ({exc})")
                continue
            models[-1] += (ModelShape.from_hf_config(config),)
        counts: dict[str, int] = {}
        regressions = []
        started = time.perf_counter()
        for (name, old_model, new_model), kwargs in itertools.product(models, list(_grid())):
            old = _outcome(before_planner, old_model, kwargs)
            try:
                new = plan(new_model, **kwargs)
            except PlanError as exc:
                new = (exc.reason, exc.message)
            kind = _classify(old, new, kwargs, before_planner.Plan)
            counts[kind] = counts.get(kind, 0) + 1
            if kind == "regression" and len(regressions) < 5:
                regressions.append((name, kwargs, old, new))
    total = sum(counts.values())
    print(
        f"{total} argument sets over {len(models)} models in {time.perf_counter() - started:.0f} s"
    )
    for kind, count in sorted(counts.items()):
        print(f"  {kind}: {count}")
    for regression in regressions:
        print("REGRESSION", *regression, sep="\n  ")
    return 1 if "regression" in counts else 0


if __name__ == "__main__":
    raise SystemExit(main())
