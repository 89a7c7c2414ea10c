"""Our model implementations against transformers on the same weights.

Every forward goes through the paged KV cache with random, non-contiguous block tables: prefill
of several sequences in one batch, batched decode, chunked prefill mixed with decode. Logits
must match transformers' to float32 rounding, and greedy decoding must pick the same tokens as
transformers' ``generate`` (on the real default model, and through the whole engine on tiny
Granite, Phi-3, Gemma, Mixtral and Qwen3-MoE models).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
import transformers

from kvpilot.engine import LLM
from kvpilot.engine.attention import AttentionMetadata
from kvpilot.engine.model_loader import load_model, load_tokenizer
from tests.engine.helpers import (
    NEW_TOKENS,
    assert_no_leak,
    generate_ids,
    greedy,
    hf_generate,
    hf_greedy,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 64
ATOL = 1e-4


class PagedBatch:
    """Allocates blocks in random order and builds the flat inputs of one forward pass."""

    def __init__(self, model: torch.nn.Module, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
        shape = (NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
        # NaN-filled: any read of a slot that was never written poisons the logits.
        self.kv_caches = [
            (
                torch.full(shape, float("nan"), dtype=model.dtype),
                torch.full(shape, float("nan"), dtype=model.dtype),
            )
            for _ in range(model.num_layers)
        ]
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    def inputs(
        self, chunks: list[tuple[str, list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``chunks``: (sequence id, its new token ids) per sequence in the batch."""
        ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for seq, tokens in chunks:
            table = self.tables.setdefault(seq, [])
            start = self.lengths.get(seq, 0)
            end = start + len(tokens)
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free.pop())
            for pos in range(start, end):
                positions.append(pos)
                slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            ids += tokens
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(end)
            self.lengths[seq] = end
        width = max(len(self.tables[seq]) for seq, _ in chunks)
        tables = [self.tables[seq] + [0] * (width - len(self.tables[seq])) for seq, _ in chunks]
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens),
        )
        return torch.tensor(ids), torch.tensor(positions), metadata

    @torch.no_grad()
    def forward(self, model: torch.nn.Module, chunks: list[tuple[str, list[int]]]) -> torch.Tensor:
        """Logits ``[num_new_tokens, vocab]`` float32 of one mixed batch."""
        input_ids, positions, metadata = self.inputs(chunks)
        return model.compute_logits(model(input_ids, positions, self.kv_caches, metadata))


@torch.no_grad()
def hf_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits ``[len(token_ids), vocab]`` float32 for one sequence."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()


def load_both(
    folder: pathlib.Path, max_model_len: int | None = None
) -> tuple[torch.nn.Module, torch.nn.Module]:
    ours = load_model(folder, torch.float32, torch.device("cpu"), max_model_len=max_model_len)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return ours, theirs.eval()


PROMPT_A = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11, 2, 198, 1, 4093, 198, 19556, 28]
PROMPT_B = [
    1,
    4093,
    198,
    504,
    3575,
    282,
    4649,
    314,
    7042,
    30,
    2,
    198,
    1,
    520,
    9531,
    198,
    57,
    5248,
    253,
    1345,
    29,
    5248,
]

GRANITE = {
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "attention_multiplier": 0.15,
    "logits_scaling": 4.0,
}
# Phi-3.5-mini's rope_scaling, shrunk: one short and one long factor per rotary frequency.
PHI3_LONGROPE = {
    "original_max_position_embeddings": 8,
    "rope_scaling": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
        "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0],
    },
}

MIXTRAL = {"num_local_experts": 4, "num_experts_per_tok": 2}
QWEN3_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": False,
}

