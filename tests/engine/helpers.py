"""Helpers shared by the engine tests: prompts, greedy parameters, token ids, transformers'
greedy reference, the leak check."""

from __future__ import annotations

import pathlib

import torch
import transformers

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.llm_engine import LLMEngine

NEW_TOKENS = 24
"""Tokens each greedy request generates unless a test asks for another count."""


def tokens(n: int, seed: int) -> list[int]:
    """``n`` random token ids of SmolLM2's vocabulary, past its special tokens (ids 0-2)."""
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens: int = NEW_TOKENS, **kwargs) -> SamplingParams:
    """Greedy decoding of exactly ``max_tokens`` tokens (EOS ignored)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def generate_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """The first completion's token ids of each token-id prompt, in input order."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def assert_no_leak(engine: LLMEngine) -> None:
    """Idle engine: every block free again, no reference held, KV usage 0."""
    pool = engine.kv_cache_manager.block_pool
    assert not engine.has_unfinished_requests()
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert engine.get_stats().kv_cache_usage == 0.0


def hf_generate(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate()`` of one prompt, EOS ignored: the new token ids.

    The attention mask is passed explicitly: without one, ``generate`` masks every token equal
    to ``pad_token_id``, and SmolLM2's pad token is ``<|im_end|>``, which chat prompts contain.
    """
    return model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
    )[0, len(prompt) :].tolist()


def hf_greedy(
    model_dir: pathlib.Path, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """:func:`hf_generate` of each prompt with the float32 model of ``model_dir``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [hf_generate(model, p, max_new_tokens) for p in prompts]
