"""Our model implementations against transformers on the same weights.

Every forward goes through the paged KV cache with random, non-contiguous block tables: prefill
of several sequences in one batch, batched decode, chunked prefill mixed with decode. Logits
must match transformers' to float32 rounding, and on the real default model greedy decoding
must pick the same tokens as transformers' ``generate``.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import transformers

from kvpilot.engine.attention import AttentionMetadata
from kvpilot.engine.model_loader import load_model, load_tokenizer
from tests.engine.helpers import hf_generate

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


def load_both(folder: pathlib.Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    ours = load_model(folder, torch.float32, torch.device("cpu"))
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
    from kvpilot.engine.layers.linear import Linear, prepack_linear_weights

    model, hf = load_both(tiny_model_dir("llama", tie_word_embeddings=tie_word_embeddings))
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    dense_bytes = sum(m.weight.nbytes for m in linears)
    if not tie_word_embeddings:
        dense_bytes += model.lm_head.weight.nbytes

    assert prepack_linear_weights(model) == dense_bytes
    assert all(m.weight.is_mkldnn for m in linears)
    # A tied head shares the embedding table, which lookups need dense.
    assert model.lm_head.weight.is_mkldnn is not tie_word_embeddings
    assert not model.model.embed_tokens.weight.is_mkldnn
    assert prepack_linear_weights(model) == 0  # nothing left to pack
    logits = PagedBatch(model).forward(model, [("a", PROMPT_A)])
    torch.testing.assert_close(logits, hf_logits(hf, PROMPT_A), atol=ATOL, rtol=ATOL)