CASES = {
    "llama": ("llama", {}),
    "llama-untied-bias": (
        "llama",
        {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True},
    ),
    "llama-rope-llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
            "rope_theta": 500000.0,
        },
    ),
    "llama-rope-yarn": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 512,
            }
        },
    ),
    "mistral": ("mistral", {"sliding_window": None}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 7}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    # Granite 3.x: every multiplier away from 1 (granite-3.3-8b: 12, 0.22, 1/128, 16).
    "granite": ("granite", GRANITE),
    "granite-untied-bias": (
        "granite",
        {**GRANITE, "tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True},
    ),
    # Phi-3: fused qkv_proj / gate_up_proj checkpoints, no GQA (Phi-3-mini), untied.
    "phi3": ("phi3", {"num_key_value_heads": 4, "tie_word_embeddings": False}),
    "phi3-sliding-window": ("phi3", {"sliding_window": 7}),
    "phi3-partial-rotary": ("phi3", {"partial_rotary_factor": 0.75}),
    # Every forward of the test reaches position 8: transformers uses the long factors
    # throughout, as we do for a max_model_len (2048) above the original context.
    "phi3-longrope": ("phi3", PHI3_LONGROPE),
    # Phi-4-mini's layout: LongRoPE on the first 3/4 of each head (6 factors for 12 features).
    "phi3-longrope-partial-rotary": (
        "phi3",
        {
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 8,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": PHI3_LONGROPE["rope_scaling"]["short_factor"][:6],
                "long_factor": PHI3_LONGROPE["rope_scaling"]["long_factor"][:6],
            },
        },
    ),
    "gemma": ("gemma", {}),
    # Gemma-7B's shape: more query features (heads x head_dim) than hidden_size.
    "gemma-wide-heads": ("gemma", {"head_dim": 32, "num_key_value_heads": 4}),
    # Mixture of experts: 4 experts, top 2 (tests/engine/test_moe.py has the rest).
    "mixtral": ("mixtral", MIXTRAL),
    # A dense layer after a sparse one, top-k weights renormalised.
    "qwen3-moe": ("qwen3_moe", {**QWEN3_MOE, "mlp_only_layers": [1], "norm_topk_prob": True}),
    "qwen3-moe-unnormalised": ("qwen3_moe", QWEN3_MOE),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_decode_and_chunked_prefill_match_transformers(tiny_model_dir, case):
    architecture, overrides = CASES[case]
    ours, theirs = load_both(tiny_model_dir(architecture, **overrides))
    batch = PagedBatch(ours)

    # Two prompts prefilled together in one batch.
    logits = batch.forward(ours, [("a", PROMPT_A), ("b", PROMPT_B)])
    ref_a, ref_b = hf_logits(theirs, PROMPT_A), hf_logits(theirs, PROMPT_B)
    torch.testing.assert_close(logits[: len(PROMPT_A)], ref_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[len(PROMPT_A) :], ref_b, atol=ATOL, rtol=0)

    # Batched greedy decode reusing the cache; each step checked against a full recompute.
    seqs = {"a": list(PROMPT_A), "b": list(PROMPT_B)}
    last = {"a": logits[len(PROMPT_A) - 1], "b": logits[-1]}
    for _ in range(5):
        chunks = []
        for seq in seqs:
            token = int(last[seq].argmax())
            seqs[seq].append(token)
            chunks.append((seq, [token]))
        logits = batch.forward(ours, chunks)
        for row, seq in enumerate(seqs):
            last[seq] = logits[row]
            torch.testing.assert_close(
                logits[row], hf_logits(theirs, seqs[seq])[-1], atol=ATOL, rtol=0
            )

    # Chunked prefill of a new prompt, its second chunk batched with a decode of "a".
    chunked = PagedBatch(ours, seed=1)
    split = 9
    first = chunked.forward(ours, [("c", PROMPT_B[:split])])
    chunked.forward(ours, [("a", seqs["a"][:-1])])
    second = chunked.forward(ours, [("a", seqs["a"][-1:]), ("c", PROMPT_B[split:])])
    torch.testing.assert_close(torch.cat([first, second[1:]]), ref_b, atol=ATOL, rtol=0)
    torch.testing.assert_close(second[0], hf_logits(theirs, seqs["a"])[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "case",
    [
        "granite-untied-bias",
        "phi3-sliding-window",
        "phi3-longrope",
        "gemma-wide-heads",
        "mixtral",
        "qwen3-moe",
    ],
)
def test_greedy_generation_matches_transformers_generate(tiny_model_dir, case):
    """The whole engine (scheduler, paged cache, sampler) on the families beyond Llama/Qwen."""
    architecture, overrides = CASES[case]
    model_dir = tiny_model_dir(architecture, **overrides)
    # Every prompt longer than the LongRoPE case's original context (8), so that transformers
    # uses the long factors from the first forward on.
    prompts = [PROMPT_A, PROMPT_B, PROMPT_B[3:15]]
    llm = LLM(str(model_dir), max_model_len=256, dtype="float32")
    assert generate_ids(llm, prompts, greedy()) == hf_greedy(model_dir, prompts, NEW_TOKENS)
    assert_no_leak(llm.llm_engine)


def test_longrope_short_factors_while_max_model_len_fits_the_original_context(tiny_model_dir):
    folder = tiny_model_dir("phi3", **{**PHI3_LONGROPE, "original_max_position_embeddings": 64})
    # Up to 64 tokens transformers rotates with the short factors, as we do for max_model_len 64.
    short, theirs = load_both(folder, max_model_len=64)
    logits = PagedBatch(short).forward(short, [("a", PROMPT_A), ("b", PROMPT_B)])
    torch.testing.assert_close(
        logits[: len(PROMPT_A)], hf_logits(theirs, PROMPT_A), atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        logits[len(PROMPT_A) :], hf_logits(theirs, PROMPT_B), atol=ATOL, rtol=0
    )
    # A longer max_model_len takes the long factors for every position, short prompts included.
    long = load_model(folder, torch.float32, torch.device("cpu"))
    assert not torch.equal(long.model.rotary_emb.inv_freq, short.model.rotary_emb.inv_freq)
    logits = PagedBatch(long).forward(long, [("a", PROMPT_A)])
    assert (logits - hf_logits(theirs, PROMPT_A)).abs().max() > 10 * ATOL
    # The engine builds its model for its own max_model_len.
    engine_model = LLM(str(folder), max_model_len=64).llm_engine.executor.worker.model
    assert torch.equal(engine_model.model.rotary_emb.inv_freq, short.model.rotary_emb.inv_freq)


def test_linear_rope_scaling_serves_past_max_position_embeddings_as_vllm_does(tiny_model_dir):
    # Trained for 16 positions, stretched 4x: vLLM's derived max_model_len is 64, the default
    # here too (the planner sizes pods with it), and positions past 16 match transformers.
    folder = tiny_model_dir(
        "llama", max_position_embeddings=16, rope_scaling={"rope_type": "linear", "factor": 4.0}
    )
    llm = LLM(str(folder), dtype="float32")
    assert llm.llm_engine.scheduler_config.max_model_len == 64
    prompts = [PROMPT_A, PROMPT_B]  # 16 and 20 tokens, then 24 more each
    assert generate_ids(llm, prompts, greedy(24)) == hf_greedy(folder, prompts, 24)
    assert_no_leak(llm.llm_engine)
    with pytest.raises(ValueError) as refused:
        LLM(str(folder), max_model_len=65)
    assert str(refused.value) == (
        "max_model_len 65 exceeds the model's max_position_embeddings (64; "
        "max_position_embeddings 16 stretched by the rope_scaling factor)"
    )


def test_dynamic_ntk_takes_the_frequencies_for_max_model_len(tiny_model_dir):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    folder = tiny_model_dir(
        "llama", max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
    )
    config = transformers.AutoConfig.from_pretrained(folder)
    for max_model_len in (16, 32):  # transformers' own up to 16; its NTK base for 32 past it
        model = LLM(str(folder), max_model_len=max_model_len).llm_engine.executor.worker.model
        expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=max_model_len)
        assert torch.equal(model.model.rotary_emb.inv_freq, expected)
    short, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=16)
    assert not torch.equal(expected, short)


