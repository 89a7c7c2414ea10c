"""The engine: requests in, one scheduled forward pass per ``step()``, outputs out (vLLM's LLMEngine)."""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import os
import pathlib
import time
from collections.abc import Iterable

import torch
from tqdm.auto import tqdm

from kvpilot.engine.config import (
    CPU_DEFAULT_KV_CACHE_MEMORY,
    CPU_MAX_NUM_SEQS,
    GPU_MAX_NUM_SEQS,
    CacheConfig,
    EngineArgs,
    SchedulerConfig,
    kv_cache_dtype_bytes,
    resolve_block_size,
    resolve_max_num_batched_tokens,
)
from kvpilot.engine.detokenizer import IncrementalDetokenizer
from kvpilot.engine.distributed.pipeline import check_pipeline_parallel_size, max_stage_layers
from kvpilot.engine.executor import WorkerConfig, create_executor
from kvpilot.engine.input_processor import InputProcessor, PromptType, sequence_ids
from kvpilot.engine.kv_cache_manager import KVCacheManager
from kvpilot.engine.kv_events import KVEventBatch
from kvpilot.engine.lora.request import LoRARequest, parse_lora_modules
from kvpilot.engine.model_shape import ModelShape, check_tensor_parallel_size
from kvpilot.engine.output_processor import OutputProcessor, ParentRequestState, SequenceState
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.request import Request, RequestStatus
from kvpilot.engine.sampling_params import SamplingParams, StructuredOutputsParams, is_int
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.scheduler_output import RequestDelta, SchedulerOutput
from kvpilot.engine.spec_decode import proposers
from kvpilot.engine.stats import EngineStats
from kvpilot.engine.structured_output import StructuredOutputManager
from kvpilot.engine.thinking_budget import ThinkingBudgetTracker

logger = logging.getLogger("kvpilot.engine")


