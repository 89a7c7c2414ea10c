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


def test_a_request_gets_the_same_tokens_and_logprobs_alone_and_in_a_batch(default_model_dir):
    # No prefix caching: a prompt seen before would start from its cached blocks (another
    # split of its prefill, which is a different computation, not a different batch).
    llm = LLM(str(default_model_dir), max_model_len=256, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": tokens(n, seed=n)} for n in (5, 17, 31, 64, 90, 120)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)

    def token_and_logprobs(outputs):
        return [
            (o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in step.items())
                                      for step in o.outputs[0].logprobs])
            for o in outputs
        ]  # fmt: skip

    alone = [token_and_logprobs(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
    together = token_and_logprobs(llm.generate(prompts, params, use_tqdm=False))
    # Exact equality of every float: not a tolerance.
    assert together == alone