def test_phi3_su_rope_scaling_is_read_as_longrope(tiny_model_dir, tmp_path):
    # Phi-3-mini-128k's first release named LongRoPE "su", beside a top-level
    # original_max_position_embeddings that transformers then misses; vLLM renames it.
    folder = tiny_model_dir("phi3", **PHI3_LONGROPE)
    su = tmp_path / "su"
    shutil.copytree(folder, su)
    config = json.loads((su / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope["rope_theta"]
    config["rope_scaling"] = {
        "type": "su",
        "short_factor": rope["short_factor"],
        "long_factor": rope["long_factor"],
    }
    (su / "config.json").write_text(json.dumps(config))
    prompts = [PROMPT_A, PROMPT_B]  # past the original context (8): the long factors
    llm = LLM(str(su), max_model_len=256, dtype="float32")
    assert generate_ids(llm, prompts, greedy()) == hf_greedy(folder, prompts, NEW_TOKENS)


def test_bfloat16_model_tracks_float32(tiny_model_dir):
    folder = tiny_model_dir("qwen3")
    fp32 = load_model(folder, torch.float32, torch.device("cpu"))
    bf16 = load_model(folder, torch.bfloat16, torch.device("cpu"))
    assert bf16.dtype == torch.bfloat16
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    ref = PagedBatch(fp32).forward(fp32, [("a", PROMPT_A)])
    got = PagedBatch(bf16).forward(bf16, [("a", PROMPT_A)])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=0.05, rtol=0.05)


def test_gemma_layers_round_like_transformers_in_bfloat16():
    """The float32 logits tests cannot see roundings: here each Gemma-specific piece is bit for
    bit transformers' on bfloat16 inputs."""
    from transformers.activations import ACT2FN
    from transformers.models.gemma import modeling_gemma

    from kvpilot.engine.layers.activation import get_act_and_mul
    from kvpilot.engine.layers.layernorm import GemmaRMSNorm
    from kvpilot.engine.models.gemma import GemmaForCausalLM

    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 5, 3072, generator=gen).bfloat16()
    weight = (torch.randn(3072, generator=gen) * 0.1).bfloat16()
    theirs = modeling_gemma.GemmaRMSNorm(3072, 1e-6).bfloat16()
    ours = GemmaRMSNorm(3072, 1e-6)
    theirs.weight.data = ours.weight.data = weight
    assert torch.equal(ours(x), theirs(x))
    out, new_residual = ours(x, residual)
    assert torch.equal(new_residual, x + residual) and torch.equal(out, theirs(x + residual))
    # GeGLU on the stacked [gate | up] output, as GemmaMLP's act(gate(x)) * up(x).
    gelu = get_act_and_mul("gelu_pytorch_tanh")
    stacked = torch.cat([x, residual], dim=-1)
    assert torch.equal(gelu(stacked), ACT2FN["gelu_pytorch_tanh"](x) * residual)
    # sqrt(3072) = 55.43 is 55.5 in bfloat16: the embeddings are scaled by the rounded factor.
    config = transformers.GemmaConfig(hidden_size=3072)
    options = GemmaForCausalLM.model_options(config, torch.bfloat16)
    embedding = modeling_gemma.GemmaTextScaledWordEmbedding(8, 3072, 0, 3072**0.5).bfloat16()
    ids = torch.arange(8)
    assert options.embedding_multiplier == 55.5
    assert torch.equal(embedding.weight[ids] * options.embedding_multiplier, embedding(ids))


