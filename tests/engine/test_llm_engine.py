"""The whole engine on real weights: greedy tokens identical to transformers' ``generate()``
whatever the batch composition, block size or preemption; no block leak; bad input refused.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

from kvpilot.engine import LLM, LLMEngine, SamplingParams
from kvpilot.engine.config import CPU_BLOCK_SIZE, EngineArgs
from tests.engine.helpers import NEW_TOKENS, assert_no_leak, generate_ids, greedy, hf_greedy

# K and V of the tiny test models: 2 layers x 2 KV heads x head_dim 16, float32.
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4
# Lengths around block boundaries of 8, 16 and 32.
PROMPT_LENS = [1, 7, 8, 9, 16, 17, 33, 50]


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir) -> pathlib.Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENS)


@pytest.fixture(scope="module")
def llama_reference(llama_dir, prompts) -> list[list[int]]:
    return hf_greedy(llama_dir, prompts, NEW_TOKENS)


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers_all_prompts_together(tiny_model_dir, architecture, prompts):
    model_dir = tiny_model_dir(architecture)
    llm = LLM(str(model_dir), max_model_len=256)
    assert generate_ids(llm, prompts, greedy()) == hf_greedy(model_dir, prompts, NEW_TOKENS)
    assert_no_leak(llm.llm_engine)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_same_tokens_whatever_the_batch_composition(
    llama_dir, prompts, llama_reference, block_size
):
    llm = LLM(str(llama_dir), block_size=block_size, max_model_len=256, max_num_batched_tokens=64)
    engine = llm.llm_engine
    # One at a time.
    assert [generate_ids(llm, [p], greedy())[0] for p in prompts[:3]] == llama_reference[:3]
    # Staggered: a new request joins every other step while the others decode.
    pending = list(enumerate(prompts))
    results: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:
            i, p = pending.pop()
            engine.add_request(f"s{i}", {"prompt_token_ids": p}, greedy())
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert [results[f"s{i}"] for i in range(len(prompts))] == llama_reference
    assert_no_leak(engine)


def test_forced_preemption_completes_every_request_with_the_same_tokens(
    llama_dir, prompts, llama_reference
):
    # Room for 160 tokens (20 blocks of the CPU's 8), while the 8 requests need 141 + 8 * 24.
    llm = LLM(
        str(llama_dir),
        max_model_len=128,
        kv_cache_memory=160 * TINY_KV_BYTES_PER_TOKEN,
        enable_prefix_caching=False,
    )
    engine = llm.llm_engine
    assert engine.get_stats().num_total_blocks == 160 // CPU_BLOCK_SIZE
    assert generate_ids(llm, prompts, greedy()) == llama_reference
    assert engine.get_stats().num_preemptions_total > 0
    assert_no_leak(engine)


def test_no_block_leak_after_abort_mid_generation(llama_dir, prompts):
    llm = LLM(str(llama_dir), max_model_len=256, max_num_batched_tokens=32)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, greedy())
    for _ in range(4):  # some running, some mid-prefill, some still waiting
        engine.step()
    assert engine.get_stats().kv_cache_usage > 0
    engine.abort_request(["0", "3", "5"])
    engine.abort_request("unknown")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].finish_reason
    assert finished == {str(i): "length" for i in (1, 2, 4, 6, 7)}
    assert_no_leak(engine)
    # Aborted ids can be reused.
    engine.add_request("0", {"prompt_token_ids": prompts[0]}, greedy(max_tokens=2))
    engine.abort_request("0")
    assert_no_leak(engine)


def test_eos_stop_token_ids_and_outputs(llama_dir, prompts, llama_reference):
    llm = LLM(str(llama_dir), max_model_len=256)
    ref = llama_reference[6]
    stop_id = ref[5]
    first = ref.index(stop_id)
    (out,) = llm.generate(
        {"prompt_token_ids": prompts[6]}, greedy(stop_token_ids=[stop_id]), use_tqdm=False
    )
    completion = out.outputs[0]
    assert completion.token_ids == ref[: first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_id
    assert out.finished and out.prompt_token_ids == prompts[6] and out.prompt is None
    metrics = out.metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time
    assert metrics.first_token_time <= metrics.last_token_time <= metrics.finished_time
    # EOS (token 2 for this tokenizer) ends a request unless ignore_eos.
    (length,) = llm.generate(
        {"prompt_token_ids": prompts[6]},
        SamplingParams(temperature=0, max_tokens=3),
        use_tqdm=False,
    )
    assert length.outputs[0].finish_reason == "length"
    assert length.outputs[0].token_ids == ref[:3]


def test_stats_count_tokens_and_capacity_is_logged(llama_dir, prompts, caplog):
    caplog.set_level("INFO", logger="kvpilot.engine")
    llm = LLM(
        str(llama_dir),
        max_model_len=256,
        enable_prefix_caching=False,
        kv_cache_memory=640 * TINY_KV_BYTES_PER_TOKEN,
    )
    blocks = 640 // CPU_BLOCK_SIZE
    assert f"KV cache size: 640 tokens ({blocks} blocks of {CPU_BLOCK_SIZE})" in caplog.text
    assert "Maximum concurrency for 256 tokens per request: 2.50x" in caplog.text
    generate_ids(llm, prompts[:3], greedy(max_tokens=5))
    stats = llm.llm_engine.get_stats()
    assert stats.prompt_tokens_total == sum(PROMPT_LENS[:3])
    assert stats.generation_tokens_total == 15
    assert stats.kv_capacity_tokens == stats.num_total_blocks * CPU_BLOCK_SIZE == 640
    assert stats.max_concurrency == pytest.approx(stats.kv_capacity_tokens / 256)
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0


@pytest.mark.slow
def test_default_model_greedy_matches_transformers(default_model_dir):
    llm = LLM(max_model_len=512)
    tokenizer = llm.get_tokenizer()
    questions = [
        "Hi",
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers and explain why each is prime.",
        "Translate 'good morning' into Spanish, French and German.",
        "Explain in two sentences what a paged KV cache is and why inference engines use one "
        "to serve many requests at once.",
        "def fibonacci(n):",
        "Once upon a time, in a small village at the edge of a dark forest, there lived an old "
        "clockmaker who had never left his workshop. One winter morning, a stranger knocked on "
        "his door and asked him to repair a clock that ran backwards.",
    ]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for q in questions[:6]
    ] + [tokenizer.encode(q) for q in questions[6:]]
    assert len({len(p) for p in prompts}) == len(prompts)
    ours = generate_ids(llm, prompts, greedy(max_tokens=32))
    assert ours == hf_greedy(default_model_dir, prompts, 32)
    # Text prompts go through the same tokenizer; the text decodes the tokens.
    (out,) = llm.generate(questions[6], greedy(max_tokens=32), use_tqdm=False)
    assert out.prompt == questions[6] and out.outputs[0].token_ids == ours[6]
    assert out.outputs[0].text == tokenizer.decode(ours[6], skip_special_tokens=True)
    assert_no_leak(llm.llm_engine)


# ---- bad input ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), max_model_len=64, kv_cache_memory=32 * 16 * TINY_KV_BYTES_PER_TOKEN)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ({"prompt_token_ids": list(range(3, 68))}, None, "longer than max_model_len"),
        ({"prompt_token_ids": []}, None, "prompt is empty"),
        ("", None, "prompt is empty"),
        ("\ud800 x", None, "not valid Unicode"),
        ({"prompt_token_ids": [5, 49152]}, None, "outside the vocabulary"),
        ({"prompt_token_ids": [5, "x"]}, None, "list of integers"),
        ({"tokens": [5]}, None, "'prompt' or 'prompt_token_ids'"),
        (42, None, "prompt must be a string or a dict"),
        ({"prompt_token_ids": [5]}, SamplingParams(prompt_logprobs=49153), "prompt_logprobs"),
        ({"prompt_token_ids": [5]}, SamplingParams(logprobs=49153), "logprobs must be at most"),
        # Caught on arrival, not in the step the others share (which it would fail).
        ({"prompt_token_ids": [5]}, SamplingParams(logit_bias={49152: 1.0}), "logit_bias: token"),
        ({"prompt_token_ids": [5]}, SamplingParams(stop_token_ids=[-1]), "stop_token_ids: token"),
    ],
)
def test_bad_request_is_refused_and_others_keep_running(small_llm, prompt, params, message):
    engine = small_llm.llm_engine
    engine.add_request("good", {"prompt_token_ids": [5, 6, 7]}, greedy(max_tokens=4))
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", {"prompt_token_ids": [5]})
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == ["good"] * 3
    assert len(outputs[-1].outputs[0].token_ids) == 4
    assert_no_leak(engine)


def test_max_tokens_below_one_and_bad_engine_args(llama_dir):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"max_model_len 4096 exceeds .*\(2048\)"):
        LLM(str(llama_dir), max_model_len=4096)
    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(gpu_memory_utilization=1.5)


def test_request_larger_than_the_kv_cache_is_refused_or_clamped(llama_dir):
    # 4 blocks of 16 = 64 tokens of cache, max_model_len 128.
    llm = LLM(str(llama_dir), max_model_len=128, kv_cache_memory=4 * 16 * TINY_KV_BYTES_PER_TOKEN)
    with pytest.raises(ValueError, match="can never fit the KV cache"):
        llm.generate({"prompt_token_ids": list(range(3, 68))}, use_tqdm=False)
    (out,) = llm.generate(
        {"prompt_token_ids": list(range(3, 63))}, greedy(max_tokens=100), use_tqdm=False
    )
    # 60 prompt tokens + 5 outputs: the last output's K/V is never needed.
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    assert_no_leak(llm.llm_engine)


def test_unknown_model_path_and_unsupported_architecture(tmp_path, llama_dir):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))
    folder = tmp_path / "gpt2ish"
    shutil.copytree(llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FancyNewForCausalLM"):
        LLM(str(folder))


def test_stop_string_ends_the_request_and_the_text(llama_dir, prompts):
    llm = LLM(str(llama_dir), max_model_len=256)
    prompt = {"prompt_token_ids": prompts[5]}
    full = llm.generate(prompt, greedy(max_tokens=16), use_tqdm=False)[0].outputs[0]
    stop = full.text[len(full.text) // 2 :][:6]
    cut = full.text.index(stop)
    (out,) = llm.generate(prompt, greedy(max_tokens=16, stop=[stop]), use_tqdm=False)
    completion = out.outputs[0]
    assert completion.text == full.text[:cut]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.token_ids == full.token_ids[: len(completion.token_ids)]
    assert len(completion.token_ids) < len(full.token_ids)
    (kept,) = llm.generate(
        prompt, greedy(max_tokens=16, stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )
    assert kept.outputs[0].text == full.text[: cut + len(stop)]
    assert_no_leak(llm.llm_engine)


def test_the_triton_backend_on_the_cpu_outside_the_interpreter_is_refused(
    tiny_model_dir, monkeypatch
):
    """On the CPU the Triton kernels run only under the interpreter (the suite sets
    TRITON_INTERPRET=1); without it the engine refuses at start instead of failing mid-step."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--attention-backend triton needs a CUDA device"):
        LLM(str(tiny_model_dir("llama")), device="cpu", attention_backend="triton")


