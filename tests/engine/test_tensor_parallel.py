"""Tensor parallelism on CPU with gloo: N worker processes must reproduce one process.

Every multi-rank engine is checked against the same engine on one rank, with the same number
of KV blocks (so both schedule the same batches and preempt the same requests): greedy tokens
must be identical and the logprobs of the top tokens equal to float32 rounding (the row-parallel
all-reduce sums partial products in another order than one matmul does, so the last bits may
differ; see docs/benchmarks.md, "Tensor parallelism"). Per-rank sizes are measured in the
worker processes and checked against the planner's ``ModelShape``, which the operator sizes GPUs
with.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.async_llm import AsyncLLM, EngineError
from kvpilot.engine.distributed import parallel_state
from kvpilot.engine.executor import EngineDeadError, MultiprocExecutor, WorkerConfig
from kvpilot.engine.model_loader import load_model
from kvpilot.engine.model_shape import check_tensor_parallel_size
from kvpilot.engine.sampling_params import StructuredOutputsParams
from tests.engine.parallel_helpers import (
    BLOCK_SIZE,
    assert_same_generation,
    generate,
    make_llm,
    model_shape,
    random_prompts,
)


def tp_workers() -> list[multiprocessing.process.BaseProcess]:
    """This process's live tensor-parallel worker processes."""
    return [p for p in multiprocessing.active_children() if p.name.startswith("kvpilot-tp-")]


def test_unshardable_sizes_are_refused_with_the_planners_message(default_model_dir, tiny_model_dir):
    # SmolLM2: 9 query heads, 3 KV heads; tiny: 4 query heads, 2 KV heads, 128 MLP channels.
    tiny = tiny_model_dir("llama")
    messages = []
    for model_dir, tp in [(default_model_dir, 2), (tiny, 3), (tiny, 8)]:
        with pytest.raises(ValueError) as planner:
            check_tensor_parallel_size(model_shape(model_dir), tp)
        with pytest.raises(ValueError) as engine:
            LLM(str(model_dir), tensor_parallel_size=tp)
        with pytest.raises(ValueError) as executor:
            MultiprocExecutor(
                WorkerConfig(
                    model_dir, torch.float32, torch.device("cpu"), "torch", 16, 0, frozenset(), tp
                )
            )
        assert str(engine.value) == str(executor.value) == str(planner.value)
        messages.append(str(engine.value))
    assert messages == [
        "num_attention_heads 9 is not divisible by tensor_parallel_size 2",
        "num_attention_heads 4 is not divisible by tensor_parallel_size 3",
        "num_attention_heads 4 is not divisible by tensor_parallel_size 8",
    ]
    assert tp_workers() == []


def test_more_ranks_than_gpus_is_refused(tiny_model_dir):
    available = torch.cuda.device_count()
    tp = available + 1
    # A model that tp ranks can shard, so that only the device count is wrong.
    model_dir = tiny_model_dir(
        "llama", num_attention_heads=tp, num_key_value_heads=1, intermediate_size=128 * tp
    )
    config = WorkerConfig(
        model_dir, torch.float32, torch.device("cuda"), "triton", 16, 0, frozenset(), tp
    )
    with pytest.raises(ValueError, match=f"needs one GPU per rank; this node has {available}"):
        MultiprocExecutor(config)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        # One KV head on two ranks: replicated. An untied head, biases and an odd vocabulary
        # (a padding row on the last rank) exercise every weight loader.
        dict(
            num_key_value_heads=1,
            tie_word_embeddings=False,
            attention_bias=True,
            mlp_bias=True,
            vocab_size=49151,
        ),
    ],
    ids=["gqa-tied", "kv-replicated-untied-bias"],
)
def test_two_ranks_match_one_under_batching_and_preemption(tiny_model_dir, overrides):
    model_dir = tiny_model_dir("llama", **overrides)
    spec = model_shape(model_dir)
    # 5 requests needing 31 blocks in all share 16: some are preempted and recomputed.
    prompts, num_blocks = random_prompts([1, 7, 9, 17, 33]), 16
    single = make_llm(model_dir, 1, num_blocks)
    expected = generate(single, prompts, max_tokens=12)
    whole_bytes = single.llm_engine.executor.worker.weight_bytes()
    llm = make_llm(model_dir, 2, num_blocks)
    try:
        assert_same_generation(expected, generate(llm, prompts, max_tokens=12))
        executor = llm.llm_engine.executor
        # Measured in each worker: the planner's per-GPU sizes, about half of the whole.
        weight_bytes = executor.collective_rpc("weight_bytes")
        assert whole_bytes == spec.weight_bytes(4, 1)
        assert weight_bytes == [spec.weight_bytes(4, 2)] * 2
        assert max(weight_bytes) < 0.51 * whole_bytes
        kv_block_bytes = spec.kv_bytes_per_token(4, 2) * BLOCK_SIZE
        assert executor.collective_rpc("kv_cache_bytes") == [num_blocks * kv_block_bytes] * 2
    finally:
        llm.llm_engine.shutdown()