def test_model_attributes(tiny_model_dir):
    model = load_model(tiny_model_dir("qwen3", head_dim=32), torch.float32, torch.device("cpu"))
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 2, 32)
    assert model.vocab_size == 49152
    assert model.dtype == torch.float32
    assert model.config.model_type == "qwen3"


@pytest.mark.slow
def test_default_model_greedy_tokens_match_transformers_generate(default_model_dir):
    ours, theirs = load_both(default_model_dir)
    tokenizer = load_tokenizer(default_model_dir)
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers.",
    ]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for q in questions
    ]
    max_new_tokens = 12
    batch = PagedBatch(ours)
    chunks = [(str(i), p) for i, p in enumerate(prompts)]
    ours_tokens: list[list[int]] = [[] for _ in prompts]
    logits = batch.forward(ours, chunks)
    last_rows = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    last = logits[last_rows]
    for _ in range(max_new_tokens):
        chunks = []
        for i, row in enumerate(last):
            ours_tokens[i].append(int(row.argmax()))
            chunks.append((str(i), ours_tokens[i][-1:]))
        last = batch.forward(ours, chunks)
    for prompt, tokens in zip(prompts, ours_tokens, strict=True):
        assert tokens == hf_generate(theirs, prompt, max_new_tokens)


def test_cpu_gemm_linear_matches_float64_and_follows_weight_updates():
    from kvpilot.engine.layers.cpu_gemm import linear

    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(96, 64, generator=gen), requires_grad=False)
    bias = torch.randn(96, generator=gen)
    x = torch.randn(2, 5, 64, generator=gen)
    expected = (x.double() @ weight.double().T + bias.double()).float()
    torch.testing.assert_close(linear(x, weight, bias), expected, atol=1e-4, rtol=1e-5)
    # The packed copy must follow in-place updates (weight loading) and replaced storage.
    with torch.no_grad():
        weight.mul_(-2)
    torch.testing.assert_close(linear(x, weight), x @ weight.T, atol=1e-4, rtol=1e-5)
    weight.data = torch.randn(96, 64, generator=gen)
    torch.testing.assert_close(linear(x, weight), x @ weight.T, atol=1e-4, rtol=1e-5)
    # Other dtypes are F.linear's business, bit for bit.
    x16, w16 = x.bfloat16(), weight.detach().bfloat16()
    assert torch.equal(linear(x16, w16), torch.nn.functional.linear(x16, w16))


