"""Batch invariance on the CPU: a request's tokens and logprobs are the same bit for bit whether
it runs alone or beside other requests (the real SmolLM2, float32).

Every float operation a row goes through depends on that row alone: the linear layers' kernel
sums in an order fixed by the layer's width (``kvpilot.kernels.cpu.gemm``), prefill attention
runs per sequence, decode attention per (sequence, KV head), the fused elementwise ops per row,
and sampling per row. With oneDNN (a CPU without AVX-512) the linear layers' blocking changes
with the batch size, so this holds only where the kernel runs.
"""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.kernels.cpu import gemm
from tests.engine.helpers import tokens

pytestmark = pytest.mark.skipif(
    not gemm.available(), reason="batch-invariant linear layers need the AVX-512 GEMM kernel"
)


def _tokens_and_logprobs(outputs) -> list:
    return [
        (o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in step.items())
                                  for step in o.outputs[0].logprobs])
        for o in outputs
    ]  # fmt: skip


def test_a_request_gets_the_same_tokens_and_logprobs_alone_and_in_a_batch(default_model_dir):
    # No prefix caching here: a prompt seen before starts from its cached blocks (see below).
    llm = LLM(str(default_model_dir), max_model_len=256, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": tokens(n, seed=n)} for n in (5, 17, 31, 64, 90, 120)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    alone = [_tokens_and_logprobs(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
    together = _tokens_and_logprobs(llm.generate(prompts, params, use_tqdm=False))
    # Exact equality of every float: not a tolerance.
    assert together == alone


def test_a_prompt_gets_the_same_logprobs_from_the_prefix_cache_and_in_one_token_chunks(
    default_model_dir,
):
    """A prompt of whole blocks (block size 8) seen again is found in the prefix cache but for
    its last token, which is computed alone; a step budget that leaves a prompt's last chunk one
    token long does the same. Those one-token prompt chunks take the attention kernel's prompt
    tiles, as the whole prompt did (a decode's path sums in another order, ~4e-6 apart)."""
    prompts = [{"prompt_token_ids": tokens(n, seed=n)} for n in (40, 64, 97)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    cached = LLM(str(default_model_dir), max_model_len=256, block_size=8)
    first = _tokens_and_logprobs(cached.generate(prompts, params, use_tqdm=False))
    again = _tokens_and_logprobs(cached.generate(prompts, params, use_tqdm=False))
    assert again == first, "a prefix-cache hit changed a prompt's logprobs"
    # 97 tokens under a budget of 96: a 96-token chunk, then a one-token one.
    chunked = LLM(
        str(default_model_dir),
        max_model_len=256,
        block_size=8,
        enable_prefix_caching=False,
        max_num_batched_tokens=96,
        max_num_seqs=1,
    )
    assert _tokens_and_logprobs(chunked.generate(prompts, params, use_tqdm=False)) == first
