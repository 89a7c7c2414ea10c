"""Output deltas between the engine-core and API processes: what the API rebuilds from them
equals what the engine returned, step by step, on the real model."""

from __future__ import annotations

import pickle

import pytest

from kvpilot.engine.config import EngineArgs
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.output_delta import OutputDeltaDecoder, OutputDeltaEncoder
from kvpilot.engine.outputs import CompletionOutput, RequestOutput
from kvpilot.engine.sampling_params import SamplingParams

PROMPT = {"prompt_token_ids": [504, 3575, 282, 4649, 314]}  # "The capital of France is"


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(max_model_len=256, max_num_seqs=8))


def run_through_pipe(engine, requests, abort_after: dict[str, int] | None = None):
    """Step the engine until idle; every step's outputs go through encoder, pickle and
    decoder. Returns (engine outputs, decoded outputs), step by step."""
    abort_after = abort_after or {}
    encoder, decoder = OutputDeltaEncoder(), OutputDeltaDecoder()
    for request_id, prompt, params in requests:
        decoder.add(request_id)
        engine.add_request(request_id, prompt, params)
    sent, got, steps = [], [], 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        deltas = pickle.loads(pickle.dumps(encoder.encode(outputs)))
        sent.append(outputs)
        got.append(decoder.decode(deltas))
        for request_id, step in abort_after.items():
            if step == steps:
                engine.abort_request(request_id)
                encoder.forget([request_id])
                decoder.forget(request_id)
    assert len(decoder) == 0 and not encoder._sent  # nothing held once all are done
    return sent, got


def test_rebuilt_outputs_equal_the_engines_at_every_step(engine):
    requests = [
        ("greedy", PROMPT, SamplingParams(temperature=0, max_tokens=12)),
        (
            "sampled-n2-logprobs",
            "Tell me about Paris.",
            SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=10, logprobs=2),
        ),
        (
            "prompt-logprobs",
            PROMPT,
            SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1),
        ),
        ("stop-string", PROMPT, SamplingParams(temperature=0, max_tokens=20, stop=["answer"])),
    ]
    sent, got = run_through_pipe(engine, requests)
    assert sum(len(step) for step in sent) > len(requests)  # several steps per request
    assert got == sent
    finished = {o.request_id: o for step in got for o in step if o.finished}
    assert finished["stop-string"].outputs[0].stop_reason == "answer"
    assert len(finished["sampled-n2-logprobs"].outputs) == 2
    assert len(finished["sampled-n2-logprobs"].outputs[1].logprobs) == 10
    assert len(finished["prompt-logprobs"].prompt_logprobs) == len(PROMPT["prompt_token_ids"])


def test_an_aborted_request_is_forgotten_on_both_sides(engine):
    requests = [
        ("kept", PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
        ("aborted", PROMPT, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)),
    ]
    sent, got = run_through_pipe(engine, requests, abort_after={"aborted": 3})
    assert got == sent
    assert not any(o.request_id == "aborted" for step in got[3:] for o in step)


def test_a_delta_of_an_unregistered_or_forgotten_request_is_dropped():
    encoder, decoder = OutputDeltaEncoder(), OutputDeltaDecoder()
    output = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "a", [3])], finished=False)
    assert decoder.decode(encoder.encode([output])) == []


def test_a_revised_text_is_sent_whole():
    encoder, decoder = OutputDeltaEncoder(), OutputDeltaDecoder()
    decoder.add("r")

    def output(text: str, token_ids: list[int], finished: bool = False) -> RequestOutput:
        finish = "stop" if finished else None
        return RequestOutput(
            "r", "p", [1], [CompletionOutput(0, text, token_ids, finish_reason=finish)], finished
        )

    steps = [output("Hello wor", [5, 6]), output("Hello", [5, 6, 7], finished=True)]
    got = [decoder.decode(encoder.encode([step])) for step in steps]
    assert got == [[steps[0]], [steps[1]]]
    assert len(decoder) == 0


def test_the_lora_request_is_sent_once_and_kept():
    from kvpilot.engine.lora.request import LoRARequest

    encoder, decoder = OutputDeltaEncoder(), OutputDeltaDecoder()
    decoder.add("r")
    lora = LoRARequest("sql", 1, "/adapters/sql")

    def output(token_ids: list[int], finished: bool) -> RequestOutput:
        seq = CompletionOutput(0, "x" * len(token_ids), token_ids)
        return RequestOutput("r", "p", [1], [seq], finished, lora_request=lora)

    steps = [output([5], False), output([5, 6], True)]
    deltas = [pickle.loads(pickle.dumps(encoder.encode([step]))) for step in steps]
    assert deltas[0][0].lora_request == lora and deltas[1][0].lora_request is None
    assert [decoder.decode(d) for d in deltas] == [[steps[0]], [steps[1]]]
