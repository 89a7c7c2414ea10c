"""Helpers shared by the tensor- and pipeline-parallel tests: an engine with an exact number
of KV blocks on every rank, greedy generation with logprobs, and the comparison against one
rank."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.distributed.pipeline import max_stage_layers
from kvpilot.engine.model_shape import ModelShape

BLOCK_SIZE = 4
LOGPROB_ATOL = 1e-4


def model_shape(model_dir: pathlib.Path) -> ModelShape:
    return ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))


def make_llm(
    model_dir: pathlib.Path, tp: int, num_blocks: int, pp: int = 1, backend: str = "mp", **kwargs
) -> LLM:
    """An engine over ``tp x pp`` ranks with exactly ``num_blocks`` KV blocks on each rank."""
    spec = model_shape(model_dir)
    per_rank = spec.kv_bytes_per_token(4, tp) * max_stage_layers(spec.num_layers, pp)
    bytes_per_token = per_rank // spec.num_layers
    return LLM(
        str(model_dir),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend=backend,
        dtype="float32",
        max_model_len=64,
        block_size=BLOCK_SIZE,
        kv_cache_memory=num_blocks * BLOCK_SIZE * bytes_per_token,
        enable_prefix_caching=False,
        **kwargs,
    )


def generate(llm: LLM, prompts: list, max_tokens: int) -> tuple[list, list, int]:
    """Greedy tokens, per-token top-2 logprobs ``{token: (logprob, rank)}`` and preemptions."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    logprobs = [
        [{t: (lp.logprob, lp.rank) for t, lp in step.items()} for step in o.logprobs]
        for o in outputs
    ]
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return [o.token_ids for o in outputs], logprobs, stats.num_preemptions_total


def assert_same_generation(expected: tuple, actual: tuple) -> None:
    """Same greedy tokens and preemptions (at least one), top-2 logprobs equal to rounding."""
    tokens, logprobs, preemptions = actual
    assert tokens == expected[0]
    assert preemptions == expected[2] > 0
    for seq_expected, seq_actual in zip(expected[1], logprobs, strict=True):
        for top_expected, top_actual in zip(seq_expected, seq_actual, strict=True):
            assert top_actual.keys() == top_expected.keys()
            for token, (logprob, rank) in top_expected.items():
                assert top_actual[token][1] == rank
                assert top_actual[token][0] == pytest.approx(logprob, abs=LOGPROB_ATOL)


def random_prompts(lengths: list[int], seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [
        {"prompt_token_ids": torch.randint(3, 49000, (n,), generator=generator).tolist()}
        for n in lengths
    ]
