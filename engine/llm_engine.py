"""The engine: requests in, one scheduled forward pass per ``step()``, outputs out (vLLM's LLMEngine)."""

from __future__ import annotations

import functools
import hashlib
import logging
import pathlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from kvpilot.engine.config import (
    CPU_DEFAULT_KV_CACHE_MEMORY,
    CPU_MAX_NUM_SEQS,
    GPU_MAX_NUM_SEQS,
    CacheConfig,
    EngineArgs,
    SchedulerConfig,
    resolve_max_num_batched_tokens,
)
from kvpilot.engine.detokenizer import IncrementalDetokenizer
from kvpilot.engine.executor import WorkerConfig, create_executor
from kvpilot.engine.kv_cache_manager import KVCacheManager
from kvpilot.engine.logits_processors import TokenLogprobs
from kvpilot.engine.lora.request import LoRARequest, parse_lora_modules
from kvpilot.engine.model_shape import ModelShape, check_tensor_parallel_size
from kvpilot.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvpilot.engine.request import Request, RequestStatus
from kvpilot.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.scheduler_output import ScheduledRequest
from kvpilot.engine.spec_decode import proposers
from kvpilot.engine.stats import EngineStats
from kvpilot.engine.structured_output import StructuredOutputManager
from kvpilot.engine.tokenization import encode_text

logger = logging.getLogger("kvpilot.engine")

PromptType = str | dict
# vLLM's prompt dict: one of the first two keys, optionally a salt for the prefix cache.
PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def check_cache_salt(cache_salt: object) -> None:
    """Refuse a prefix-cache salt vLLM refuses: anything but a non-empty string (None: no salt).

    Raises:
        ValueError: ``cache_salt: must be a non-empty string if provided, ...``.
    """
    if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
        raise ValueError(f"cache_salt: must be a non-empty string if provided, got {cache_salt!r}")


@dataclass
class _Sequence:
    """Engine-side state of one output sequence: its request, text and logprobs."""

    parent_id: str
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    def to_output(self) -> CompletionOutput:
        request = self.request
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.get_text(finished=request.is_finished),
            token_ids=list(request.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )


