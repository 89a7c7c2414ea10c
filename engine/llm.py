"""The offline API: ``LLM(...).generate(prompts, sampling_params)``, shaped like vLLM's ``LLM``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from kvpilot.engine.config import EngineArgs
from kvpilot.engine.input_processor import PromptType
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.tokenization import (
    ChatMessage,
    apply_chat_template,
    parse_chat_messages,
    parse_chat_tools,
)


class LLM:
    """Generate from many prompts at once with continuous batching.

    Args:
        model: a local folder, a ``.gguf`` file or a Hub id; None for the built-in default
            (SmolLM2-135M-Instruct).
        **kwargs: any other ``EngineArgs`` field (``dtype``, ``block_size``, ``max_model_len``,
            ``max_num_seqs``, ``max_num_batched_tokens``, ``kv_cache_memory`` (bytes),
            ``kv_cache_dtype`` (``"fp8"``...), ``gpu_memory_utilization``, ``seed``,
            ``enable_prefix_caching``, ...).

    Raises:
        ValueError: a bad engine argument (named), an unsupported architecture.
        FileNotFoundError: a model path or id that does not exist.
    """

    def __init__(
        self, model: str | None = None, *, show_progress: bool = False, **kwargs: Any
    ) -> None:
        self.llm_engine = LLMEngine.from_engine_args(
            EngineArgs(model=model, **kwargs), show_progress=show_progress
        )
        self._counter = 0

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's ``LLM.reset_prefix_cache``); False while requests
        are in flight."""
        return self.llm_engine.reset_prefix_cache()

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer."""
        return self.llm_engine.tokenizer

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, each rendered with the model's chat template
        (vLLM's ``LLM.chat``; the server's chat endpoint renders prompts the same way).

        Args:
            messages: one conversation (a list of ``{"role", "content"}`` messages, OpenAI's
                format; content may be a list of ``{"type": "text", "text"}`` parts) or a list
                of conversations, batched together.
            sampling_params: as in ``generate``: one for all, or one per conversation.
            use_tqdm: show a progress bar over finished requests.
            lora_request: as in ``generate``.
            chat_template: a Jinja template to use instead of the tokenizer's.
            add_generation_prompt: end the prompt with the assistant's header, so that the
                model replies.
            continue_final_message: let the model continue the last message instead (needs
                ``add_generation_prompt=False``).
            tools: OpenAI function tools (``{"type": "function", "function": {"name",
                "description", "parameters"}}``) for the template to describe to the model,
                as the server's ``tools``; templates without tool support ignore them.
            chat_template_kwargs: extra variables for the template.

        Returns:
            One finished ``RequestOutput`` per conversation, in order; ``prompt_token_ids`` are
            transformers' ``apply_chat_template(conversation, tokenize=True, ...)``.

        Raises:
            ValueError: naming ``messages`` (malformed messages, no chat template, a template
                that refuses them), ``chat_template`` (the one given here does not compile or
                refuses them), ``tools`` (not a list of function tools),
                ``continue_final_message``, or as ``generate`` does.
        """
        conversations = (
            [messages]
            if isinstance(messages, Sequence) and messages and isinstance(messages[0], Mapping)
            else messages
        )
        if isinstance(conversations, str | Mapping) or not conversations:
            raise ValueError("messages: must be a conversation or a list of conversations")
        if tools is not None:
            tools = parse_chat_tools(tools)
        tokenizer = self.get_tokenizer()
        prompts = [
            {
                "prompt_token_ids": apply_chat_template(
                    tokenizer,
                    parse_chat_messages(conversation),
                    tools=tools,
                    chat_template=chat_template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template_kwargs=chat_template_kwargs,
                )
            }
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's recommended sampling where its
        ``generation_config.json`` has one (``--generation-config``, as in vLLM)."""
        return self.llm_engine.get_default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, all batched together.

        Args:
            prompts: one prompt or a list; a prompt is a string or
                ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}``, a dict optionally with
                vLLM's ``"cache_salt"`` (a non-empty string): prompts with different salts
                never share prefix-cache blocks.
            sampling_params: one for all prompts, or one per prompt (default
                ``get_default_sampling_params()``).
            use_tqdm: show a progress bar over finished requests.
            lora_request: the LoRA adapter for all prompts, or one per prompt (None entries:
                the base model); needs ``enable_lora``.
            priority: one priority per prompt (lower first), with
                ``scheduling_policy="priority"``; None: all 0.

        Returns:
            Finished ``RequestOutput``s in the order of ``prompts``.

        Raises:
            ValueError: when the numbers of prompts and sampling params (or LoRA requests)
                differ, or a prompt or adapter is refused (empty, too long, an unknown prompt
                dict key, an empty ``cache_salt``, adapter not loadable...); no request of this
                call is left queued then.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(prompts)} prompts but {len(params_list)} sampling params"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list = [lora_request] * len(prompts)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(lora_list)} lora requests")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priorities)} priorities")
        engine = self.llm_engine
        request_ids: list[str] = []
        finished: dict[str, RequestOutput] = {}
        try:
            for prompt, params, lora, rank in zip(
                prompts, params_list, lora_list, priorities, strict=True
            ):
                request_id = str(self._counter)
                self._counter += 1
                engine.add_request(request_id, prompt, params, lora_request=lora, priority=rank)
                request_ids.append(request_id)
            with tqdm(
                total=len(request_ids), desc="Processed prompts", disable=not use_tqdm
            ) as bar:
                while len(finished) < len(request_ids):
                    for output in engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update()
        except BaseException:
            # A refused prompt, a failed step or Ctrl-C leaves none of this call's requests in
            # the engine, where every later call would run them again.
            engine.abort_request([r for r in request_ids if r not in finished])
            raise
        return [finished[request_id] for request_id in request_ids]
