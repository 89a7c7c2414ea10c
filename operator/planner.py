"""PlanOutcome: model + device -> tensor parallel size, memory split and KV capacity (pure).

The plan is data (KubeAI's "plan, then apply"): the handlers write it to ``status.plan`` and
render manifests from it; ``kvpilot plan`` prints it. The arithmetic follows vLLM's memory
model: of each GPU's total memory, the fraction ``gpu_memory_utilization`` holds the weights
shard, the peak activations of one profiling step plus non-torch allocations, and the KV cache
(PagedAttention, Kwon et al., 2023: whole ``block_size``-token blocks). Sizes per GPU come from
``kvpilot.engine.model_shape``, the functions the engine itself uses.

Tensor parallel size: the smallest ``tp`` in ``1..gpu.per_node`` that passes vLLM's divisor
rule (``check_tensor_parallel_size``; any divisor, not only powers of two, as vLLM accepts) and
leaves room for ``concurrency`` sequences of ``max_model_len`` tokens.

Pipeline parallel size: 1 whenever a ``tp`` within one node fits (those plans are exactly what
they were before pipelining existed). Otherwise the model is split along its layers, as vLLM's
docs advise ("Distributed inference and serving"): first on one node, a model that fits a node
whose GPU count does not divide it (``tp * pp <= gpu.per_node`` over the valid ``tp``, fewest
GPUs first, then the largest ``tp``: e.g. TP 1 x PP 3), one pod whose ranks are processes;
else across nodes, ``tp`` = the largest valid size within a node (``gpu.per_node`` when it
divides the model) and the smallest ``pp`` that fits, one stage per node (vLLM's multi-node
recipe: TP = GPUs per node, PP = nodes), rendered as a LeaderWorkerSet
(:mod:`kvpilot.operator.leaderworkerset`); ``gpus_per_replica = tp * pp``. Each stage holds
its layers (``ModelShape.pipeline_stage_layers``, vLLM's split), the first also the embedding,
the last the LM head; the plan's per-GPU bytes are the largest stage's and its KV capacity the
smallest stage's (vLLM sizes every stage's cache to the same number of blocks). A user-set
``tensorParallelSize`` is pipelined at that size on one node, and across nodes only when it is
``gpu.per_node``. Where no shape fits but a pipeline holds the weights, the error is the KV
cache's (``InsufficientKVCache``, of the pipelined shape with the most KV).

Weights are sized from the checkpoint's quantization (``ModelShape.weight_bytes``: packed
weights and scales for fp8/AWQ/GPTQ/compressed-tensors, the rest at ``dtype``), or with
``quantization="fp8"`` of an unquantized checkpoint quantized while loading; the KV cache from
``kv_cache_dtype`` (``fp8`` = 1 byte per element: twice the tokens of a 16-bit cache).

``gpu_memory_utilization`` when not given: 0.90 (vLLM's default), lowered on small GPUs so that
at least ``OUTSIDE_BUDGET_HEADROOM_BYTES`` stay outside the budget for what vLLM does not count
in it (CUDA graphs captured after the KV cache is allocated, the CUDA context): 0.86 on a 24 GB
L4/A10G.

CPU mode (``gpu=None``): one process, TP 1, dtype ``auto`` = float32; the budget is the
container's memory limit minus ``CPU_RUNTIME_BYTES`` for Python, torch and the tokenizer; the
KV cache gets what is left after weights and activations and is passed as ``--kv-cache-memory``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from kvpilot.engine.config import (
    CPU_MAX_NUM_SEQS,
    GPU_MAX_NUM_SEQS,
    resolve_block_size,
    resolve_max_num_batched_tokens,
)
from kvpilot.engine.model_shape import (
    DTYPE_BYTES,
    KV_CACHE_DTYPE_BYTES,
    ModelShape,
    check_tensor_parallel_size,
)
from kvpilot.engine.weight_quantization import UnsupportedQuantizationError
from kvpilot.operator.gpus import CPU, GiB, GpuType
from kvpilot.operator.spec import LLMDeploymentSpec

DEFAULT_GPU_MEMORY_UTILIZATION = 0.90
"""vLLM's default fraction of GPU memory for weights, activations and KV cache."""