def test_structured_outputs_reach_every_rank(tiny_model_dir):
    # The grammar bitmask travels to the workers inside the SchedulerOutput.
    model_dir = tiny_model_dir("llama")
    constraint = StructuredOutputsParams(regex="[a-z]+( [0-9]+)?")
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, structured_outputs=constraint
    )
    prompts = random_prompts([3, 9])
    expected = make_llm(model_dir, 1, 64).generate(prompts, params, use_tqdm=False)
    llm = make_llm(model_dir, 2, 64)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    # A prefix of the language when max_tokens cuts it.
    assert all(re.fullmatch("[a-z]+( [0-9]*)?", o.outputs[0].text) for o in outputs)


@pytest.mark.parametrize("architecture", ["llama", "phi3"])
@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_loads_its_megatron_shard(tiny_model_dir, monkeypatch, tp, architecture):
    """Rank r's tensors are the right slices of the checkpoint (no process group needed: the
    layers only read the rank and size when built). 2 KV heads: split over 2 ranks, replicated
    over 4 (ranks 0-1 hold head 0, ranks 2-3 head 1). Phi-3's checkpoint stores q/k/v and
    gate/up fused: each rank cuts its pieces out of the fused tensors."""
    model_dir = tiny_model_dir(architecture)
    full = load_model(model_dir, torch.float32, "cpu")
    config, head_dim = full.config, full.head_dim
    q_rows = config.num_attention_heads * head_dim // tp
    for rank in range(tp):
        monkeypatch.setattr(parallel_state, "_STATE", parallel_state.TensorParallelState(rank, tp))
        shard = load_model(model_dir, torch.float32, "cpu")
        kv_head = rank * config.num_key_value_heads // tp
        whole_attn, attn = full.model.layers[1].self_attn, shard.model.layers[1].self_attn
        q, k, v = whole_attn.qkv_proj.split(whole_attn.qkv_proj.weight.T)
        expected_qkv = torch.cat(
            [
                q.T[rank * q_rows : (rank + 1) * q_rows],
                k.T[kv_head * head_dim : (kv_head + 1) * head_dim],
                v.T[kv_head * head_dim : (kv_head + 1) * head_dim],
            ]
        )
        assert torch.equal(attn.qkv_proj.weight, expected_qkv)
        assert (attn.num_heads, attn.num_kv_heads, shard.num_kv_heads) == (4 // tp, 1, 1)
        o_cols = slice(rank * q_rows, (rank + 1) * q_rows)
        assert torch.equal(attn.o_proj.weight, whole_attn.o_proj.weight[:, o_cols])
        width = config.intermediate_size // tp
        gate, up = full.model.layers[1].mlp.gate_up_proj.weight.split(config.intermediate_size)
        rows = slice(rank * width, (rank + 1) * width)
        assert torch.equal(
            shard.model.layers[1].mlp.gate_up_proj.weight, torch.cat([gate[rows], up[rows]])
        )
        vocab_rows = slice(rank * config.vocab_size // tp, (rank + 1) * config.vocab_size // tp)
        assert torch.equal(
            shard.model.embed_tokens.weight, full.model.embed_tokens.weight[vocab_rows]
        )
        assert shard.lm_head.weight is shard.model.embed_tokens.weight


@pytest.mark.timeout(120)
def test_a_dead_worker_takes_the_engine_down_with_a_clear_error(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), 2, num_blocks=16)
    engine = llm.llm_engine
    try:
        engine.check_health()
        victim = engine.executor.worker_pids[1]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=rf"rank 1 \(pid {victim}\) died") as dead:
            generate(llm, random_prompts([5, 6]), max_tokens=4)
        assert "exit code -9" in str(dead.value)
        # The survivor is stopped too, and the engine stays down, naming the cause.
        assert tp_workers() == []
        with pytest.raises(EngineDeadError, match="rank 1"):
            engine.check_health()
        with pytest.raises(EngineDeadError, match="rank 1"):
            engine.step()
    finally:
        engine.shutdown()