@pytest.mark.parametrize("tie_word_embeddings", [True, False])
def test_prepacked_linear_weights_keep_one_copy_and_the_same_logits(
    tiny_model_dir, tie_word_embeddings
):
    from kvpilot.engine.layers.cpu_gemm import is_packed
    from kvpilot.engine.layers.linear import Linear, prepack_linear_weights

    model, hf = load_both(tiny_model_dir("llama", tie_word_embeddings=tie_word_embeddings))
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    dense_bytes = sum(m.weight.nbytes for m in linears)
    if not tie_word_embeddings:
        dense_bytes += model.lm_head.weight.nbytes

    assert prepack_linear_weights(model) == dense_bytes
    assert all(is_packed(m.weight) for m in linears)
    # A tied head shares the embedding table, which lookups need dense.
    assert is_packed(model.lm_head.weight) is not tie_word_embeddings
    assert not is_packed(model.model.embed_tokens.weight)
    assert prepack_linear_weights(model) == 0  # nothing left to pack
    logits = PagedBatch(model).forward(model, [("a", PROMPT_A)])
    torch.testing.assert_close(logits, hf_logits(hf, PROMPT_A), atol=ATOL, rtol=ATOL)


def test_prepacked_weights_share_one_buffer_a_batch(tiny_model_dir, monkeypatch):
    from kvpilot.engine.layers import linear as linear_module
    from kvpilot.engine.layers.linear import Linear, prepack_linear_weights
    from kvpilot.kernels.cpu import gemm

    if not gemm.available():
        pytest.skip("the panels (and their buffers) are the AVX-512 kernel's")
    model, hf = load_both(tiny_model_dir("llama", tie_word_embeddings=False))
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    largest = max(m.weight.nbytes for m in linears)
    # Batches of at most two of the largest weights: several buffers, each shared.
    monkeypatch.setattr(linear_module, "PREPACK_BATCH_BYTES", 2 * largest)
    prepack_linear_weights(model)
    buffers = [m.weight.panels.untyped_storage().data_ptr() for m in linears]
    assert 1 < len(set(buffers)) < len(linears)
    for m in linears:  # each weight's panels are a contiguous slice of its batch's buffer
        assert m.weight.panels.is_contiguous()
    logits = PagedBatch(model).forward(model, [("a", PROMPT_A)])
    torch.testing.assert_close(logits, hf_logits(hf, PROMPT_A), atol=ATOL, rtol=ATOL)


def test_prepack_leaves_other_dtypes_dense_beside_packed_float32():
    from kvpilot.engine.layers.cpu_gemm import is_packed, linear, prepack

    gen = torch.Generator().manual_seed(3)
    weights = [
        torch.randn(40, 24, generator=gen),
        torch.randn(8, 24, generator=gen).bfloat16(),  # a quantized layer's would be fp8
        torch.randn(33, 24, generator=gen),
        torch.zeros(10, dtype=torch.uint8),  # packed int4 bytes, say: any shape
    ]
    packed = prepack(weights)
    assert packed[1] is None and packed[3] is None
    x = torch.randn(5, 24, generator=gen)
    for weight, copy in zip(weights[0:3:2], packed[0:3:2], strict=True):
        assert copy is not None and is_packed(copy) and copy.shape == weight.shape
        torch.testing.assert_close(linear(x, copy), x @ weight.T, atol=1e-5, rtol=1e-5)


def test_prepack_batches_hold_at_most_the_limit_or_one_larger_weight():
    from kvpilot.engine.layers.linear import _batches

    modules = [torch.nn.Linear(n, 1, bias=False) for n in (4, 4, 9, 1, 2)]  # 16, 16, 36, 4, 8 B
    sizes = [[m.weight.nbytes for m in batch] for batch in _batches(modules, 32)]
    assert sizes == [[16, 16], [36], [4, 8]]
    assert list(_batches([], 32)) == []