OUTSIDE_BUDGET_HEADROOM_BYTES = 3 * GiB
"""Memory left outside the budget for CUDA graphs and the CUDA context when choosing it."""

GPU_RUNTIME_BYTES = 1 * GiB
"""Non-torch memory inside the budget per GPU: cuBLAS workspaces, NCCL buffers, fragmentation."""

CPU_RUNTIME_BYTES = 3 * GiB // 2
"""Memory of the engine process besides weights and KV cache (Python, torch, tokenizer, server).

Measured on the default model (2 cores, torch 2.13): 0.35 GiB resident besides weights and
cache once loaded, 1.34 GiB peak while loading (weights included); the margin covers the API
server and the one-time GGUF conversion of a fresh model cache.
"""

LOGITS_BYTES = 4
"""Logits are float32 whatever the model dtype (the sampler's input)."""


class PlanError(Exception):
    """The model cannot be served as asked; written as ``Sized=False`` with ``reason``.

    Attributes:
        reason: CamelCase condition reason: ``UnsupportedArchitecture``,
            ``UnsupportedQuantization``, ``MaxModelLenTooLarge``, ``InvalidTensorParallelSize``,
            ``ModelTooLarge`` or ``InsufficientKVCache``. (TP 1 always splits a model, so
            "no valid tensor parallel size" shows as ``ModelTooLarge`` at the largest valid
            one, which the message names; at a ``tensor_parallel_size`` the user fixed, the
            message names that size and the smallest one that would fit, if any.)
        message: a sentence for people, with the numbers that decided.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Plan:
    """How one replica is sized. Bytes are per GPU (per process in CPU mode).

    Attributes:
        gpu_type: catalogue name, ``"custom"``, or ``"cpu"``.
        dtype: concrete dtype of the unquantized weights and activations (``"bfloat16"``, ...).
        tensor_parallel_size: ranks per pipeline stage (per replica without pipelining).
        gpus_per_replica: GPUs a replica uses, ``tensor_parallel_size *
            pipeline_parallel_size`` (0 in CPU mode).
        gpu_memory_utilization: the budget fraction passed to the engine (None in CPU mode).
        max_model_len: longest prompt + output, tokens.
        max_num_seqs: most sequences per step (the engine default unless set).
        max_num_batched_tokens: token budget per step (the engine default unless set).
        block_size: tokens per KV block.
        num_parameters: whole model (every expert of an MoE; memory is sized from these).
        weight_bytes_per_gpu: this rank's weight shard (the largest stage's when pipelined), in
            the checkpoint's quantized format where it has one.
        reserve_bytes_per_gpu: peak activations of one step plus runtime overhead.
        kv_cache_bytes_per_gpu: the KV cache (whole blocks), also ``--kv-cache-memory`` on CPU.
        kv_bytes_per_token: KV of one token on one rank (of the stage with the most layers
            when pipelined), in ``kv_cache_dtype``.
        kv_capacity_tokens: tokens the KV cache holds (per replica; every rank holds the same
            tokens for its own heads and layers; the fewest of any stage when pipelined).
        max_concurrency: sequences of ``max_model_len`` tokens the cache holds at once.
        pipeline_parallel_size: pipeline stages per replica (1 unless no tensor parallel
            size within one node fits).
        nodes_per_replica: nodes a replica spans: 1, or ``pipeline_parallel_size`` when its
            GPUs outnumber a node's (one stage per node, a LeaderWorkerSet group).
        kv_cache_dtype: ``--kv-cache-dtype`` (``auto`` = ``dtype``; ``fp8*`` = 1 byte).
        quantization: the weights' quantization method (the checkpoint's, or ``fp8`` forced on
            an unquantized one), None for unquantized weights.
        num_active_parameters: parameters one token runs through (MoE: the routed experts
            only); equal to ``num_parameters`` for dense models.
    """

    gpu_type: str
    dtype: str
    tensor_parallel_size: int
    gpus_per_replica: int
    gpu_memory_utilization: float | None
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_parameters: int
    weight_bytes_per_gpu: int
    reserve_bytes_per_gpu: int
    kv_cache_bytes_per_gpu: int
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    max_concurrency: int
    pipeline_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    num_active_parameters: int | None = None
    nodes_per_replica: int = 1

    def to_status(self) -> dict[str, Any]:
        """The plan as ``status.plan`` (camelCase keys, JSON values)."""
        status = {
            "gpuType": self.gpu_type,
            "dtype": self.dtype,
            "tensorParallelSize": self.tensor_parallel_size,
            "pipelineParallelSize": self.pipeline_parallel_size,
            "nodesPerReplica": self.nodes_per_replica,
            "gpusPerReplica": self.gpus_per_replica,
            "maxModelLen": self.max_model_len,
            "numParameters": self.num_parameters,
            "numActiveParameters": (
                self.num_parameters
                if self.num_active_parameters is None
                else self.num_active_parameters
            ),
            "weightBytesPerGpu": self.weight_bytes_per_gpu,
            "kvCacheDtype": self.kv_cache_dtype,
            "kvBytesPerToken": self.kv_bytes_per_token,
            "kvCacheBytesPerGpu": self.kv_cache_bytes_per_gpu,
            "kvCapacityTokens": self.kv_capacity_tokens,
            "maxConcurrency": self.max_concurrency,
        }
        if self.gpu_memory_utilization is not None:
            status["gpuMemoryUtilization"] = self.gpu_memory_utilization
        if self.quantization is not None:
            status["quantization"] = self.quantization
        return status


def default_gpu_memory_utilization(gpu: GpuType) -> float:
    """0.90, or less so that ``OUTSIDE_BUDGET_HEADROOM_BYTES`` stay free; two decimals, down."""
    fraction = 1 - OUTSIDE_BUDGET_HEADROOM_BYTES / gpu.memory_bytes
    return min(DEFAULT_GPU_MEMORY_UTILIZATION, math.floor(fraction * 100) / 100)


def activation_bytes(
    model: ModelShape,
    *,
    dtype_bytes: int,
    tensor_parallel_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> int:
    """Peak activation memory of one step on one rank, bytes (what vLLM's profiling run sees).

    The largest live tensors of a step of ``max_num_batched_tokens`` tokens: the MLP's
    ``[tokens, 2 * intermediate / tp]`` gate/up output with its ``[tokens, intermediate / tp]``
    product (per routed expert for MoE, ``intermediate`` one expert's width, plus the shared
    expert's), about four ``[tokens, hidden]`` residual and norm buffers, and
    ``[max_num_seqs, vocab_size]`` float32 logits.
    """
    intermediate = model.expert_intermediate_size // tensor_parallel_size
    per_token = 3 * intermediate * max(1, model.num_experts_per_tok) + 4 * model.hidden_size
    per_token += 3 * (model.shared_expert_intermediate_size // tensor_parallel_size)
    logits = max_num_seqs * model.vocab_size * LOGITS_BYTES
    return max_num_batched_tokens * per_token * dtype_bytes + logits


@dataclass(frozen=True)
class _Ask:
    """What one ``plan()`` call asks, resolved by the first rules: the state the later rules
    read. Bytes are per GPU (per process in CPU mode), lengths in tokens."""

    model: ModelShape
    gpu: GpuType | None
    dtype_name: str
    kv_cache_dtype: str
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    candidates: list[int]
    gpu_memory_utilization: float | None
    budget: int
    memory_bytes: int | None
    requested_tensor_parallel_size: int | None
    concurrency: int
    block_size: int

    @property
    def blocks_per_sequence(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def needed_blocks(self) -> int:
        return self.concurrency * self.blocks_per_sequence

    @property
    def kv_dtype_bytes(self) -> int:
        return KV_CACHE_DTYPE_BYTES[self.kv_cache_dtype] or DTYPE_BYTES[self.dtype_name]


@dataclass(frozen=True)
class _Fit:
    """One replica shape's memory split, per device (bytes; the largest stage's when
    pipelined), and the KV blocks left (the smallest stage's)."""

    tensor_parallel_size: int
    weights: int
    reserve: int
    kv_per_token: int
    num_blocks: int
    pipeline_parallel_size: int = 1


def plan(
    model: ModelShape,
    *,
    gpu: GpuType | None,
    dtype: str = "auto",
    max_model_len: int | None = None,
    tensor_parallel_size: int | None = None,
    gpu_memory_utilization: float | None = None,
    memory_bytes: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    enable_chunked_prefill: bool = True,
    concurrency: int = 1,
    block_size: int | None = None,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
) -> Plan:
    """Size one replica of ``model`` on ``gpu`` (or on CPU when ``gpu`` is None).

    The rules, in order, each a function of its own: the dtype, the context length
    (:func:`_max_model_len`), the step budget (:func:`_max_num_batched_tokens`), the device's
    candidates and memory budget (:func:`_cpu_budget`, :func:`_gpu_budget`), then the memory
    split of each candidate tensor parallel size (:func:`_fit`); the first that holds
    ``concurrency`` sequences is the plan; failing all, a model too large for one node is
    pipelined (:func:`_pipelined`); else :func:`_no_fit` says why not.

    Args:
        model: the model's shape.
        gpu: the GPU type (its ``per_node`` bounds the tensor parallel size); None for CPU mode.
        dtype: ``--dtype`` value (``auto``, ``bfloat16``, ...).
        max_model_len: tokens per sequence; default the model's derived maximum.
        tensor_parallel_size: fixed by the user; default the smallest that fits.
        gpu_memory_utilization: fixed by the user; default ``default_gpu_memory_utilization``.
        memory_bytes: CPU mode only: the container's memory limit, bytes.
        max_num_seqs: sequences per step; default the engine's for the device.
        max_num_batched_tokens: tokens per step; default the engine's for the device, resolved
            by the engine's own rule (``resolve_max_num_batched_tokens``: without chunked
            prefill, at least ``max_model_len``).
        enable_chunked_prefill: whether the engine chunks long prompts.
        concurrency: sequences of ``max_model_len`` the KV cache must hold at once (>= 1).
        block_size: tokens per KV block; default the engine's for the device
            (``resolve_block_size``: 16 on a GPU, 8 on CPU).
        kv_cache_dtype: ``--kv-cache-dtype`` (a key of ``KV_CACHE_DTYPE_BYTES``).
        quantization: ``--quantization``: None for the checkpoint's own (``ModelShape.quantized_as``).

    Returns:
        The plan for the smallest tensor parallel size that fits (then the smallest pipeline
        parallel size at ``gpu.per_node``).

    Raises:
        PlanError: the model cannot be served as asked (``.reason`` says why).
        ValueError: an argument out of range (a caller's bug: spec.py validates user input).
    """
    block_size = resolve_block_size(block_size, on_gpu=gpu is not None)
    _check_arguments(
        gpu, memory_bytes, gpu_memory_utilization, concurrency, block_size, kv_cache_dtype
    )
    _check_model(model)
    model = _quantized(model, quantization)
    dtype_name = model.resolve_dtype(dtype, "cpu" if gpu is None else "cuda")
    max_len = _max_model_len(model, max_model_len)
    batched = _max_num_batched_tokens(
        max_num_batched_tokens, max_len, enable_chunked_prefill, gpu is not None
    )
    if gpu is None:
        seqs = max_num_seqs or CPU_MAX_NUM_SEQS
        candidates, utilization, budget = _cpu_budget(tensor_parallel_size, memory_bytes)
    else:
        seqs = max_num_seqs or GPU_MAX_NUM_SEQS
        candidates, utilization, budget = _gpu_budget(
            model, gpu, tensor_parallel_size, gpu_memory_utilization
        )
    ask = _Ask(
        model=model,
        gpu=gpu,
        dtype_name=dtype_name,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=max_len,
        max_num_batched_tokens=batched,
        max_num_seqs=seqs,
        candidates=candidates,
        gpu_memory_utilization=utilization,
        budget=budget,
        memory_bytes=memory_bytes,
        requested_tensor_parallel_size=tensor_parallel_size,
        concurrency=concurrency,
        block_size=block_size,
    )
    fit, tried = _smallest_tensor_parallel(ask), None
    if fit is None:
        fit, tried = _pipelined(ask)
    if fit is not None:
        return _plan(ask, fit)
    # Where a pipeline holds the weights, the KV cache is what fell short: say so of it.
    weights_fit = tried is not None and tried.weights + tried.reserve < ask.budget
    raise _no_fit(ask, tried if weights_fit else _fit(ask, ask.candidates[-1]))


def _smallest_tensor_parallel(ask: _Ask) -> _Fit | None:
    """The fit of the smallest candidate tensor parallel size that holds ``concurrency``
    sequences without pipelining (None when none does)."""
    for tp in ask.candidates:
        fit = _fit(ask, tp)
        if fit.num_blocks >= ask.needed_blocks:
            return fit
    return None


def _pipelined(ask: _Ask) -> tuple[_Fit | None, _Fit | None]:
    """The first pipelined shape of :func:`_pipeline_shapes` that fits (None when none does),
    and the shape tried with the most KV blocks (None when none was tried)."""
    best = None
    for tp, pp in _pipeline_shapes(ask):
        fit = _fit(ask, tp, pp)
        if fit.num_blocks >= ask.needed_blocks:
            return fit, fit
        if best is None or fit.num_blocks > best.num_blocks:
            best = fit
    return None, best


def _pipeline_shapes(ask: _Ask) -> Iterator[tuple[int, int]]:
    """(tensor, pipeline) parallel sizes to try, in order: those on one node (``tp * pp <=
    gpu.per_node``; fewest GPUs, then the largest ``tp``), then across nodes at the largest
    valid ``tp`` (a user-set one only when it is ``per_node``). None on CPU."""
    if ask.gpu is None:
        return
    per_node, layers = ask.gpu.per_node, ask.model.num_layers
    one_node = sorted(
        (tp * pp, -tp, pp)
        for tp in ask.candidates
        for pp in range(2, min(per_node // tp, layers) + 1)
    )
    for _, minus_tp, pp in one_node:
        yield -minus_tp, pp
    tp = max(ask.candidates)
    if ask.requested_tensor_parallel_size is not None and tp != per_node:
        return
    for pp in range(max(2, per_node // tp + 1), layers + 1):
        yield tp, pp


def _max_model_len(model: ModelShape, max_model_len: int | None) -> int:
    """The context length: the one asked, at most the model's (rope scaling included)."""
    limit = model.derived_max_model_len
    max_len = limit if max_model_len is None else max_model_len
    if max_len > limit:
        raise PlanError(
            "MaxModelLenTooLarge",
            f"maxModelLen {max_len} exceeds the model's maximum context of {limit} tokens "
            "(max_position_embeddings with its rope scaling)",
        )
    return max_len


def _max_num_batched_tokens(
    asked: int | None, max_model_len: int, enable_chunked_prefill: bool, on_gpu: bool
) -> int:
    """The step's token budget, by the engine's own rule."""
    try:
        return resolve_max_num_batched_tokens(
            asked, max_model_len, enable_chunked_prefill=enable_chunked_prefill, on_gpu=on_gpu
        )
    except ValueError as exc:
        raise PlanError("InvalidEngineLimits", f"maxNumBatchedTokens: {exc}") from exc


def _cpu_budget(tensor_parallel_size: int | None, memory_bytes: int) -> tuple[list[int], None, int]:
    """CPU mode: one process (TP 1), the memory limit less the runtime (bytes)."""
    candidates = [tensor_parallel_size or 1]
    if candidates != [1]:
        raise PlanError("InvalidTensorParallelSize", "CPU mode runs one process: TP must be 1")
    budget = memory_bytes - CPU_RUNTIME_BYTES
    if budget <= 0:
        raise PlanError(
            "ModelTooLarge",
            f"the memory limit {_gib(memory_bytes)} does not cover the engine's CPU runtime "
            f"({_gib(CPU_RUNTIME_BYTES)}) before weights and KV cache: raise it",
        )
    return candidates, None, budget


def _gpu_budget(
    model: ModelShape,
    gpu: GpuType,
    tensor_parallel_size: int | None,
    gpu_memory_utilization: float | None,
) -> tuple[list[int], float, int]:
    """GPU mode: the valid tensor parallel sizes, and ``gpu_memory_utilization`` of one GPU."""
    candidates = _tensor_parallel_candidates(model, gpu, tensor_parallel_size)
    utilization = gpu_memory_utilization or default_gpu_memory_utilization(gpu)
    if utilization <= 0:
        raise PlanError(
            "GpuTooSmall",
            f"{gpu.name} has {_gib(gpu.memory_bytes)}, no more than the "
            f"{_gib(OUTSIDE_BUDGET_HEADROOM_BYTES)} kept outside the budget for CUDA graphs and "
            "the CUDA context: choose a larger GPU, or set gpuMemoryUtilization",
        )
    return candidates, utilization, int(gpu.memory_bytes * utilization)


def _fit(ask: _Ask, tp: int, pp: int = 1) -> _Fit:
    """The memory split at tensor parallel size ``tp`` and pipeline parallel size ``pp``:
    weight shard, activations and runtime, and the whole KV blocks the rest of the budget
    holds (per stage; the largest shard and the fewest blocks decide)."""
    model, dtype_bytes = ask.model, DTYPE_BYTES[ask.dtype_name]
    reserve = activation_bytes(
        model,
        dtype_bytes=dtype_bytes,
        tensor_parallel_size=tp,
        max_num_batched_tokens=ask.max_num_batched_tokens,
        max_num_seqs=ask.max_num_seqs,
    ) + (0 if ask.gpu is None else GPU_RUNTIME_BYTES)
    stages = []
    for rank in range(pp):
        where = {"pipeline_parallel_size": pp, "pipeline_rank": rank}
        weights = model.weight_bytes(dtype_bytes, tp, **where)
        kv_per_token = model.kv_bytes_per_token(ask.kv_dtype_bytes, tp, **where)
        num_blocks = max(0, ask.budget - weights - reserve) // (kv_per_token * ask.block_size)
        stages.append((weights, kv_per_token, num_blocks))
    return _Fit(
        tp,
        max(weights for weights, _, _ in stages),
        reserve,
        max(kv for _, kv, _ in stages),
        min(blocks for _, _, blocks in stages),
        pp,
    )


def _plan(ask: _Ask, fit: _Fit) -> Plan:
    tokens = fit.num_blocks * ask.block_size
    gpus = 0 if ask.gpu is None else fit.tensor_parallel_size * fit.pipeline_parallel_size
    return Plan(
        gpu_type=CPU if ask.gpu is None else ask.gpu.name,
        dtype=ask.dtype_name,
        tensor_parallel_size=fit.tensor_parallel_size,
        gpus_per_replica=gpus,
        gpu_memory_utilization=ask.gpu_memory_utilization,
        max_model_len=ask.max_model_len,
        max_num_seqs=ask.max_num_seqs,
        max_num_batched_tokens=ask.max_num_batched_tokens,
        block_size=ask.block_size,
        num_parameters=ask.model.num_parameters(),
        weight_bytes_per_gpu=fit.weights,
        reserve_bytes_per_gpu=fit.reserve,
        kv_cache_bytes_per_gpu=tokens * fit.kv_per_token,
        kv_bytes_per_token=fit.kv_per_token,
        kv_capacity_tokens=tokens,
        max_concurrency=fit.num_blocks // ask.blocks_per_sequence,
        pipeline_parallel_size=fit.pipeline_parallel_size,
        kv_cache_dtype=ask.kv_cache_dtype,
        quantization=ask.model.quantization_method,
        num_active_parameters=ask.model.num_active_parameters(),
        nodes_per_replica=(
            1 if ask.gpu is None or gpus <= ask.gpu.per_node else fit.pipeline_parallel_size
        ),
    )


def _no_fit(ask: _Ask, fit: _Fit) -> PlanError:
    """Why ``fit`` failed (the last one-node candidate, or the pipelined shape with the most
    KV), and, when the user fixed the tensor parallel size, which shape would fit."""
    gpu, tp, budget = ask.gpu, fit.tensor_parallel_size, ask.budget
    pp = fit.pipeline_parallel_size
    stages = "" if pp == 1 else f" (pipeline parallel size {pp})"
    what = f"{ask.model.num_parameters() / 1e9:.1f}B parameters in {ask.dtype_name}"
    if ask.model.quantization is not None:
        what += f" ({ask.model.quantization.description} weights)"
    alternative = ""
    if gpu is None:
        where, per = "on CPU", "per process"
        budget_text = (
            f"{_gib(budget)} budget ({_gib(ask.memory_bytes)} memory limit less "
            f"{_gib(CPU_RUNTIME_BYTES)} runtime)"
        )
    else:
        where, per = f"on {gpu.name} x{tp}{stages}", "per GPU"
        budget_text = (
            f"{_gib(budget)} budget ({ask.gpu_memory_utilization:.2f} of {_gib(gpu.memory_bytes)})"
        )
    if gpu is not None and ask.requested_tensor_parallel_size is not None:
        where = f"at the requested tensor parallel size {tp} on {gpu.name}{stages}"
        alternative = _without_requested_tp(ask)
    if fit.weights + fit.reserve >= budget:
        exceed = (
            f"weights {_gib(fit.weights)} + activations {_gib(fit.reserve)} {per} exceed the "
            f"{budget_text}"
        )
        if gpu is None:
            message = f"{what}: {exceed}"
        elif ask.requested_tensor_parallel_size is not None:
            message = f"{what} do not fit {where}: {exceed}{alternative}"
        else:
            message = (
                f"{what}: {exceed} even at tensor parallel size {tp}, the largest valid one "
                f"with {gpu.per_node} {gpu.name} per node"
            )
        return PlanError("ModelTooLarge", message)
    tokens = fit.num_blocks * ask.block_size
    return PlanError(
        "InsufficientKVCache",
        f"after weights {_gib(fit.weights)} and activations {_gib(fit.reserve)} of the "
        f"{budget_text} {where}, the KV cache holds {tokens} tokens: fewer than "
        f"{ask.concurrency} x maxModelLen {ask.max_model_len}; a maxModelLen of at most "
        f"{tokens // ask.concurrency} fits{alternative}",
    )


def _without_requested_tp(ask: _Ask) -> str:
    """The error's hint when the user fixed the tensor parallel size: the shape the planner
    would choose without it."""
    free = replace(
        ask,
        candidates=_tensor_parallel_candidates(ask.model, ask.gpu, None),
        requested_tensor_parallel_size=None,
    )
    fit = _smallest_tensor_parallel(free) or _pipelined(free)[0]
    if fit is None:
        return f"; no tensor parallel size up to {ask.gpu.per_node} would fit either"
    tp, pp = fit.tensor_parallel_size, fit.pipeline_parallel_size
    if pp == 1:
        return f"; tensor parallel size {tp} would fit"
    return (
        f"; tensor parallel size {tp} x pipeline parallel size {pp} would fit "
        "(leave tensorParallelSize unset)"
    )


def plan_for_spec(spec: LLMDeploymentSpec, model: ModelShape, *, concurrency: int = 1) -> Plan:
    """Plan a parsed LLMDeployment spec: ``plan`` with the spec's GPU, engine and memory fields.

    To plan another shape (the autoscaler's "bigger, not more"), pass a spec changed with
    ``dataclasses.replace`` (``gpu``, ``tensor_parallel_size``).

    Raises:
        PlanError: as ``plan``; ``UnsupportedAdapters`` when ``spec.adapters`` meet a plan of
            more than one GPU (the engine's ``--enable-lora`` runs at tensor and pipeline
            parallel size 1 only, and refuses to start otherwise).
    """
    planned = plan(
        model,
        gpu=None if spec.gpu is None else spec.gpu.gpu_type(),
        dtype=spec.engine.dtype,
        max_model_len=spec.engine.max_model_len,
        tensor_parallel_size=spec.tensor_parallel_size,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        memory_bytes=spec.memory_limit_bytes if spec.gpu is None else None,
        max_num_seqs=spec.engine.max_num_seqs,
        max_num_batched_tokens=spec.engine.max_num_batched_tokens,
        enable_chunked_prefill=spec.engine.enable_chunked_prefill is not False,
        concurrency=concurrency,
        kv_cache_dtype=spec.engine.kv_cache_dtype,
        quantization=spec.engine.quantization,
    )
    if spec.adapters and planned.tensor_parallel_size * planned.pipeline_parallel_size > 1:
        raise PlanError(
            "UnsupportedAdapters",
            f"spec.adapters need one GPU a replica (the engine serves LoRA adapters at tensor "
            f"and pipeline parallel size 1 only); this model needs tensor parallel size "
            f"{planned.tensor_parallel_size} x pipeline parallel size "
            f"{planned.pipeline_parallel_size} on {planned.gpu_type}: remove the adapters or "
            "choose a GPU that holds the model alone",
        )
    return planned


def _check_arguments(
    gpu: GpuType | None,
    memory_bytes: int | None,
    gpu_memory_utilization: float | None,
    concurrency: int,
    block_size: int,
    kv_cache_dtype: str,
) -> None:
    if gpu is None and (memory_bytes is None or memory_bytes <= 0):
        raise ValueError("CPU mode needs memory_bytes (the container's memory limit)")
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if concurrency < 1 or block_size < 1:
        raise ValueError(
            f"concurrency and block_size must be >= 1, got {concurrency}, {block_size}"
        )
    if kv_cache_dtype not in KV_CACHE_DTYPE_BYTES:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; expected one of "
            f"{', '.join(KV_CACHE_DTYPE_BYTES)}"
        )


def _check_model(model: ModelShape) -> None:
    """The architecture first (a model the engine does not run is refused for that, whatever
    its quantization), then the checkpoint's quantization."""
    error = model.architecture_error()
    if error is not None:
        raise PlanError("UnsupportedArchitecture", error)
    if model.quantization_error is not None:
        named = f" ({model.quantization_method})" if model.quantization_method else ""
        raise PlanError(
            "UnsupportedQuantization",
            f"the checkpoint is quantized{named}: {model.quantization_error}",
        )


def _quantized(model: ModelShape, quantization: str | None) -> ModelShape:
    """``model`` as ``--quantization`` loads it (``ModelShape.quantized_as``), refused when
    the engine cannot load it so (``ModelShape.quantization_support_error``)."""
    try:
        model = model.quantized_as(quantization)
    except UnsupportedQuantizationError as exc:
        raise PlanError("UnsupportedQuantization", f"quantization {quantization}: {exc}") from exc
    error = model.quantization_support_error()
    if error is not None:
        raise PlanError("UnsupportedQuantization", error)
    return model


def _tensor_parallel_candidates(
    model: ModelShape, gpu: GpuType, tensor_parallel_size: int | None
) -> list[int]:
    if tensor_parallel_size is not None:
        if tensor_parallel_size > gpu.per_node:
            raise PlanError(
                "InvalidTensorParallelSize",
                f"tensorParallelSize {tensor_parallel_size} exceeds the {gpu.per_node} GPUs "
                f"per node of {gpu.name} (a replica does not span nodes)",
            )
        try:
            check_tensor_parallel_size(model, tensor_parallel_size)
        except ValueError as exc:
            raise PlanError("InvalidTensorParallelSize", str(exc)) from exc
        return [tensor_parallel_size]
    # Never empty: TP 1 always splits.
    return [tp for tp in range(1, gpu.per_node + 1) if _splits(model, tp)]


def _splits(model: ModelShape, tp: int) -> bool:
    try:
        check_tensor_parallel_size(model, tp)
    except ValueError:
        return False
    return True


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"