@pytest.mark.timeout(120)
async def test_the_server_loop_reports_a_dead_worker_and_refuses_new_requests(tiny_model_dir):
    engine = make_llm(tiny_model_dir("llama"), 2, num_blocks=16).llm_engine
    served = AsyncLLM(engine)
    served.start()
    try:
        await served.check_health()
        params = SamplingParams(temperature=0, max_tokens=4)
        stream = await served.add_request("ok", {"prompt_token_ids": [5, 6, 7]}, params)
        assert len([o async for o in stream][-1].outputs[0].token_ids) == 4
        victim = engine.executor.worker_pids[1]
        os.kill(victim, signal.SIGKILL)
        stream = await served.add_request("hit", {"prompt_token_ids": [5, 6, 7]}, params)
        with pytest.raises(EngineError, match="rank 1"):
            [o async for o in stream]
        # /health asks check_health: it names the dead rank; new requests are refused.
        with pytest.raises(EngineDeadError, match=rf"rank 1 \(pid {victim}\) died"):
            await served.check_health()
        with pytest.raises(EngineError, match="the engine is dead"):
            await served.add_request("after", {"prompt_token_ids": [5, 6, 7]}, params)
    finally:
        await served.shutdown()
        engine.shutdown()


@pytest.mark.slow
def test_three_ranks_match_one_on_the_default_model(default_model_dir):
    """SmolLM2-135M: 9 query heads and 3 KV heads over 3 ranks (3 and 1 per rank)."""
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
    ]
    # The three requests need 11 blocks of 4 tokens; 9 blocks force preemption.
    single = make_llm(default_model_dir, 1, num_blocks=9)
    expected = generate(single, prompts, max_tokens=6)
    whole_bytes = single.llm_engine.executor.worker.weight_bytes()
    llm = make_llm(default_model_dir, 3, num_blocks=9)
    try:
        assert_same_generation(expected, generate(llm, prompts, max_tokens=6))
        weight_bytes = llm.llm_engine.executor.collective_rpc("weight_bytes")
        assert weight_bytes == [model_shape(default_model_dir).weight_bytes(4, 3)] * 3
        assert max(weight_bytes) < 0.34 * whole_bytes
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow  # ~30 s: a 3 s collective timeout and a 5 s grace after the start-up
@pytest.mark.timeout(120)
def test_a_rank_that_stops_answering_takes_the_engine_down_within_the_timeout(tiny_model_dir):
    # Start-up is not held to the collective timeout (a 3 s rendezvous would race the imports).
    llm = make_llm(tiny_model_dir("llama"), 2, num_blocks=16, distributed_timeout_seconds=3)
    engine = llm.llm_engine
    try:
        victim = engine.executor.worker_pids[1]
        os.kill(victim, signal.SIGSTOP)
        # Rank 0's all-reduce gives up after 3 s; rank 1 is named as the silent one.
        with pytest.raises(EngineDeadError, match=r"rank\(s\) 1 had not answered") as dead:
            generate(llm, random_prompts([5, 6]), max_tokens=4)
        assert "worker rank 0 failed during execute_step" in str(dead.value)
        assert tp_workers() == []
        with pytest.raises(EngineDeadError, match="rank"):
            engine.check_health()
    finally:
        engine.shutdown()
