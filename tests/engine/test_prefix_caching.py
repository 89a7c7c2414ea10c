"""Prefix caching changes nothing but the work done: greedy tokens equal those of an engine
without it, in every sharing pattern; salts isolate; blocks are never leaked nor written twice.
"""

from __future__ import annotations

from collections import Counter

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.llm_engine import LLMEngine
from tests.engine.helpers import tokens

BS = 8
# K and V of the tiny test model: 2 layers x 2 KV heads x head_dim 16, float32.
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run(engine: LLMEngine, prompts: list[list[int]], salt: str | None = None) -> list:
    """Submit all prompts at once and return their final outputs in order."""
    ids = [f"r{engine.get_num_unfinished_requests()}-{i}-{id(p)}" for i, p in enumerate(prompts)]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, PARAMS, cache_salt=salt)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def token_ids(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_idle_clean(engine: LLMEngine) -> None:
    pool = engine.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert engine.get_stats().kv_cache_usage == 0.0


class WriteRecorder:
    """Counts writes to each KV slot per allocation of its block.

    A block is (re)allocated only when taken fresh from the pool; between two allocations each
    of its slots must be written at most once, however many requests share it.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.writes: Counter = Counter()
        self.allocation: Counter = Counter()
        pool = engine.kv_cache_manager.block_pool
        runner = engine.model_runner
        get_new_blocks, prepare_inputs = pool.get_new_blocks, runner.prepare_inputs

        def recording_get_new_blocks(num_blocks):
            blocks = get_new_blocks(num_blocks)
            self.allocation.update(b.block_id for b in blocks)
            return blocks

        def recording_prepare_inputs(scheduler_output):
            input_ids, positions, metadata = prepare_inputs(scheduler_output)
            for slot in metadata.slot_mapping.tolist():
                block_id = slot // BS
                self.writes[(block_id, self.allocation[block_id], slot % BS)] += 1
            return input_ids, positions, metadata

        pool.get_new_blocks = recording_get_new_blocks
        runner.prepare_inputs = recording_prepare_inputs

    def assert_written_once(self) -> None:
        assert self.writes, "nothing was written"
        assert max(self.writes.values()) == 1


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model_dir) -> LLMEngine:
    return LLM(
        str(model_dir), block_size=BS, max_model_len=256, enable_prefix_caching=False
    ).llm_engine


@pytest.fixture()
def cached(model_dir) -> LLMEngine:
    return LLM(str(model_dir), block_size=BS, max_model_len=256).llm_engine


@pytest.mark.parametrize(
    ("prefix_len", "expected_hit"),
    [(5, 0), (8, 8), (43, 40)],
    ids=["partial-block", "one-block", "many-blocks"],
)
def test_shared_prefix_after_first_finished(cached, reference, prefix_len, expected_hit):
    prefix = tokens(prefix_len, seed=1)
    prompts = [prefix + tokens(6, seed=10 + i) for i in range(3)]
    outputs = [run(cached, [p])[0] for p in prompts]
    assert token_ids(outputs) == token_ids(run(reference, prompts))
    assert [o.num_cached_tokens for o in outputs] == [0, expected_hit, expected_hit]
    stats = cached.get_stats()
    assert stats.prefix_cache_hits_total == 2 * expected_hit
    assert stats.prefix_cache_queries_total == sum(len(p) for p in prompts)
    assert_idle_clean(cached)


def test_identical_prompt_reuses_all_but_the_last_block(cached, reference):
    prompt = tokens(32, seed=2)
    first, second = run(cached, [prompt]), run(cached, [prompt])
    assert token_ids(first) == token_ids(second) == token_ids(run(reference, [prompt]))
    assert second[0].num_cached_tokens == 24


def test_concurrent_requests_share_a_prefix_and_blocks_are_written_once(cached, reference):
    recorder = WriteRecorder(cached)
    prefix = tokens(27, seed=3)
    prompts = [prefix + tokens(3 + i, seed=20 + i) for i in range(4)]
    outputs = run(cached, prompts)
    assert token_ids(outputs) == token_ids(run(reference, prompts))
    # All four are admitted in the same step: the first computes the 3 full prefix blocks,
    # the others read them within that very forward pass.
    assert [o.num_cached_tokens for o in outputs] == [0, 24, 24, 24]
    recorder.assert_written_once()
    assert_idle_clean(cached)


def test_cache_salt_never_hits_another_salt(cached, reference):
    prompt = tokens(20, seed=4)
    a = run(cached, [prompt], salt="tenant-a")[0]
    b = run(cached, [prompt], salt="tenant-b")[0]
    unsalted = run(cached, [prompt])[0]
    again = run(cached, [prompt], salt="tenant-a")[0]
    assert (a.num_cached_tokens, b.num_cached_tokens, unsalted.num_cached_tokens) == (0, 0, 0)
    assert again.num_cached_tokens == 16
    assert token_ids([a, b, unsalted, again]) == token_ids(run(reference, [prompt])) * 4


def test_llm_generate_takes_the_salt_in_the_prompt_dict(model_dir):
    # vLLM's offline form: LLM.generate([{"prompt": ..., "cache_salt": ...}]).
    llm = LLM(str(model_dir), block_size=BS, max_model_len=256)
    text = "A system prompt that two tenants share, word for word, but not their KV cache."
    a, b, again, unsalted = llm.generate(
        [{"prompt": text, "cache_salt": salt} for salt in ("tenant-a", "tenant-b", "tenant-a")]
        + [{"prompt": text}],
        PARAMS,
        use_tqdm=False,
    )
    # All four are admitted in the same step: the second "tenant-a" reads the 2 full blocks
    # (16 of the 19 prompt tokens) the first computes in that very pass; no other salt does.
    assert len(a.prompt_token_ids) == 19
    assert [o.num_cached_tokens for o in (a, b, again, unsalted)] == [0, 0, 16, 0]
    assert len({tuple(o.outputs[0].token_ids) for o in (a, b, again, unsalted)}) == 1
    with pytest.raises(ValueError, match="cache_salt: must be a non-empty string if provided"):
        llm.generate({"prompt": text, "cache_salt": ""}, PARAMS, use_tqdm=False)
    assert_idle_clean(llm.llm_engine)


@pytest.mark.parametrize(
    ("prompt", "kwargs", "message"),
    [
        ({"prompt": "hi", "cache_salt": ""}, {}, "cache_salt: must be a non-empty string"),
        ({"prompt": "hi"}, {"cache_salt": ""}, "cache_salt: must be a non-empty string"),
        ({"prompt": "hi", "cache_salt": 7}, {}, "non-empty string if provided, got 7"),
        ({"prompt": "hi", "cache_salt": "a"}, {"cache_salt": "a"}, "given both"),
        ({"prompt": "hi", "salt": "a"}, {}, r"unknown keys \['salt'\]"),
        ({"cache_salt": "a"}, {}, "exactly one of the keys"),
    ],
)
def test_bad_salts_and_prompt_keys_are_refused(cached, prompt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cached.add_request("bad", prompt, PARAMS, **kwargs)
    assert not cached.has_unfinished_requests()


def small_cache_engine(model_dir, num_blocks: int) -> LLMEngine:
    """An engine whose KV cache holds ``num_blocks`` blocks of ``BS`` tokens."""
    return LLM(
        str(model_dir),
        block_size=BS,
        max_model_len=96,
        kv_cache_memory=num_blocks * BS * TINY_KV_BYTES_PER_TOKEN,
    ).llm_engine


def test_eviction_under_memory_pressure(model_dir, reference):
    # 12 blocks of 8 tokens: a 40-token prompt plus 12 outputs takes 7 of them.
    engine = small_cache_engine(model_dir, num_blocks=12)
    prompt = tokens(40, seed=5)
    others = [tokens(40, seed=50 + i) for i in range(3)]
    first = run(engine, [prompt])[0]
    assert run(engine, [prompt])[0].num_cached_tokens == 32
    for other in others:  # each needs 7 blocks: the cached prompt blocks get evicted
        run(engine, [other])
    after = run(engine, [prompt])[0]
    assert after.num_cached_tokens < 32
    assert token_ids([first, after]) == token_ids(run(reference, [prompt])) * 2
    assert_idle_clean(engine)


def test_preempting_a_request_whose_blocks_are_shared(model_dir, reference):
    # 9 blocks of 8 = 72 tokens; 4 requests sharing a 24-token prefix, each 28 + 24 tokens long.
    engine = small_cache_engine(model_dir, num_blocks=9)
    recorder = WriteRecorder(engine)
    prefix = tokens(24, seed=6)
    prompts = [prefix + tokens(4, seed=60 + i) for i in range(4)]
    long_params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = []
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", {"prompt_token_ids": p}, long_params)
        ids.append(f"p{i}")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert engine.get_stats().num_preemptions_total > 0
    for i, p in enumerate(prompts):
        reference.add_request(f"ref{i}", {"prompt_token_ids": p}, long_params)
    expected = {}
    while reference.has_unfinished_requests():
        for out in reference.step():
            if out.finished:
                expected[out.request_id] = out.outputs[0].token_ids
    assert [done[f"p{i}"] for i in range(4)] == [expected[f"ref{i}"] for i in range(4)]
    recorder.assert_written_once()
    assert_idle_clean(engine)


def test_reset_prefix_cache_forgets_every_block_once_idle(cached):
    """vLLM's ``reset_prefix_cache``: the same prompt hits before a reset, not after it; while
    a request holds blocks the reset is refused and nothing is forgotten."""
    prompt = tokens(32, seed=7)
    run(cached, [prompt])
    cached.add_request("held", {"prompt_token_ids": prompt}, PARAMS)
    cached.step()
    assert cached.reset_prefix_cache() is False
    while cached.has_unfinished_requests():
        cached.step()
    assert run(cached, [prompt])[0].num_cached_tokens == 24
    assert cached.reset_prefix_cache() is True
    assert run(cached, [prompt])[0].num_cached_tokens == 0
    assert_idle_clean(cached)