@dataclass
class _ParentRequest:
    """A user request: its ``n`` sequences share the prompt (and, cached, its blocks).

    ``prompt_logprobs`` (when asked) grows chunk by chunk as the first sequence's prefill
    scores the prompt: ``[None]`` for the first token, then one dict per scored token.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.sequences)

    @property
    def prompt_logprobs_ready(self) -> bool:
        """Whether the prompt logprobs, if asked, cover every prompt token."""
        return self.prompt_logprobs is None or len(self.prompt_logprobs) == len(
            self.prompt_token_ids
        )

    def to_output(self) -> RequestOutput:
        first = self.sequences[0].request
        times = first.times
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.to_output() for s in self.sequences],
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics=RequestMetrics(**vars(times)),
        )


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
            ``max_model_len`` above the model's ``max_position_embeddings``, a KV budget below
            one block).
    """

    def __init__(self, args: EngineArgs, show_progress: bool = False) -> None:
        from kvpilot.engine.model_loader import (
            DEFAULT_MODEL_NAME,
            get_eos_token_ids,
            load_tokenizer,
            read_model_config,
            resolve_dtype,
            resolve_model,
        )

        args.validate()
        self.args = args
        progress = tqdm(total=4, desc="Loading", disable=not show_progress, unit="stage")
        with progress:
            progress.set_postfix_str("resolving model")
            self.model_dir = resolve_model(args.model, args.revision)
            # config.json is read once: the shape for sizing, the transformers config for the
            # dtype and the model classes (handed to the workers).
            config_dict, self.model_config = read_model_config(self.model_dir)
            self.model_shape = ModelShape.from_hf_config(config_dict)
            # The planner's divisor rule, checked before anything is loaded.
            check_tensor_parallel_size(self.model_shape, args.tensor_parallel_size)
            progress.update()
            progress.set_postfix_str("tokenizer")
            self.tokenizer = load_tokenizer(args.tokenizer or self.model_dir)
            self.eos_token_ids = frozenset(get_eos_token_ids(self.model_dir))
            # Its own tokenizer, loaded on the first constrained request.
            self.structured_output_manager = StructuredOutputManager(
                functools.partial(load_tokenizer, args.tokenizer or self.model_dir),
                self.model_shape.vocab_size,
                self.eos_token_ids,
            )
            self.speculative_config = args.speculative_config
            self.draft_dir = (
                proposers.resolve_draft_model(
                    self.speculative_config, self.model_dir, args.tensor_parallel_size
                )
                if self.speculative_config is not None
                else None
            )
            progress.update()
            progress.set_postfix_str("weights")
            self.device = _resolve_device(args.device)
            self.dtype = resolve_dtype(args.dtype, self.device, self.model_config)
            self.scheduler_config = self._scheduler_config()
            backend = args.attention_backend or (
                "triton" if self.device.type == "cuda" else "torch"
            )
            # One rank in this process, or one worker process per tensor-parallel rank.
            self.executor = create_executor(
                WorkerConfig(
                    model_dir=self.model_dir,
                    dtype=self.dtype,
                    device=self.device,
                    attention_backend=backend,
                    block_size=args.block_size,
                    seed=args.seed,
                    eos_token_ids=self.eos_token_ids,
                    tensor_parallel_size=args.tensor_parallel_size,
                    max_model_len=self.scheduler_config.max_model_len,
                    model_config=self.model_config,
                    model_shape=self.model_shape,
                )
            )
            progress.update()
            progress.set_postfix_str("KV cache")
            self.cache_config = self._cache_config()
            self.executor.initialize_cache(self.cache_config.num_blocks)
            # In-process runner (None under tensor parallelism: each rank's is in its process).
            self.model_runner = getattr(self.executor, "model_runner", None)
            self.lora_manager = self._lora_manager()
            self.proposer = (
                proposers.build_proposer(
                    self.speculative_config,
                    self.draft_dir,
                    self.dtype,
                    self.device,
                    backend,
                    self.cache_config.num_blocks,
                    args.block_size,
                )
                if self.speculative_config is not None
                else None
            )
            progress.update()
        self.served_model_name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
        self.kv_cache_manager = KVCacheManager(
            self.cache_config.num_blocks,
            args.block_size,
            args.enable_prefix_caching,
            root_hash=_model_identity_hash(self.model_dir, args.revision, self.dtype),
        )
        self.scheduler = Scheduler(
            self.scheduler_config,
            self.kv_cache_manager,
            num_lookahead_tokens=proposers.num_lookahead_tokens(self.speculative_config),
        )
        self._parents: dict[str, _ParentRequest] = {}
        self._sequences: dict[str, _Sequence] = {}
        # Token id -> its text on its own, for logprobs (at most the vocabulary).
        self._token_texts: dict[int, str] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        capacity = self.cache_config.capacity_tokens
        logger.info(
            "KV cache size: %d tokens (%d blocks of %d)",
            capacity,
            self.cache_config.num_blocks,
            args.block_size,
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
        manager = LoRAManager(runner.model, self.args.max_loras, self.args.max_lora_rank)
        for lora_id, module in enumerate(parse_lora_modules(self.args.lora_modules), start=1):
            manager.add_adapter(LoRARequest(module.name, lora_id, module.path))
        runner.lora_manager = manager
        return manager

    def _scheduler_config(self) -> SchedulerConfig:
        args = self.args
        model_max = int(getattr(self.model_config, "max_position_embeddings", 0) or 0)
        max_model_len = args.max_model_len or model_max
        if not max_model_len:
            raise ValueError(
                "max_model_len must be given: the model config has no max_position_embeddings"
            )
        if model_max and max_model_len > model_max:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"({model_max})"
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
        # Per rank: each holds only its KV heads (all of them on a single rank); a draft
        # model's cache shares the blocks (tensor parallelism is refused with one).
        bytes_per_token = self.model_shape.kv_bytes_per_token(
            self.dtype.itemsize, args.tensor_parallel_size
        ) + proposers.draft_kv_bytes_per_token(self.draft_dir, self.dtype.itemsize)
        block_bytes = bytes_per_token * args.block_size
        if self.device.type == "cuda":
            peak = self.executor.profile_peak_memory(
                sched.max_num_batched_tokens, sched.max_model_len
            )
            total = torch.cuda.mem_get_info(self.device)[1]
            budget = int(total * args.gpu_memory_utilization) - peak
            source = f"gpu_memory_utilization {args.gpu_memory_utilization} of {total} bytes minus a {peak}-byte profiled peak"
        elif args.kv_cache_memory is not None:
            budget = args.kv_cache_memory
            source = f"kv_cache_memory {budget} bytes"
        else:
            budget = min(
                CPU_DEFAULT_KV_CACHE_MEMORY,
                sched.max_num_seqs * sched.max_model_len * bytes_per_token,
            )
            source = f"default CPU budget {budget} bytes"
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"no room for a single KV block ({block_bytes} bytes) with {source}; raise "
                "kv_cache_memory / gpu_memory_utilization"
            )
        return CacheConfig(
            block_size=args.block_size,
            num_blocks=num_blocks,
            bytes_per_token=bytes_per_token,
            enable_prefix_caching=args.enable_prefix_caching,
        )

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; it joins the batch at the next ``step()``.

        Args:
            request_id: unique among unfinished requests.
            prompt: text, ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}``; a dict may
                carry vLLM's ``"cache_salt"`` key instead of the ``cache_salt`` argument.
            params: sampling parameters (default ``SamplingParams()``); ``n > 1`` fans out
                into ``n`` sequences, sequence ``i`` seeded with ``seed + i``.
            arrival_time: ``time.time()`` of arrival (default now).
            cache_salt: requests with different salts never share prefix-cache blocks; a
                non-empty string, or None for no salt.
            lora_request: the LoRA adapter to apply (registered now if its name is new), or
                None for the base model. Needs ``enable_lora``.

        ``params.structured_outputs`` is compiled here unless ``compile_grammar`` already did
        (xgrammar's cache); a server compiles it first, on a worker thread.

        Raises:
            ValueError: naming the problem: a duplicate id, an empty prompt, an unknown prompt
                dict key, an empty ``cache_salt`` or one given twice, a prompt longer than
                ``max_model_len`` or than the whole KV cache, token ids outside the vocabulary,
                ``logprobs`` or ``prompt_logprobs`` above the vocabulary size, an invalid
                ``structured_outputs`` constraint, an adapter without ``enable_lora`` or that
                cannot be loaded (``LoRAAdapterError``). Nothing else is touched.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        vocab_size = self.model_shape.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > vocab_size:
                raise ValueError(
                    f"{name} must be at most the vocabulary size ({vocab_size}), got "
                    f"{getattr(params, name)}"
                )
        if isinstance(prompt, dict) and "cache_salt" in prompt:
            if cache_salt is not None:
                raise ValueError(
                    "cache_salt: given both in the prompt dict and as an argument; give one"
                )
            cache_salt = prompt["cache_salt"]
        check_cache_salt(cache_salt)
        text, token_ids = self._tokenize(prompt)
        max_tokens = self._max_tokens(len(token_ids), params)
        ids = [request_id] if params.n == 1 else [f"{request_id}:{i}" for i in range(params.n)]
        taken = [i for i in [request_id, *ids] if i in self._parents or i in self._sequences]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        grammar = (
            None
            if params.structured_outputs is None
            else self.structured_output_manager.compile(params.structured_outputs)
        )
        lora_digest = self._lora_digest(lora_request)
        arrival_time = time.time() if arrival_time is None else arrival_time
        parent = _ParentRequest(
            request_id,
            text,
            token_ids,
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
        )
        for index, seq_id in enumerate(ids):
            request = Request(
                request_id=seq_id,
                prompt_token_ids=token_ids,
                sampling_params=params,
                eos_token_ids=self.eos_token_ids,
                max_tokens=max_tokens,
                arrival_time=arrival_time,
                cache_salt=cache_salt,
                lora_request=lora_request,
                lora_digest=lora_digest,
                seed=None if params.seed is None else params.seed + index,
                # The sequences share the prompt: the first one scores it.
                num_prompt_logprobs=params.prompt_logprobs if index == 0 else None,
            )
            seq = _Sequence(
                parent_id=request_id,
                index=index,
                request=request,
                detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids, params),
                logprobs=None if params.logprobs is None else [],
                cumulative_logprob=None if params.logprobs is None else 0.0,
            )
            parent.sequences.append(seq)
        self._parents[request_id] = parent
        for seq in parent.sequences:
            self._sequences[seq.request.request_id] = seq
            if grammar is not None:
                self.structured_output_manager.add_request(seq.request.request_id, grammar)
            self.scheduler.add_request(seq.request)

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
        in_use = {s.request.lora_name for s in self._sequences.values()}
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

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - set(PROMPT_DICT_KEYS), key=str)
            if unknown:
                raise ValueError(
                    f"prompt dict has unknown keys {unknown}: it takes 'prompt' or "
                    "'prompt_token_ids', and optionally 'cache_salt'"
                )
            if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise ValueError(
                    "prompt dict must have exactly one of the keys 'prompt' or "
                    f"'prompt_token_ids', got {sorted(prompt)}"
                )
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                token_ids = prompt["prompt_token_ids"]
                if not isinstance(token_ids, list | tuple) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in token_ids
                ):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return None, self._check_prompt(list(token_ids))
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string or a dict, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt, self._check_prompt(encode_text(self.tokenizer, prompt, "prompt"))

    def _check_prompt(self, token_ids: list[int]) -> list[int]:
        if not token_ids:
            raise ValueError("prompt is empty (0 tokens)")
        vocab_size = self.model_shape.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
            )
        max_model_len = self.scheduler_config.max_model_len
        if len(token_ids) > max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens, longer than max_model_len ({max_model_len})"
            )
        capacity = self.cache_config.capacity_tokens
        if len(token_ids) > capacity:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens and can never fit the KV cache "
                f"({capacity} tokens)"
            )
        return token_ids

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        """Clamp the output length so that prompt + output fits ``max_model_len`` (as vLLM) and
        the KV cache (the last sampled token needs no slot)."""
        limits = [
            self.scheduler_config.max_model_len - prompt_len,
            self.cache_config.capacity_tokens + 1 - prompt_len,
        ]
        if params.max_tokens is not None:
            limits.append(params.max_tokens)
        return max(1, min(limits))

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Finish requests with ``finish_reason`` "abort" and free their blocks now.

        Unknown or finished ids are ignored. No output is emitted for them.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            parent = self._parents.pop(request_id, None)
            if parent is None:
                continue
            seq_ids = [s.request.request_id for s in parent.sequences]
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
            self.structured_output_manager.remove_requests(seq_ids)
            for seq_id in seq_ids:
                self._sequences.pop(seq_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash (vLLM's ``reset_prefix_cache``), e.g. between
        benchmark runs; refused (False) while requests hold blocks."""
        return self.kv_cache_manager.block_pool.reset_prefix_cache()

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
        runner_output = self.executor.execute_model(scheduler_output)
        for sched in scheduler_output.scheduled:
            scored = runner_output.prompt_logprobs.get(sched.request.request_id)
            if scored:
                self._add_prompt_logprobs(sched, scored)
        num_outputs_before = {
            s.request.request_id: s.request.num_output_tokens for s in scheduler_output.scheduled
        }
        updated = self.scheduler.update_from_output(
            scheduler_output, runner_output.sampled_token_ids
        )
        touched: dict[str, _ParentRequest] = {}
        for request in updated:
            seq = self._sequences[request.request_id]
            start = num_outputs_before[request.request_id]
            if start == 0:
                self.prompt_tokens_total += request.num_prompt_tokens
            logprobs = runner_output.logprobs.get(request.request_id, [])
            # Several tokens with speculative decoding: a stop string inside an accepted run
            # ends the output there.
            new_token_ids = request.output_token_ids[start:]
            if (
                not self.structured_output_manager.accept_tokens(request.request_id, new_token_ids)
                and not request.is_finished
            ):
                # The grammar is complete (its end token taken under ignore_eos) or stuck.
                self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_STOPPED)
            for i, token_id in enumerate(new_token_ids):
                self.generation_tokens_total += 1
                if i < len(logprobs) and seq.logprobs is not None:
                    self._append_logprobs(seq, logprobs[i])
                if self._detokenize(request, seq, token_id, last=i == len(new_token_ids) - 1):
                    request.truncate_output(start + i + 1)
                    break
            touched[seq.parent_id] = self._parents[seq.parent_id]
        if self.proposer is not None:
            # Constrained requests are not speculated: drafts would need their grammar too.
            self.proposer.propose(
                scheduler_output,
                [
                    r
                    for r in updated
                    if not r.is_finished
                    and not self.structured_output_manager.has_request(r.request_id)
                ],
            )
        outputs = []
        for parent_id, parent in touched.items():
            if not parent.prompt_logprobs_ready:
                # Another sequence got ahead of the one scoring the prompt: the first output
                # carries the prompt logprobs (outputs are cumulative, nothing is lost).
                continue
            outputs.append(parent.to_output())
            if parent.finished:
                del self._parents[parent_id]
                self.structured_output_manager.remove_requests(
                    s.request.request_id for s in parent.sequences
                )
                for seq in parent.sequences:
                    self._sequences.pop(seq.request.request_id, None)
        return outputs

    def _detokenize(
        self, request: Request, seq: _Sequence, token_id: int, last: bool = True
    ) -> bool:
        """Feed a new token to the detokenizer; a matched stop string finishes the request
        (and is reported: True).

        As in vLLM, a token that stopped the request (EOS, a stop token id) is kept in
        ``token_ids`` but not in the text unless ``include_stop_str_in_output``; a stop string
        wins over a length limit reached by the same token. ``last``: whether the token is the
        last of this step's (only that one can have stopped the request).
        """
        params = request.sampling_params
        stopped_by_token = last and request.status == RequestStatus.FINISHED_STOPPED
        if stopped_by_token and not params.include_stop_str_in_output:
            return False
        stop_string = seq.detokenizer.update([token_id])
        if stop_string is None:
            return False
        if request.is_finished:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = stop_string
        else:
            self.scheduler.finish_requests(
                request.request_id, RequestStatus.FINISHED_STOPPED, stop_reason=stop_string
            )
        return True

    def _append_logprobs(self, seq: _Sequence, logprobs: TokenLogprobs) -> None:
        sampled_logprob, top = logprobs
        seq.logprobs.append(self._logprob_dict(top))
        seq.cumulative_logprob += sampled_logprob

    def _add_prompt_logprobs(self, sched: ScheduledRequest, scored: list[TokenLogprobs]) -> None:
        """Record the prompt tokens one step scored for a request.

        A chunk scored again after a preemption (recompute) is skipped where already recorded,
        so entries are never duplicated.

        Raises:
            RuntimeError: the chunk starts past the recorded ones (a prompt chunk went unscored,
                which the scheduler never allows).
        """
        parent = self._parents[self._sequences[sched.request.request_id].parent_id]
        recorded = parent.prompt_logprobs
        first = sched.num_computed_tokens + 1
        if first > len(recorded):
            raise RuntimeError(
                f"prompt logprobs of {sched.request.request_id!r}: got tokens from {first} on, "
                f"only {len(recorded)} recorded"
            )
        for _, top in scored[len(recorded) - first :]:
            recorded.append(self._logprob_dict(top))

    def _logprob_dict(self, top: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
        """``{token_id: Logprob}`` with each token's text (decoded once per token id)."""
        texts = self._token_texts
        for token_id in top.keys() - texts.keys():
            texts[token_id] = self.tokenizer.decode([token_id])
        return {t: Logprob(lp, rank, texts[t]) for t, (lp, rank) in top.items()}

    def get_stats(self) -> EngineStats:
        """A snapshot of gauges and counters (see ``EngineStats``)."""
        pool = self.kv_cache_manager.block_pool
        capacity = self.cache_config.capacity_tokens
        return EngineStats(
            num_running_reqs=len(self.scheduler.running),
            num_waiting_reqs=len(self.scheduler.waiting),
            kv_cache_usage=pool.get_usage(),
            num_total_blocks=pool.num_blocks,
            num_free_blocks=pool.get_num_free_blocks(),
            kv_capacity_tokens=capacity,
            max_concurrency=capacity / self.scheduler_config.max_model_len,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prefix_cache_queries_total=self.scheduler.prefix_cache_queries_total,
            prefix_cache_hits_total=self.scheduler.prefix_cache_hits_total,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            running_lora_adapters=_lora_names(self.scheduler.running),
            waiting_lora_adapters=_lora_names(self.scheduler.waiting),
            max_lora=self.scheduler_config.max_loras,
            spec_decode=self.scheduler.spec_decoding_stats.snapshot() if self.proposer else None,
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


def _lora_names(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora_name for r in requests if r.lora_name is not None}))


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
