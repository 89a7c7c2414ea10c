"""Structured outputs in the engine (``SamplingParams.structured_outputs``, xgrammar): every
output matches its constraint, unconstrained requests in the same batch are unchanged and cost
nothing, bad constraints are refused by name, speculative decoding leaves constrained requests
alone, and the bitmask is applied exactly as xgrammar applies it."""

from __future__ import annotations

import json
import pathlib
import re

import jsonschema
import pytest
import torch
import xgrammar

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.sampling_params import StructuredOutputsParams
from kvpilot.engine.structured_output import apply_grammar_bitmask
from tests.engine.helpers import assert_no_leak, greedy, tokens

CHOICES = ["yes", "no", "maybe not"]
CODE = r"[0-9]{3}-[a-z]{2}"
ITEM = {
    "type": "object",
    "properties": {
        "fruit": {"enum": ["apple", "pear", "plum"]},
        "kg": {"type": "integer", "minimum": 0},
        "origin": {"type": "string"},
    },
    "required": ["fruit", "kg", "origin"],
}
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


def constrained(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir) -> pathlib.Path:
    # Untied embeddings: the tiny random model's output varies instead of repeating one token.
    return tiny_model_dir("llama", tie_word_embeddings=False)


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), max_model_len=256)


def test_bitmask_is_applied_as_xgrammar_applies_it():
    generator = torch.Generator().manual_seed(0)
    vocab_size = 100  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(5, vocab_size, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), generator=generator, dtype=torch.int32)
    rows = [4, 0, 2]
    ours = logits.clone()
    apply_grammar_bitmask(ours, bitmask, rows)
    theirs = logits.clone()
    full = torch.full((5, 4), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgrammar.apply_token_bitmask_inplace(theirs, full, vocab_size=vocab_size)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])  # rows without a grammar untouched
    assert ours.isinf().sum() > 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "set exactly one of json, regex, choice, grammar, json_object; got none"),
        ({"regex": "a", "choice": ["a"]}, r"got \['regex', 'choice'\]"),
        ({"choice": []}, "choice must be a list of non-empty strings"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"json": 3}, "json must be a JSON Schema"),
    ],
)
def test_params_need_exactly_one_well_typed_constraint(kwargs, message):
    with pytest.raises(ValueError, match=f"^structured_outputs: .*{message}"):
        StructuredOutputsParams(**kwargs)


def test_choice_regex_and_grammar_outputs_match_their_constraint(llm):
    prompt = {"prompt_token_ids": tokens(12, seed=1)}
    choice = SamplingParams(
        n=6, temperature=1.0, seed=3, max_tokens=20, structured_outputs=constrained(choice=CHOICES)
    )
    # ignore_eos: the grammar alone ends the request once complete.
    regex = SamplingParams(
        temperature=1.0, seed=4, max_tokens=40, ignore_eos=True,
        structured_outputs=constrained(regex=CODE),
    )  # fmt: skip
    grammar = SamplingParams(
        temperature=0,
        max_tokens=40,
        structured_outputs=constrained(grammar='root ::= "(" [a-c] [a-c]? ")" | "none"'),
    )
    outputs = llm.generate([prompt, prompt, prompt], [choice, regex, grammar], use_tqdm=False)
    texts = [seq.text for seq in outputs[0].outputs]
    assert len(texts) == 6 and set(texts) <= set(CHOICES)
    assert {seq.finish_reason for seq in outputs[0].outputs} == {"stop"}
    [code] = outputs[1].outputs
    assert re.fullmatch(CODE, code.text) and code.finish_reason == "stop"
    assert len(code.token_ids) < 40
    [grammar_out] = outputs[2].outputs
    assert re.fullmatch(r"\([a-c][a-c]?\)|none", grammar_out.text), grammar_out.text
    assert llm.llm_engine.structured_output_manager.num_requests == 0
    assert_no_leak(llm.llm_engine)


def test_unconstrained_requests_are_unchanged_and_load_nothing(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=256)
    prompts = [{"prompt_token_ids": tokens(n, seed=n)} for n in (5, 17)]
    alone = llm.generate(prompts, greedy(max_tokens=12), use_tqdm=False)
    assert not llm.llm_engine.structured_output_manager.is_loaded
    mixed = llm.generate(
        [*prompts, prompts[0]],
        [greedy(max_tokens=12)] * 2
        + [greedy(max_tokens=12, structured_outputs=constrained(regex="[a-z ]+"))],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    assert re.fullmatch("[a-z ]+", mixed[2].outputs[0].text)
    assert mixed[2].outputs[0].token_ids != alone[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (constrained(json={"type": "objekt"}), 'invalid json: Unsupported type "objekt"'),
        (constrained(json='{"type": '), "invalid json: Expecting value"),
        (constrained(json="[1, 2]"), "invalid json: a JSON Schema must be a JSON object"),
        (constrained(regex="(ab"), "invalid regex: .*parenthesis is not closed"),
        (constrained(grammar='rooot ::= "a"'), 'invalid grammar: .*"root" is not found'),
    ],
)
def test_invalid_constraints_are_refused_and_leave_nothing(llm, params, message):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=f"^structured_outputs: {message}"):
        engine.add_request("bad", {"prompt_token_ids": [5, 6]}, greedy(structured_outputs=params))
    assert not engine.has_unfinished_requests()
    assert engine.structured_output_manager.num_requests == 0


def test_abort_forgets_the_matchers(llm):
    engine = llm.llm_engine
    params = SamplingParams(n=2, max_tokens=30, structured_outputs=constrained(regex="[a-z]{20}"))
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, params)
    engine.step()
    assert engine.structured_output_manager.num_requests == 2
    engine.abort_request("r")
    assert engine.structured_output_manager.num_requests == 0
    assert_no_leak(engine)


def test_speculative_decoding_skips_constrained_requests(llama_dir, llm):
    phrase = tokens(6, seed=7)
    # Repeated phrases: prompt lookup finds drafts for the unconstrained requests.
    prompts = [phrase * 3, phrase * 2 + phrase[:3], phrase[:2] * 4 + [7], phrase * 3]
    params = [greedy()] * 3 + [greedy(structured_outputs=constrained(regex="[a-z]+( [a-z]+)*"))]
    requests = [{"prompt_token_ids": p} for p in prompts]
    plain = llm.generate(requests, params, use_tqdm=False)
    spec = LLM(str(llama_dir), max_model_len=256, speculative_config=NGRAM)
    ours = spec.generate(requests, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in plain]
    assert re.fullmatch("[a-z ]+", ours[3].outputs[0].text)  # a prefix: cut by max_tokens
    assert spec.llm_engine.get_stats().spec_decode.num_drafts > 0  # the others speculated
    assert_no_leak(spec.llm_engine)


@pytest.mark.slow
def test_default_model_json_outputs_parse_and_validate():
    llm = LLM(max_model_len=512)
    conversation = [
        {"role": "user", "content": "Give a shopping list item as JSON: fruit, kg and origin."}
    ]
    schema, any_object = llm.chat(
        [conversation, conversation],
        [
            SamplingParams(temperature=0, max_tokens=80, structured_outputs=constrained(json=ITEM)),
            SamplingParams(
                temperature=0, max_tokens=80, structured_outputs=constrained(json_object=True)
            ),
        ],
        use_tqdm=False,
    )
    jsonschema.validate(json.loads(schema.outputs[0].text), ITEM)
    assert schema.outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(any_object.outputs[0].text), dict)
    assert_no_leak(llm.llm_engine)
