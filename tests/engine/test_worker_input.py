"""The driver-to-worker step message (``worker_input.py``): every step the workers rebuild is
the step the driver scheduled, through preemptions and finishes, and a decode step's message
stays small however long the sequences grow, while the whole ``SchedulerOutput`` grows with
them."""

from __future__ import annotations

import pickle

from kvpilot.engine.executor.worker_input import CachedRequestStates, WorkerInputEncoder
from kvpilot.engine.scheduler_output import SchedulerOutput
from tests.engine.parallel_helpers import generate, make_llm, random_prompts


def _step_view(scheduler_output: SchedulerOutput) -> list[tuple]:
    """What the model runner reads of a step, request by request."""
    return [
        (
            s.request.request_id,
            s.request.prompt_token_ids,
            s.request.output_token_ids,
            s.request.sampling_params.logprobs,
            s.request.seed,
            s.num_computed_tokens,
            s.num_new_tokens,
            list(s.block_ids),
            s.sample,
            s.spec_token_ids,
        )
        for s in scheduler_output.scheduled
    ]


def test_workers_rebuild_every_scheduled_step_from_the_deltas(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    prompts = random_prompts([1, 7, 9, 17, 33])
    expected = generate(make_llm(model_dir, 1, 16), prompts, max_tokens=12)
    llm = make_llm(model_dir, 1, 16)
    executor = llm.llm_engine.executor
    run_step = executor.execute_model
    encoder, states = WorkerInputEncoder(), CachedRequestStates()
    # Per decode step: (requests, SchedulerOutput bytes, message bytes).
    decode_sizes: list[tuple[int, int, int]] = []

    def through_the_message(scheduler_output: SchedulerOutput):
        message = pickle.dumps(encoder.encode(scheduler_output))
        rebuilt = states.apply(pickle.loads(message))
        assert _step_view(rebuilt) == _step_view(scheduler_output)
        assert rebuilt.finished_request_ids == scheduler_output.finished_request_ids
        assert rebuilt.num_scheduled_tokens == scheduler_output.num_scheduled_tokens
        if scheduler_output.scheduled and all(
            s.num_new_tokens == 1 and s.request.output_token_ids for s in scheduler_output.scheduled
        ):
            decode_sizes.append(
                (
                    len(scheduler_output.scheduled),
                    len(pickle.dumps(scheduler_output)),
                    len(message),
                )
            )
        return run_step(rebuilt)

    executor.execute_model = through_the_message
    # The model ran on the rebuilt steps: same tokens, same preemptions.
    assert generate(llm, prompts, max_tokens=12) == expected
    assert expected[2] > 0
    assert len(decode_sizes) > 5
    by_batch: dict[int, list[tuple[int, int]]] = {}
    for num_requests, whole, diff in decode_sizes:
        by_batch.setdefault(num_requests, []).append((whole, diff))
    for num_requests, sizes in by_batch.items():
        wholes, diffs = zip(*sizes, strict=True)
        # The whole output carries every token so far: it grows each step; the message holds
        # one token per request (and a block id now and then): it does not.
        assert list(wholes) == sorted(set(wholes))
        assert max(diffs) - min(diffs) <= 12 * num_requests
    assert all(diff < whole / 3 for _, whole, diff in decode_sizes)
