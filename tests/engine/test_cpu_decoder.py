"""The CPU decoder path (``kvpilot.engine.models.cpu_decoder``): the same bits as the module
path on the real SmolLM2, and only for the layers it can run as they are."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.attention import AttentionMetadata
from kvpilot.engine.layers.linear import prepack_linear_weights
from kvpilot.engine.model_loader import load_model
from kvpilot.engine.models import cpu_decoder
from kvpilot.kernels.cpu import gemm, paged_attention
from tests.engine.helpers import tokens

needs_kernels = pytest.mark.skipif(
    not (gemm.available() and paged_attention.available()),
    reason="the CPU decoder path runs the AVX-512 GEMM and the paged-attention kernels",
)


def _counting(monkeypatch) -> list[bool]:
    """Wraps ``cpu_decoder.forward``; the list gets whether each call took the path."""
    taken: list[bool] = []
    inner = cpu_decoder.forward

    def forward(*args, **kwargs):
        result = inner(*args, **kwargs)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(cpu_decoder, "forward", forward)
    return taken


@needs_kernels
def test_the_path_gives_the_module_paths_tokens_and_logprobs(default_model_dir, monkeypatch):
    taken = _counting(monkeypatch)
    # A step budget of 48 tokens: prompt chunks share steps with other sequences' decodes.
    prompts = [{"prompt_token_ids": tokens(n, seed=n)} for n in (3, 21, 40, 77, 130)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)

    def run() -> list:
        llm = LLM(
            str(default_model_dir),
            max_model_len=256,
            max_num_batched_tokens=48,
            enable_prefix_caching=False,
        )
        return [
            (o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in step.items())
                                      for step in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params, use_tqdm=False)
        ]  # fmt: skip

    with_path = run()
    assert taken and all(taken)  # every step, prompt chunks and decodes alike
    monkeypatch.setenv(cpu_decoder.ENV_VAR, "0")
    taken.clear()
    without = run()
    assert taken == []
    # Exact equality of every float: the same kernels in the same order.
    assert with_path == without


@needs_kernels
@pytest.mark.parametrize(
    ("architecture", "overrides", "plain"),
    [
        ("llama", {}, True),
        ("mistral", {}, True),  # a sliding window goes to the kernel as it is
        ("llama", {"attention_bias": True}, False),
        ("llama", {"mlp_bias": True}, False),
        ("qwen2", {}, False),  # q/k/v biases
        ("qwen3", {}, False),  # q/k norms
        ("granite", {"residual_multiplier": 0.5}, False),
        ("gemma", {}, False),  # 1 + weight norms, GeGLU
        ("mixtral", {}, False),  # experts
    ],
)
def test_only_plain_layers_take_the_path(tiny_model_dir, architecture, overrides, plain):
    model = load_model(
        tiny_model_dir(architecture, **overrides), torch.float32, torch.device("cpu")
    )
    layers = model.model.layers
    assert cpu_decoder.plain_layers(layers) is None  # dense weights: not packed yet
    prepack_linear_weights(model)
    found = cpu_decoder.plain_layers(layers)
    assert (found is not None) is plain
    if plain:
        attn = layers[0].self_attn
        assert [p.qkv for p in found] == [layer.self_attn.qkv_proj.weight for layer in layers]
        assert (found[0].num_heads, found[0].num_kv_heads, found[0].head_dim) == (
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
        )
        assert found[0].sliding_window == attn.sliding_window


@needs_kernels
def test_a_cache_the_kernel_does_not_take_leaves_the_step_to_the_modules(tiny_model_dir):
    model = load_model(tiny_model_dir("llama"), torch.float32, torch.device("cpu"))
    prepack_linear_weights(model)
    plain = cpu_decoder.plain_layers(model.model.layers)
    backend = model.model.layers[0].self_attn.attn.backend
    rope = model.model.rotary_emb.prepare(torch.arange(4), torch.float32)
    hidden = torch.randn(4, model.config.hidden_size)
    shape = (8, 16, model.num_kv_heads, model.head_dim)
    caches = [(torch.zeros(shape, dtype=torch.bfloat16),) * 2 for _ in plain]

    metadata = AttentionMetadata(
        slot_mapping=torch.arange(4),
        query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
        seq_lens=torch.tensor([4], dtype=torch.int32),
        block_tables=torch.tensor([[0]], dtype=torch.int32),
        max_query_len=4,
        max_seq_len=4,
    )
    assert cpu_decoder.forward(plain, backend, rope, hidden, None, caches, metadata) is None
    assert all(not c[0].any() for c in caches)  # nothing written


@needs_kernels
def test_the_last_layer_takes_only_the_rows_the_lm_head_reads(tiny_model_dir, monkeypatch):
    """Two prompts of 5 and 7 tokens: every layer writes all 12 rows' K/V, the last one takes
    rows 4 and 11 alone through its output projection and MLP, and they come out with the
    bits of the whole step's rows 4 and 11."""
    model = load_model(tiny_model_dir("llama"), torch.float32, torch.device("cpu"))
    prepack_linear_weights(model)
    plain = cpu_decoder.plain_layers(model.model.layers)
    backend = model.model.layers[0].self_attn.attn.backend
    positions = torch.cat([torch.arange(5), torch.arange(7)])
    rope = model.model.rotary_emb.prepare(positions, torch.float32)
    hidden = torch.randn(12, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    metadata = AttentionMetadata(
        slot_mapping=torch.cat([torch.arange(5), 16 + torch.arange(7)]),
        query_start_loc=torch.tensor([0, 5, 12], dtype=torch.int32),
        seq_lens=torch.tensor([5, 7], dtype=torch.int32),
        block_tables=torch.tensor([[0], [1]], dtype=torch.int32),
        max_query_len=7,
        max_seq_len=7,
    )
    shape = (2, 16, model.num_kv_heads, model.head_dim)

    def run(logits_indices):
        caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in plain]
        rows_into_o: list[int] = []
        inner = gemm.packed_linear

        def packed_linear(x, weight, *args):
            if weight is plain[-1].o:
                rows_into_o.append(x.shape[0])
            return inner(x, weight, *args)

        monkeypatch.setattr(gemm, "packed_linear", packed_linear)
        out = cpu_decoder.forward(
            plain, backend, rope, hidden, None, caches, metadata, logits_indices
        )
        monkeypatch.setattr(gemm, "packed_linear", inner)
        assert out is not None
        return out, caches, rows_into_o

    (whole, whole_residual), whole_caches, whole_rows = run(None)
    rows = torch.tensor([4, 11])
    (pruned, pruned_residual), pruned_caches, pruned_rows = run(rows)
    assert (whole_rows, pruned_rows) == ([12], [2])
    assert torch.equal(pruned, whole[rows]) and torch.equal(pruned_residual, whole_residual[rows])
    for (k, v), (k_whole, v_whole) in zip(pruned_caches, whole_caches, strict=True):
        assert torch.equal(k, k_whole) and torch.equal(v, v_whole) and k[1, 6].any()
    (none, _), _, _ = run(torch.tensor([], dtype=torch.long))
    assert none.shape == (0, model.config.hidden_size)
