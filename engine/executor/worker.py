"""One rank: its shard of its pipeline stage's layers, their share of the KV cache, its sampler.

A worker is what an executor drives: the in-process executor holds one, the multiprocessing
and Ray executors one per process. Every rank runs the same step through its shard (sent as a
:class:`~kvpilot.engine.executor.worker_input.WorkerInput`, the diff against what it holds);
stages after the first start from the previous stage's activations. On the last stage the
logits are gathered on every rank, so every rank there samples the same tokens from the same
logits and the driver reads them from that stage's first rank (``output_rank``).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

import torch

from kvpilot.engine.attention.layer import enable_kv_scale_calculation
from kvpilot.engine.distributed import get_pp_state, init_distributed_environment
from kvpilot.engine.executor.cpu_allocator import release_free_memory, tune_for_cpu_engine
from kvpilot.engine.executor.worker_input import CachedRequestStates, WorkerInput
from kvpilot.engine.layers.linear import prepack_linear_weights
from kvpilot.engine.model_loader import load_model
from kvpilot.engine.model_runner import ModelRunner, ModelRunnerOutput
from kvpilot.engine.sampler import Sampler
from kvpilot.engine.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class WorkerConfig:
    """What every rank needs to build its part of the engine (picklable: sent to processes).

    Attributes:
        model_dir: a resolved model folder (config.json, safetensors).
        dtype: parameter, activation and KV cache dtype.
        device: ``cpu``, or ``cuda`` (rank ``r`` then uses ``cuda:r``).
        attention_backend: ``"torch"`` or ``"triton"`` (attention, and the norm, rotary and
            activation layers).
        block_size: tokens per KV cache block.
        seed: the sampler seed for requests without their own.
        eos_token_ids: token ids that end generation (masked before ``min_tokens``).
        tensor_parallel_size: ranks each pipeline stage is sharded over.
        pipeline_parallel_size: stages the layers are split into (world size
            ``tensor_parallel_size * pipeline_parallel_size``).
        enable_expert_parallel: MoE layers place whole experts on ranks rather than a slice
            of every expert on each.
        distributed_timeout_s: seconds a collective, or a stage's receive, waits for the other
            ranks before failing; the executors give a step this long plus a margin before
            declaring a silent rank dead.
        num_threads: torch CPU threads of each rank; None keeps torch's default.
        max_model_len: the longest sequence served, tokens (LongRoPE and dynamic-NTK models pick
            their rotary frequencies by it); None for the model's ``max_position_embeddings``.
        model_config: the folder's transformers config as the engine read it (None: each rank
            reads ``config.json`` itself).
        model_shape: its shape, for the tensor-parallel checks (None: read from the folder).
        quantization: ``--quantization`` (None: the checkpoint's own ``quantization_config``).
        load_format: ``--load-format`` (``dummy``: random weights, see ``load_model``).
        kv_cache_dtype: the paged cache's dtype (``resolve_kv_cache_dtype``); None for
            ``dtype``.
        calculate_kv_scales: set each layer's fp8 k/v scales from the first step after
            ``initialize_cache`` (``--calculate-kv-scales``).
    """

    model_dir: pathlib.Path
    dtype: torch.dtype
    device: torch.device
    attention_backend: str
    block_size: int
    seed: int
    eos_token_ids: frozenset[int]
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    pipeline_parallel_size: int = 1
    distributed_timeout_s: float = 600.0
    num_threads: int | None = None
    max_model_len: int | None = None
    model_config: Any = None
    model_shape: Any = None
    quantization: str | None = None
    load_format: str = "auto"
    kv_cache_dtype: torch.dtype | None = None
    calculate_kv_scales: bool = False

    @property
    def world_size(self) -> int:
        """All ranks: ``tensor_parallel_size * pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The global rank whose sampled tokens the driver reads: the last stage's first."""
        return self.world_size - self.tensor_parallel_size

    def device_of_rank(self, local_rank: int) -> torch.device:
        """The device a rank computes on: ``cuda:local_rank`` on GPUs, else the CPU."""
        if self.device.type == "cuda":
            return torch.device("cuda", local_rank)
        return self.device


class Worker:
    """Builds and runs one rank's model shard.

    Args:
        config: the engine's worker settings.
        rank: this worker's global rank (``pp_rank * tensor_parallel_size + tp_rank``).
        distributed_init_method: rendezvous address of the group (``tcp://host:port``);
            None for a single rank.
        local_rank: index of its GPU among the devices this process sees (default ``rank``:
            one node, every GPU visible; a Ray actor sees only its own, index 0).

    Raises:
        ValueError: from model loading (unsupported architecture, weights that do not fit).
    """

    def __init__(
        self,
        config: WorkerConfig,
        rank: int = 0,
        distributed_init_method: str | None = None,
        local_rank: int | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.device = config.device_of_rank(rank if local_rank is None else local_rank)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cpu":
            tune_for_cpu_engine()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if config.world_size > 1:
            init_distributed_environment(
                rank,
                config.tensor_parallel_size,
                distributed_init_method,
                self.device,
                config.distributed_timeout_s,
                enable_expert_parallel=config.enable_expert_parallel,
                pipeline_parallel_size=config.pipeline_parallel_size,
            )
        self.model = load_model(
            config.model_dir,
            config.dtype,
            self.device,
            attention_backend=config.attention_backend,
            max_model_len=config.max_model_len,
            config=config.model_config,
            quantization=config.quantization,
            load_format=config.load_format,
        )
        self._weight_bytes = sum(p.nbytes for p in self.model.parameters())
        if prepack_linear_weights(self.model):  # only CPU weights are packed
            # The dense weights freed for their packed copies, in the heap glibc now keeps.
            release_free_memory()
        self.sampler = Sampler(config.seed, self.device, set(config.eos_token_ids))
        self.model_runner: ModelRunner | None = None
        self.requests = CachedRequestStates()

    def stage(self) -> tuple[int, int, int]:
        """This rank's pipeline stage and its layers: ``(pp_rank, start_layer, end_layer)``."""
        return get_pp_state().rank, self.model.model.start_layer, self.model.model.end_layer

    def weight_bytes(self) -> int:
        """Bytes of this rank's parameters (a tied table counted once)."""
        return self._weight_bytes

    def kv_cache_bytes(self) -> int:
        """Bytes of this rank's KV cache (0 before ``initialize_cache``)."""
        if self.model_runner is None:
            return 0
        # Layers' K and V may be views of one allocation: count each storage once.
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for pair in self.model_runner.kv_caches
            for t in pair
        }
        return sum(storages.values())

    def profile_peak_memory(self, num_tokens: int, max_model_len: int) -> int:
        """Peak GPU memory (bytes) of a ``num_tokens`` forward pass on this rank
        (see ``ModelRunner.profile_peak_memory``)."""
        runner = ModelRunner(
            self.model,
            1,
            self.config.block_size,
            self.device,
            Sampler(0, self.device, set()),
            self.config.kv_cache_dtype,
        )
        return runner.profile_peak_memory(num_tokens, max_model_len)

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate this rank's KV cache: ``num_blocks`` blocks of its KV heads only, in
        ``kv_cache_dtype``; with ``calculate_kv_scales`` (after the profiling pass, which must
        not set them) the next step sets the fp8 scales."""
        self.model_runner = ModelRunner(
            self.model,
            num_blocks,
            self.config.block_size,
            self.device,
            self.sampler,
            self.config.kv_cache_dtype,
        )
        if self.device.type == "cpu":
            # Before the fp8 scales are armed: made-up tokens must not set them.
            self.model_runner.warm_up()
        if self.config.calculate_kv_scales:
            enable_kv_scale_calculation(self.model)

    def execute_step(self, message: WorkerInput) -> ModelRunnerOutput:
        """Apply a step's deltas to the requests this worker holds, then run it
        (:meth:`execute_model`).

        Raises:
            KeyError: a delta for a request this worker never got whole.
            RuntimeError: ``initialize_cache`` was not called.
        """
        return self.execute_model(self.requests.apply(message))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; an empty step only forgets the finished requests' sampler state.

        Raises:
            RuntimeError: ``initialize_cache`` was not called.
        """
        if scheduler_output.is_empty:
            self.sampler.remove_requests(scheduler_output.finished_request_ids)
            return ModelRunnerOutput({}, {})
        if self.model_runner is None:
            raise RuntimeError("execute_model before initialize_cache: the KV cache is missing")
        return self.model_runner.execute_model(scheduler_output)