def test_the_warm_up_pass_writes_nothing_and_counts_nothing(llama_dir):
    # The CPU warm-up forward at start (ModelRunner.warm_up) runs on made-up tokens: the cache
    # must stay as allocated (zeros) and no counter may see it.
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), max_model_len=64))
    caches = engine.model_runner.kv_caches
    assert all(not t.any() for pair in caches for t in pair)
    stats = engine.get_stats()
    assert (stats.prompt_tokens_total, stats.generation_tokens_total) == (0, 0)
    assert (
        engine.kv_cache_manager.block_pool.get_num_free_blocks() == engine.cache_config.num_blocks
    )
    engine.model_runner.warm_up()  # again, by hand: still nothing written
    assert all(not t.any() for pair in caches for t in pair)


def test_priority_scheduling_serves_lower_values_first_and_changes_no_token(
    llama_dir, prompts, llama_reference
):
    """vLLM's ``scheduling_policy="priority"``: one sequence at a time, the requests start in
    priority order (ties by arrival), and every request's tokens are the same as fcfs's."""
    llm = LLM(str(llama_dir), max_model_len=256, max_num_seqs=1, scheduling_policy="priority")
    priority = [3, -2, 3, 0, 1][: len(prompts)] + [0] * max(len(prompts) - 5, 0)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(), False, priority=priority
    )
    assert [o.outputs[0].token_ids for o in outputs] == llama_reference
    started = sorted(range(len(prompts)), key=lambda i: outputs[i].metrics.first_scheduled_time)
    assert started == sorted(range(len(prompts)), key=lambda i: (priority[i], i))
    assert_no_leak(llm.llm_engine)
    fcfs = LLM(str(llama_dir), max_model_len=256)
    with pytest.raises(ValueError, match="priority 1 needs the priority scheduling policy"):
        fcfs.generate("hello", greedy(), False, priority=[1])
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.generate("hello", greedy(), False, priority=[0.5])
    assert not fcfs.llm_engine.has_unfinished_requests()


def test_vllm_engine_overrides(llama_dir):
    """--override-generation-config sets the default sampling (bad values refused at start),
    --num-gpu-blocks-override the number of KV blocks."""
    llm = LLM(
        str(llama_dir),
        max_model_len=128,
        override_generation_config={"temperature": 0.25, "max_new_tokens": 7, "foo": 1},
        num_gpu_blocks_override=40,
    )
    defaults = llm.llm_engine.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.25, 7)
    assert llm.llm_engine.cache_config.num_blocks == 40
    (out,) = llm.generate("hello", use_tqdm=False)
    assert len(out.outputs[0].token_ids) <= 7
    with pytest.raises(ValueError, match="override_generation_config temperature"):
        LLM(str(llama_dir), override_generation_config='{"temperature": -1}')