class LLMEngine:
    """Continuous-batching inference over a paged KV cache.

    Build with ``LLMEngine.from_engine_args(EngineArgs(...))``. Then ``add_request`` any time,
    call ``step()`` repeatedly while ``has_unfinished_requests()``; each step schedules one
    mixed prefill/decode batch, runs it, and returns the outputs of the requests that advanced.

    Args:
        args: validated engine arguments.
        show_progress: draw a progress bar while loading.

    Raises:
        FileNotFoundError: the model path or id does not exist.
        ValueError: an unsupported architecture, or arguments the model cannot honour (e.g.
            ``max_model_len`` above the model's ``max_position_embeddings`` as a linear, dynamic
            or YaRN ``rope_scaling`` factor stretches it, a KV budget below one block).
    """

    def __init__(self, args: EngineArgs, show_progress: bool = False) -> None:
        from kvpilot.engine.model_loader import (
            DEFAULT_MODEL_NAME,
            get_eos_token_ids,
            load_tokenizer,
            read_model_config,
            read_sampling_defaults,
            resolve_dtype,
            resolve_kv_cache_dtype,
            resolve_model,
        )
        from kvpilot.engine.model_loader.generation_config import (
            GENERATION_CONFIG_CHOICES,
            MAX_NEW_TOKENS,
        )

        args.validate()
        self.args = args
        self._stats_snapshots = itertools.count(1)  # EngineStats.snapshot
        # What the arguments decide without loading weights is checked first, before the
        # progress bar starts: a bad argument is one line of error, with no bar before it.
        self.model_dir = resolve_model(
            args.model,
            args.revision,
            args.download_dir,
            weights=args.load_format != "dummy",
            token=args.hf_token,
            ignore_patterns=args.ignore_patterns,
        )
        # config.json is read once (with --hf-overrides): the shape for sizing, the
        # transformers config for the dtype and the model classes (handed to the workers).
        config_dict, self.model_config = read_model_config(self.model_dir, args.hf_overrides)
        self.model_shape = ModelShape.from_hf_config(config_dict)
        # The planner's divisor rule, checked before anything is loaded.
        check_tensor_parallel_size(self.model_shape, args.tensor_parallel_size)
        check_pipeline_parallel_size(self.model_shape, args.pipeline_parallel_size)
        self.device = _resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device, self.model_config)
        self.block_size = resolve_block_size(args.block_size, on_gpu=self.device.type == "cuda")
        self.scheduler_config = self._scheduler_config()
        backend = args.attention_backend or ("triton" if self.device.type == "cuda" else "torch")
        if (
            backend == "triton"
            and self.device.type != "cuda"
            and os.environ.get("TRITON_INTERPRET") != "1"
        ):
            raise ValueError(
                "--attention-backend triton needs a CUDA device (on the CPU the Triton "
                "kernels run only under the interpreter, TRITON_INTERPRET=1); use torch"
            )
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            args.kv_cache_dtype, self.dtype, self.device, backend
        )
        self.default_sampling = read_sampling_defaults(
            self.model_dir, args.generation_config, args.override_generation_config
        )
        try:
            self.get_default_sampling_params()
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"generation config ({args.generation_config}) with its overrides: {exc}"
            ) from None
        # vLLM's cap on every served request's output: the overrides' max_new_tokens, or a
        # generation config folder's.
        self.override_max_tokens = (
            (args.override_generation_config or {}).get(MAX_NEW_TOKENS)
            if args.generation_config in GENERATION_CONFIG_CHOICES
            else self.default_sampling.get("max_tokens")
        )
        load_own_tokenizer = functools.partial(
            load_tokenizer,
            args.tokenizer or self.model_dir,
            revision=args.tokenizer_revision if args.tokenizer else None,
            token=args.hf_token,
        )
        self.tokenizer = load_own_tokenizer()
        self.eos_token_ids = frozenset(get_eos_token_ids(self.model_dir))
        # Its own tokenizer, loaded on the first constrained request.
        self.structured_output_manager = StructuredOutputManager(
            load_own_tokenizer,
            self.model_shape.vocab_size,
            self.eos_token_ids,
        )
        # The think markers of thinking_token_budget (None: requests with a budget are refused).
        thinking_token_ids = (
            args.reasoning_config.thinking_token_ids(self.tokenizer)
            if args.reasoning_config is not None
            else None
        )
        self.thinking_budget = (
            ThinkingBudgetTracker(thinking_token_ids) if thinking_token_ids is not None else None
        )
        self.speculative_config = args.speculative_config
        self.draft_dir = (
            proposers.resolve_draft_model(
                self.speculative_config, self.model_dir, args.tensor_parallel_size
            )
            if self.speculative_config is not None
            else None
        )
        # On the CPU the KV budget is arithmetic (on a GPU it needs the profiled peak).
        on_cpu_cache = None if self.device.type == "cuda" else self._cache_config()
        progress = tqdm(total=2, desc="Loading", disable=not show_progress, unit="stage")
        with progress:
            progress.set_postfix_str("weights")
            # One rank in this process, or one worker process (or Ray actor) per rank.
            self.executor = create_executor(
                WorkerConfig(
                    model_dir=self.model_dir,
                    dtype=self.dtype,
                    device=self.device,
                    attention_backend=backend,
                    block_size=self.block_size,
                    seed=args.seed,
                    eos_token_ids=self.eos_token_ids,
                    tensor_parallel_size=args.tensor_parallel_size,
                    enable_expert_parallel=args.enable_expert_parallel,
                    pipeline_parallel_size=args.pipeline_parallel_size,
                    distributed_timeout_s=float(args.distributed_timeout_seconds),
                    max_model_len=self.scheduler_config.max_model_len,
                    model_config=self.model_config,
                    model_shape=self.model_shape,
                    quantization=args.quantization,
                    load_format=args.load_format,
                    kv_cache_dtype=self.kv_cache_dtype,
                    calculate_kv_scales=args.calculate_kv_scales,
                ),
                args.distributed_executor_backend,
            )
            progress.update()
            progress.set_postfix_str("KV cache")
            self.cache_config = on_cpu_cache or self._cache_config()
            self.executor.initialize_cache(self.cache_config.num_blocks)
            # In-process runner (None under tensor parallelism: each rank's is in its process).
            self.model_runner = getattr(self.executor, "model_runner", None)
            # Before the LoRA manager, which asks it which adapters unfinished requests use.
            self.output_processor = OutputProcessor(self.tokenizer)
            self.lora_manager = self._lora_manager()
            self.proposer = (
                proposers.build_proposer(
                    self.speculative_config,
                    self.draft_dir,
                    self.dtype,
                    self.device,
                    backend,
                    self.cache_config.num_blocks,
                    self.block_size,
                    self.kv_cache_dtype,
                    args.calculate_kv_scales,
                )
                if self.speculative_config is not None
                else None
            )
            progress.update()
        self.served_model_name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
        self.kv_cache_manager = KVCacheManager(
            self.cache_config.num_blocks,
            self.block_size,
            args.enable_prefix_caching,
            root_hash=_model_identity_hash(self.model_dir, args.revision, self.dtype),
        )
        self.scheduler = Scheduler(
            self.scheduler_config,
            self.kv_cache_manager,
            num_lookahead_tokens=proposers.num_lookahead_tokens(self.speculative_config),
            policy=args.scheduling_policy,
        )
        capacity = self.cache_config.capacity_tokens
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.model_shape.vocab_size,
            self.scheduler_config.max_model_len,
            capacity,
            thinking_budget=self.thinking_budget is not None,
        )
        logger.info(
            "KV cache size: %d tokens (%d blocks of %d)",
            capacity,
            self.cache_config.num_blocks,
            self.block_size,
        )
        logger.info(
            "KV cache dtype: %s (kv_cache_dtype %s), %d bytes per token",
            str(self.kv_cache_dtype).removeprefix("torch."),
            args.kv_cache_dtype,
            self.cache_config.bytes_per_token,
        )
        logger.info(
            "Maximum concurrency for %d tokens per request: %.2fx",
            self.scheduler_config.max_model_len,
            capacity / self.scheduler_config.max_model_len,
        )
        if capacity < self.scheduler_config.max_model_len:
            logger.warning(
                "the KV cache (%d tokens) is smaller than max_model_len (%d): requests are "
                "limited to the cache size",
                capacity,
                self.scheduler_config.max_model_len,
            )

    @classmethod
    def from_engine_args(cls, args: EngineArgs, show_progress: bool = False) -> LLMEngine:
        """Build an engine (loads the model and allocates the KV cache)."""
        return cls(args, show_progress=show_progress)

    def _lora_manager(self):
        """The model's LoRA slots with the ``lora_modules`` registered, or None without LoRA.

        LoRA runs on one rank, in this process (``EngineArgs`` refuses it with tensor
        parallelism): the in-process model runner's model gets wrapped.
        """
        if not self.args.enable_lora:
            return None
        from kvpilot.engine.lora.manager import LoRAManager

        runner = self.model_runner
        args = self.args
        manager = LoRAManager(
            runner.model,
            args.max_loras,
            args.max_lora_rank,
            max_cpu_loras=args.max_cpu_loras,
            # --lora-dtype auto: the model's dtype.
            lora_dtype=None if args.lora_dtype == "auto" else getattr(torch, args.lora_dtype),
            in_use=self.output_processor.lora_names_in_use,
        )
        for lora_id, module in enumerate(parse_lora_modules(self.args.lora_modules), start=1):
            manager.add_adapter(LoRARequest(module.name, lora_id, module.path))
        runner.lora_manager = manager
        return manager

    def _scheduler_config(self) -> SchedulerConfig:
        args = self.args
        # vLLM's derived max_model_len: max_position_embeddings, stretched by a linear, dynamic
        # or YaRN rope_scaling factor (the planner sizes pods with the same number).
        shape = self.model_shape
        model_max = shape.derived_max_model_len
        max_model_len = args.max_model_len or model_max
        if max_model_len > model_max:
            stretched = (
                f"; max_position_embeddings {shape.max_position_embeddings} stretched by the "
                "rope_scaling factor"
                if model_max != shape.max_position_embeddings
                else ""
            )
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"({model_max}{stretched})"
            )
        on_gpu = self.device.type == "cuda"
        max_num_batched_tokens = resolve_max_num_batched_tokens(
            args.max_num_batched_tokens,
            max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            on_gpu=on_gpu,
        )
        return SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=args.max_num_seqs or (GPU_MAX_NUM_SEQS if on_gpu else CPU_MAX_NUM_SEQS),
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=args.enable_chunked_prefill,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            max_loras=args.max_loras if args.enable_lora else 0,
        )

    def _cache_config(self) -> CacheConfig:
        args = self.args
        sched = self.scheduler_config
        # Per rank: each holds only its KV heads (all of them on a single rank) of its stage's
        # layers, the largest stage counted; a draft model's cache shares the blocks (tensor
        # and pipeline parallelism are refused with one). The planner's rule for the KV dtype
        # (engine/config.py), which the cache's torch dtype agrees with.
        itemsize = kv_cache_dtype_bytes(args.kv_cache_dtype, self.dtype.itemsize)
        bytes_per_token = self.model_shape.kv_bytes_per_token(
            itemsize, args.tensor_parallel_size
        ) * max_stage_layers(
            self.model_shape.num_layers, args.pipeline_parallel_size
        ) // self.model_shape.num_layers + proposers.draft_kv_bytes_per_token(
            self.draft_dir, itemsize
        )
        block_bytes = bytes_per_token * self.block_size
        if args.kv_cache_memory is not None:
            budget = args.kv_cache_memory
            source = f"kv_cache_memory {budget} bytes"
        elif self.device.type == "cuda":
            peak = self.executor.profile_peak_memory(
                sched.max_num_batched_tokens, sched.max_model_len
            )
            total = torch.cuda.mem_get_info(self.device)[1]
            budget = int(total * args.gpu_memory_utilization) - peak
            source = f"gpu_memory_utilization {args.gpu_memory_utilization} of {total} bytes minus a {peak}-byte profiled peak"
        else:
            budget = min(
                CPU_DEFAULT_KV_CACHE_MEMORY,
                sched.max_num_seqs * sched.max_model_len * bytes_per_token,
            )
            source = f"default CPU budget {budget} bytes"
        num_blocks = budget // block_bytes
        if args.num_gpu_blocks_override is not None:
            num_blocks = args.num_gpu_blocks_override
            source = f"num_gpu_blocks_override {num_blocks}"
        if num_blocks < 1:
            raise ValueError(
                f"no room for a single KV block ({block_bytes} bytes) with {source}; raise "
                "kv_cache_memory / gpu_memory_utilization"
            )
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=num_blocks,
            bytes_per_token=bytes_per_token,
            enable_prefix_caching=args.enable_prefix_caching,
            cache_dtype=args.kv_cache_dtype,
        )

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request; it joins the batch at the next ``step()``.

        Args:
            request_id: unique among unfinished requests.
            prompt: text, ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}``; a dict may
                carry vLLM's ``"cache_salt"`` key instead of the ``cache_salt`` argument.
            params: sampling parameters (default ``get_default_sampling_params()``); ``n > 1`` fans out
                into ``n`` sequences, sequence ``i`` seeded with ``seed + i``.
            arrival_time: ``time.time()`` of arrival (default now).
            cache_salt: requests with different salts never share prefix-cache blocks; a
                non-empty string, or None for no salt.
            lora_request: the LoRA adapter to apply (registered now if its name is new), or
                None for the base model. Needs ``enable_lora``.
            priority: with ``scheduling_policy="priority"``, lower values are served first
                (vLLM's); must be 0 under ``fcfs``.

        ``params.structured_outputs`` is compiled here unless ``compile_grammar`` already did
        (xgrammar's cache); a server compiles it first, on a worker thread.

        Raises:
            ValueError: naming the problem: a duplicate id, an empty prompt, an unknown prompt
                dict key, an empty ``cache_salt`` or one given twice, a prompt longer than
                ``max_model_len`` or than the whole KV cache, token ids outside the vocabulary,
                ``logprobs`` or ``prompt_logprobs`` above the vocabulary size, a non-integer
                ``priority`` or a non-zero one under ``fcfs``, an invalid
                ``structured_outputs`` constraint, an adapter without ``enable_lora`` or that
                cannot be loaded (``LoRAAdapterError``; ``LoRAAdapterGoneError`` for a
                registered one whose files are gone), a ``thinking_token_budget`` without a
                reasoning config (``reasoning_parser`` / ``reasoning_config``). Nothing else is
                touched, but an adapter whose files are gone is unregistered.

        A sequence with a ``thinking_token_budget`` has the end of its think block forced once
        the budget is spent (``thinking_budget.py``); not one constrained by
        ``structured_outputs``, which is the answer from its first token here.
        """
        params = params if params is not None else self.get_default_sampling_params()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if not is_int(priority):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.scheduler.policy != "priority":
            raise ValueError(
                f"priority {priority} needs the priority scheduling policy "
                "(--scheduling-policy priority); this engine schedules fcfs"
            )
        prompt_in = self.input_processor.process(prompt, params, cache_salt)
        ids = sequence_ids(request_id, params.n)
        taken = [i for i in [request_id, *ids] if self.output_processor.is_taken(i)]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        grammar = (
            None
            if params.structured_outputs is None
            else self.structured_output_manager.compile(params.structured_outputs)
        )
        lora_digest = self._lora_digest(lora_request)
        arrival_time = time.time() if arrival_time is None else arrival_time
        parent = ParentRequestState(
            request_id,
            prompt_in.text,
            prompt_in.token_ids,
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
        )
        for index, seq_id in enumerate(ids):
            request = Request(
                request_id=seq_id,
                prompt_token_ids=prompt_in.token_ids,
                sampling_params=params,
                eos_token_ids=self.eos_token_ids,
                max_tokens=prompt_in.max_tokens,
                arrival_time=arrival_time,
                cache_salt=prompt_in.cache_salt,
                lora_request=lora_request,
                lora_digest=lora_digest,
                seed=None if params.seed is None else params.seed + index,
                # The sequences share the prompt: the first one scores it.
                num_prompt_logprobs=params.prompt_logprobs if index == 0 else None,
                priority=priority,
            )
            parent.sequences.append(
                SequenceState(
                    parent_id=request_id,
                    index=index,
                    request=request,
                    detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_in.token_ids, params),
                    logprobs=None if params.logprobs is None else [],
                    cumulative_logprob=None if params.logprobs is None else 0.0,
                )
            )
        self.output_processor.add_request(parent)
        for seq in parent.sequences:
            if grammar is not None:
                self.structured_output_manager.add_request(seq.request.request_id, grammar)
            elif params.thinking_token_budget is not None:
                # A constrained output is the answer from its first token (no think block).
                self.thinking_budget.add_request(seq.request.request_id)
            self.scheduler.add_request(seq.request)

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's recommended sampling (``generation_config``;
        vLLM's ``get_default_sampling_params``)."""
        return SamplingParams(**self.default_sampling)

    def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compile a structured-output constraint into xgrammar's cache, where ``add_request``
        finds it. Thread-safe: the one engine method meant to be called off the engine thread.

        Raises:
            ValueError: ``structured_outputs: ...`` naming what is invalid.
        """
        self.structured_output_manager.compile(params)

    def _lora_digest(self, lora_request: LoRARequest | None) -> str | None:
        """Register the request's adapter (if new) and return its weight digest."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be a LoRARequest, got {type(lora_request).__name__}"
            )
        return self._require_lora().add_adapter(lora_request).digest

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register a LoRA adapter (read and checked now); True once it is registered.

        Raises:
            ValueError: LoRA is not enabled, or the adapter cannot be loaded
                (``LoRAAdapterError``: unreadable folder, unsupported PEFT feature, rank above
                ``max_lora_rank``, another base model, a name registered with another path).
        """
        self._require_lora().add_adapter(lora_request)
        return True

    def remove_lora(self, lora_name: str) -> bool:
        """Unregister an adapter and free its slot; False when it was not registered.

        Raises:
            ValueError: LoRA is not enabled, or unfinished requests use the adapter
                (``LoRAInUseError``).
        """
        in_use = self.output_processor.lora_names_in_use()
        return self._require_lora().remove_adapter(lora_name, in_use)

    def list_loras(self) -> list[LoRARequest]:
        """The registered adapters, in registration order (empty without LoRA)."""
        return [] if self.lora_manager is None else list(self.lora_manager.requests.values())

    def _require_lora(self):
        if self.lora_manager is None:
            raise ValueError(
                "LoRA adapters are not enabled on this engine; start it with enable_lora=True "
                "(--enable-lora)"
            )
        return self.lora_manager

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Finish requests with ``finish_reason`` "abort" and free their blocks now.

        Unknown or finished ids are ignored. No output is emitted for them.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            seq_ids = self.output_processor.abort_request(request_id)
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
            self._forget(seq_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash (vLLM's ``reset_prefix_cache``), e.g. between
        benchmark runs; refused (False) while requests hold blocks."""
        return self.kv_cache_manager.block_pool.reset_prefix_cache()

    def get_kv_events(self, since: int) -> KVEventBatch:
        """The prefix cache's KV events numbered ``since`` and later (``kv_events.py``); none,
        and never truncated, when prefix caching is off. Call it on the engine's thread."""
        log = self.kv_cache_manager.block_pool.kv_events
        return KVEventBatch(0, [], False) if log is None else log.since(since)

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one batch.

        Returns:
            One ``RequestOutput`` per request that got new tokens or finished in this step.
        """
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if scheduler_output.finished_request_ids:
                # Lets the workers forget the finished requests' sampler state.
                self.executor.execute_model(scheduler_output)
            return []
        self.structured_output_manager.set_grammar_bitmask(scheduler_output)
        if self.thinking_budget is not None:
            self.thinking_budget.set_forced_tokens(scheduler_output)
        runner_output = self.executor.execute_model(scheduler_output)
        self.output_processor.add_prompt_logprobs(
            scheduler_output.scheduled, runner_output.prompt_logprobs
        )
        deltas = self.scheduler.update_from_output(
            scheduler_output, runner_output.sampled_token_ids
        )
        self._advance_grammars(deltas)
        for match in self.output_processor.detokenize(deltas, runner_output.logprobs):
            self.scheduler.stop_request(match.request, match.num_output_tokens, match.stop_reason)
        self._propose(scheduler_output, deltas)
        outputs, finished = self.output_processor.make_outputs(deltas)
        self._forget(finished)
        return outputs

    def _forget(self, seq_ids: list[str]) -> None:
        """Drop the per-sequence state of finished or aborted sequences (grammars, thinking
        budgets)."""
        self.structured_output_manager.remove_requests(seq_ids)
        if self.thinking_budget is not None:
            self.thinking_budget.remove_requests(seq_ids)

    def _advance_grammars(self, deltas: list[RequestDelta]) -> None:
        """Move the constrained sequences' grammars over their new tokens; one whose grammar
        is complete (its end token taken under ``ignore_eos``) or stuck stops."""
        for delta in deltas:
            request = delta.request
            accepted = self.structured_output_manager.accept_tokens(
                request.request_id, delta.new_token_ids
            )
            if not accepted and not request.is_finished:
                self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _propose(self, scheduler_output: SchedulerOutput, deltas: list[RequestDelta]) -> None:
        """Draft the next tokens of the unfinished sequences that sampled (speculative
        decoding); constrained ones are not speculated: drafts would need their grammar too."""
        if self.proposer is None:
            return
        self.proposer.propose(
            scheduler_output,
            [
                d.request
                for d in deltas
                if not d.request.is_finished
                and not self.structured_output_manager.has_request(d.request.request_id)
            ],
        )

    def get_stats(self) -> EngineStats:
        """A snapshot of gauges and counters (see ``EngineStats``)."""
        capacity = self.cache_config.capacity_tokens
        return EngineStats(
            **vars(self.scheduler.make_stats()),
            kv_capacity_tokens=capacity,
            max_concurrency=capacity / self.scheduler_config.max_model_len,
            prompt_tokens_total=self.output_processor.prompt_tokens_total,
            generation_tokens_total=self.output_processor.generation_tokens_total,
            max_lora=self.scheduler_config.max_loras,
            spec_decode=self.scheduler.spec_decoding_stats.snapshot() if self.proposer else None,
            snapshot=next(self._stats_snapshots),
        )

    def check_health(self) -> None:
        """Return when the engine can run steps (every tensor-parallel worker alive).

        Raises:
            EngineDeadError: a worker died or failed; the message names the rank and cause.
        """
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do on one rank); idempotent."""
        self.executor.shutdown()

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer."""
        return self.tokenizer


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    return torch.device(device)


def _model_identity_hash(
    model_dir: pathlib.Path, revision: str | None, dtype: torch.dtype
) -> bytes:
    """Root of every block-hash chain: the model's folder, revision and dtype, so that cached
    blocks never match another model's, should hashes ever be shared between engines."""
    identity = f"{model_dir.resolve()}\0{revision or ''}\0{dtype}"
    return hashlib.sha256(identity.encode()).digest()
