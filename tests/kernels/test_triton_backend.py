"""The ``"triton"`` attention backend against the ``"torch"`` one: layer outputs and caches on a
mixed batch, and the whole engine's greedy tokens on a tiny model (interpreter on CPU), where
the Triton backend also runs the norm, rotary and activation kernels."""

from __future__ import annotations

import pathlib

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.attention import AttentionMetadata, get_attention_backend
from kvpilot.engine.attention.triton_backend import TritonAttentionBackend
from kvpilot.engine.layers.custom_op import CustomOp

pytestmark = pytest.mark.kernel


def _mixed_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode token (context 20), a 6-token prefill chunk over 10 cached tokens, a 3-token
    whole prompt and one padding token (slot -1), over shuffled blocks of 8."""
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 8
    q_lens, seq_lens = [1, 6, 3], [21, 16, 3]
    tables = torch.tensor([[5, 0, 9], [2, 7, 0], [4, 0, 0]], dtype=torch.int32)
    slots = [
        int(tables[i, pos // block_size]) * block_size + pos % block_size
        for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True))
        for pos in range(seq_len - q_len, seq_len)
    ]
    num_tokens = sum(q_lens) + 1
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([*slots, -1]),
        query_start_loc=torch.tensor([0, 1, 7, 10], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    return query, key, value, metadata


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_forward_matches_torch_backend(sliding_window: int | None) -> None:
    query, key, value, metadata = _mixed_batch()
    gen = torch.Generator().manual_seed(1)
    caches = {name: torch.randn(10, 8, 2, 16, generator=gen) for name in ("k", "v")}
    outputs, written = {}, {}
    for name in ("torch", "triton"):
        backend = get_attention_backend(name)
        kv_cache = (caches["k"].clone(), caches["v"].clone())
        out = backend.forward(
            query, key, value, kv_cache, metadata, scale=0.25, sliding_window=sliding_window
        )
        outputs[name], written[name] = out[:10], kv_cache
    assert isinstance(get_attention_backend("triton"), TritonAttentionBackend)
    torch.testing.assert_close(outputs["triton"], outputs["torch"], atol=1e-5, rtol=1e-5)
    for got, want in zip(written["triton"], written["torch"], strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_engine_greedy_tokens_match_torch_backend(tiny_llama_dir: pathlib.Path) -> None:
    # A token budget of 16 makes the scheduler chunk the longer prompts and run those chunks
    # in the same steps as other sequences' decodes: mixed batches through the kernel.
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (1, 8, 17, 30)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    tokens, logprobs = {}, {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(tiny_llama_dir), attention_backend=backend, max_model_len=64, block_size=8,
            max_num_batched_tokens=16, enable_prefix_caching=False,
        )  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        model = llm.llm_engine.model_runner.model
        # Every norm, activation and the rotary embedding follow the attention backend.
        ops = [m for m in model.modules() if isinstance(m, CustomOp)]
        assert len(ops) == 1 + 2 * 3 + 1  # final norm, per layer 2 norms + SiLU, rotary
        assert {op.kernel_backend for op in ops} == {backend}
        # The Triton rotary path ran: it built its cos/sin table on first use.
        assert (model.model.rotary_emb._cos_sin_cache is not None) == (backend == "triton")
        tokens[backend] = [list(o.outputs[0].token_ids) for o in outputs]
        logprobs[backend] = [o.outputs[0].cumulative_logprob for o in outputs]
    assert all(len(t) == 6 for t in tokens["torch"])
    assert tokens["triton"] == tokens["torch"]
    # A random tiny model often repeats one token whatever attention returns; the sampled
    # tokens' log-probabilities do depend on it.
    assert logprobs["triton"] == pytest.approx(logprobs["torch"], abs=1e-4)
