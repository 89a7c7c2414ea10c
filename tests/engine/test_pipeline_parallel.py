"""Pipeline parallelism on CPU with gloo (``mp`` executor): stages of layers in separate
processes, alone and with tensor parallelism inside each stage, must reproduce one process.

As in test_tensor_parallel.py, every engine has the same number of KV blocks as the one-rank
engine it is compared with, so both schedule the same batches and preempt the same requests:
greedy tokens identical, top-2 logprobs equal to float32 rounding. The stage split and the
per-stage KV cache are read back from the workers.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from kvpilot.engine import LLM
from kvpilot.engine.config import EngineArgs
from kvpilot.engine.distributed import parallel_state
from kvpilot.engine.distributed.pipeline import get_pp_indices
from kvpilot.engine.model_loader import load_model
from tests.engine.parallel_helpers import (
    BLOCK_SIZE,
    assert_same_generation,
    generate,
    make_llm,
    model_shape,
    random_prompts,
)

# 5 requests needing 31 blocks in all share 16: some are preempted and recomputed.
PROMPT_LENGTHS = [1, 7, 9, 17, 33]
NUM_BLOCKS = 16


def test_layers_split_as_vllm_splits_them():
    assert [get_pp_indices(30, r, 4) for r in range(4)] == [(0, 7), (7, 15), (15, 23), (23, 30)]
    assert [get_pp_indices(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [get_pp_indices(3, r, 3) for r in range(3)] == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="num_hidden_layers 2 is smaller than"):
        get_pp_indices(2, 0, 3)


def test_parallel_flags_are_vllms():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    argv = ["-tp", "2", "-pp", "3", "--distributed-executor-backend", "ray"]
    args = EngineArgs.from_cli_args(
        parser.parse_args([*argv, "--distributed-timeout-seconds", "30"])
    )
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 3)
    assert (args.distributed_executor_backend, args.distributed_timeout_seconds) == ("ray", 30)
    defaults = EngineArgs()
    assert (defaults.pipeline_parallel_size, defaults.distributed_executor_backend) == (1, "mp")
    for kwargs, name in [
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size"),
        ({"distributed_executor_backend": "mpi"}, "distributed_executor_backend"),
        ({"distributed_timeout_seconds": 0}, "distributed_timeout_seconds"),
        ({"pipeline_parallel_size": 2, "enable_lora": True}, "enable_lora"),
        (
            {
                "pipeline_parallel_size": 2,
                "speculative_config": {"model": "d", "num_speculative_tokens": 2},
            },
            "speculative_config",
        ),
    ]:
        with pytest.raises(ValueError, match=f"^{name} "):
            EngineArgs(**kwargs)


def test_more_stages_than_layers_is_refused(tiny_model_dir):
    with pytest.raises(
        ValueError, match="num_hidden_layers 2 is smaller than pipeline_parallel_size 3"
    ):
        LLM(str(tiny_model_dir("llama")), pipeline_parallel_size=3)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_each_stage_holds_only_its_layers(tiny_model_dir, monkeypatch, tied):
    """No process group needed: a model reads its stage when built. The last stage of a tied
    model gets its own copy of the embedding table as its LM head."""
    model_dir = tiny_model_dir("llama", num_hidden_layers=3, tie_word_embeddings=tied)
    full = load_model(model_dir, torch.float32, "cpu")
    whole = dict(full.named_parameters())
    held = []
    for stage in range(2):
        state = parallel_state.PipelineParallelState(stage, 2)
        monkeypatch.setattr(parallel_state, "_PP_STATE", state)
        part = load_model(model_dir, torch.float32, "cpu")
        params = dict(part.named_parameters())
        held.append(set(params))
        for name, param in params.items():
            source = "model.embed_tokens.weight" if name == "lm_head.weight" and tied else name
            assert torch.equal(param, whole[source]), name
        assert part.num_layers == (2, 1)[stage]
    first, last = held
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert "model.norm.weight" in last and "lm_head.weight" in last
    assert not any(n.startswith(("model.layers.2.", "model.norm.")) for n in first)
    assert not any(n.startswith(("model.layers.0.", "model.layers.1.")) for n in last)
    assert first.isdisjoint(last)
    assert first | last == set(whole) | ({"lm_head.weight"} if tied else set())


@pytest.fixture(scope="module")
def single_rank_reference(tiny_model_dir):
    """Greedy generation of the 3-layer tiny model on one rank, and the model folder."""
    model_dir = tiny_model_dir("llama", num_hidden_layers=3)
    llm = make_llm(model_dir, 1, NUM_BLOCKS)
    return model_dir, generate(llm, random_prompts(PROMPT_LENGTHS), max_tokens=12)


@pytest.mark.parametrize(
    "tp,pp",
    [(1, 2), pytest.param(2, 2, marks=pytest.mark.slow)],  # 4 processes on 2 cores: slow
    ids=["pp2", "tp2xpp2"],
)
def test_stages_match_one_rank_under_batching_and_preemption(single_rank_reference, tp, pp):
    model_dir, expected = single_rank_reference
    llm = make_llm(model_dir, tp, NUM_BLOCKS, pp=pp)
    try:
        assert_same_generation(
            expected, generate(llm, random_prompts(PROMPT_LENGTHS), max_tokens=12)
        )
        executor = llm.llm_engine.executor
        # Ranks stage by stage; the 3 layers split 2 + 1; each rank's cache holds its stage's.
        stages = [(0, 0, 2)] * tp + [(1, 2, 3)] * tp
        assert executor.collective_rpc("stage") == stages
        spec = model_shape(model_dir)
        per_layer = spec.kv_bytes_per_token(4, tp) // spec.num_layers * BLOCK_SIZE * NUM_BLOCKS
        assert executor.collective_rpc("kv_cache_bytes") == [2 * per_layer] * tp + [per_layer] * tp
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
def test_two_stages_match_one_on_the_default_model(default_model_dir):
    """SmolLM2-135M: 30 layers in two stages of 15; its tied head is copied onto stage 1."""
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
    ]
    # The three requests need 11 blocks of 4 tokens; 9 blocks force preemption.
    expected = generate(make_llm(default_model_dir, 1, 9), prompts, max_tokens=6)
    llm = make_llm(default_model_dir, 1, 9, pp=2)
    try:
        assert_same_generation(expected, generate(llm, prompts, max_tokens=6))
        assert llm.llm_engine.executor.collective_rpc("stage") == [(0, 0, 15), (1, 15, 30)]
    finally:
        llm.llm_engine.shutdown()
