"""What an engine core is asked to do, the same in-process and in a process of its own.

An engine core is one ``LLMEngine`` that schedules and executes (vLLM V1's ``EngineCore``).
The API reaches it through an engine-core client (``engine.core_client``): in the server's
process on a thread of its own (``InprocClient``), or in a separate process over a pipe
(``MPClient`` and ``engine.core_proc``). Both run the calls of :data:`CALLS` by name, so that
the two modes cannot drift apart, and both describe the loaded engine to the API with one
:class:`EngineCoreInfo`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.stats import EngineStats


class EngineDeadError(RuntimeError):
    """The engine cannot run another step (vLLM's name): a worker or the engine-core process
    died or failed. Defined here, free of torch, for the API process; the executors raise it."""


@dataclass
class EngineCoreInfo:
    """What the API needs to know of a loaded engine (sent once, after loading).

    Attributes:
        max_model_len: the longest sequence, prompt plus output (tokens).
        max_num_seqs: the most sequences a step runs (its slots).
        block_size: tokens per KV block.
        num_blocks: KV blocks in the cache.
        enable_prefix_caching: whether full blocks are shared between requests.
        cache_dtype: the KV cache's dtype name (``"float32"``, ``"bfloat16"``, ...).
        gpu_memory_utilization: the fraction of device memory the engine may use.
        vocab_size: the model's vocabulary size (tokens).
        root_hash: hex digest that seeds the engine's prefix-cache block hashes.
        tokenizer: a copy of the engine's Hugging Face tokenizer, the API's own.
        loras: the adapters loaded at start.
        default_sampling_params: the model's generation defaults.
        default_max_tokens: the generation config's ``max_new_tokens`` (the output limit of a
            request that sets none), or None.
        override_max_tokens: the cap on every request's output (tokens): ``max_new_tokens`` of
            ``--override-generation-config``, or of a ``--generation-config`` folder (vLLM's
            ``override_max_tokens``); None: no cap.
        stats: the engine's stats after loading.
    """

    max_model_len: int
    max_num_seqs: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    cache_dtype: str
    gpu_memory_utilization: float
    vocab_size: int
    root_hash: str
    tokenizer: Any
    loras: list[LoRARequest]
    default_sampling_params: SamplingParams
    stats: EngineStats
    default_max_tokens: int | None = None
    override_max_tokens: int | None = None

    @classmethod
    def from_engine(cls, engine: Any) -> EngineCoreInfo:
        """Describe a loaded ``LLMEngine`` (the tokenizer is not copied: callers that keep it
        beside a running engine copy it, as pickling between processes does)."""
        cache = engine.cache_config
        return cls(
            max_model_len=engine.scheduler_config.max_model_len,
            max_num_seqs=engine.scheduler_config.max_num_seqs,
            block_size=cache.block_size,
            num_blocks=cache.num_blocks,
            enable_prefix_caching=cache.enable_prefix_caching,
            cache_dtype=str(engine.kv_cache_dtype).removeprefix("torch."),
            gpu_memory_utilization=engine.args.gpu_memory_utilization,
            vocab_size=engine.model_shape.vocab_size,
            root_hash=engine.kv_cache_manager.root_hash.hex(),
            tokenizer=engine.tokenizer,
            loras=engine.list_loras(),
            default_sampling_params=engine.get_default_sampling_params(),
            stats=engine.get_stats(),
            default_max_tokens=engine.default_sampling.get("max_tokens"),
            override_max_tokens=engine.override_max_tokens,
        )


@dataclass
class EngineCoreRequest:
    """A request for the engine core (vLLM V1's name): ``LLMEngine.add_request``'s arguments.

    Attributes:
        request_id: unique among the unfinished requests.
        prompt: a text, or ``{"prompt_token_ids": [...]}``.
        params: how to sample.
        arrival_time: when the request arrived (seconds since the epoch, ``time.time()``).
        cache_salt: isolates its prefix-cache blocks from other salts, or None.
        lora_request: the adapter to run it with, or None for the base model.
        priority: its priority under the ``priority`` scheduling policy (lower first).
    """

    request_id: str
    prompt: str | dict[str, Any]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    priority: int = 0


def add_request(engine: Any, request: EngineCoreRequest) -> EngineStats:
    """``LLMEngine.add_request``, then the stats it leaves (ValueError as the engine raises)."""
    engine.add_request(
        request.request_id,
        request.prompt,
        request.params,
        arrival_time=request.arrival_time,
        cache_salt=request.cache_salt,
        lora_request=request.lora_request,
        priority=request.priority,
    )
    return engine.get_stats()


def abort(engine: Any, request_ids: list[str]) -> EngineStats:
    """``LLMEngine.abort_request`` (unknown ids ignored), then the stats it leaves."""
    engine.abort_request(request_ids)
    return engine.get_stats()


def abort_all(engine: Any) -> list[str]:
    """Abort every unfinished request (after a failed step); their ids."""
    request_ids = list(engine.output_processor.parents)
    engine.abort_request(request_ids)
    return request_ids


def step(engine: Any) -> tuple[list[RequestOutput], EngineStats]:
    """One ``LLMEngine.step()``: its outputs and the stats it leaves."""
    outputs = engine.step()
    return outputs, engine.get_stats()


# The calls a client may make by name: each takes the engine and the call's arguments.
CALLS: dict[str, Callable[..., Any]] = {
    "add_request": add_request,
    "abort": abort,
    "add_lora": lambda engine, lora_request: engine.add_lora(lora_request),
    "remove_lora": lambda engine, lora_name: engine.remove_lora(lora_name),
    "get_kv_events": lambda engine, since: engine.get_kv_events(since),
    "check_health": lambda engine: engine.check_health(),
    # Thread-safe and seconds long for a large schema: run beside the steps, not between them.
    "compile_grammar": lambda engine, params: engine.compile_grammar(params),
}

# Calls that run on a thread of their own, concurrently with the steps.
CONCURRENT_CALLS = frozenset({"compile_grammar"})
