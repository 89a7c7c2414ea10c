"""Structured outputs in the engine (``SamplingParams.structured_outputs``, xgrammar): every
output matches its constraint, unconstrained requests in the same batch are unchanged and cost
nothing, bad constraints and JSON Schema keywords xgrammar would not enforce are refused by
name, speculative decoding leaves constrained requests alone, and the bitmask is applied
exactly as xgrammar applies it."""

from __future__ import annotations

import json
import pathlib
import re

import jsonschema
import pytest
import torch
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.sampling_params import StructuredOutputsParams
from kvpilot.engine.structured_output import apply_grammar_bitmask, check_xgrammar_support
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


AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
# (schema, what the message names, where, an instance that breaks the schema): xgrammar 0.2.9
# compiles each schema, with a warning at most, into a grammar that accepts that instance.
UNSUPPORTED = [
    ({"type": "integer", "not": {"const": 3}}, "'not'", "$", 3),
    (
        {"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.5}}},
        "'multipleOf'",
        "$.properties.n",
        {"n": 0.3},
    ),
    ({"multipleOf": 5}, "'multipleOf'", "$", 7),
    (
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "'uniqueItems'",
        "$",
        [1, 1],
    ),
    (
        {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}},
        },
        "'contains'",
        "$.items",
        [[1]],
    ),
    (
        {"type": "array", "items": {"type": "integer"}, "minContains": 2, "contains": {"const": 3}},
        "'minContains'",
        "$",
        [1, 1],
    ),
    (
        {"type": "array", "items": {"type": "integer"}, "maxContains": 1, "contains": {"const": 3}},
        "'maxContains'",
        "$",
        [3, 3],
    ),
    ({"patternProperties": {"^x": {"type": "integer"}}}, "'patternProperties'", "$", {"xa": "s"}),
    ({"propertyNames": {"maxLength": 2}}, "'propertyNames'", "$", {"abc": 1}),
    (
        {**AB, "if": {"required": ["a"]}, "then": {"required": ["b"]}},
        "'if'",
        "$",
        {"a": 1},
    ),
    (
        {**AB, "dependentRequired": {"a": ["b"]}},
        "'dependentRequired'",
        "$",
        {"a": 1},
    ),
    (
        {**AB, "dependentSchemas": {"a": {"required": ["b"]}}},
        "'dependentSchemas'",
        "$",
        {"a": 1},
    ),
    (
        {"anyOf": [{"type": "string"}, {"allOf": [{"type": "integer"}, {"maximum": 5}]}]},
        "'allOf' with 2 subschemas",
        "$.anyOf[1]",
        9,
    ),
    (
        {"type": "integer", "maximum": 5, "allOf": [{"minimum": 0}]},
        "'maximum' beside 'allOf'",
        "$",
        9,
    ),
    (
        {"$defs": {"small int": {"type": "integer"}}, "$ref": "#/$defs/small int", "maximum": 5},
        "'maximum' beside '$ref'",
        "$",
        9,
    ),
    (
        {
            "$defs": {"A": {"type": "string", "pattern": "^a+$", "maxLength": 2}},
            "type": "object",
            "properties": {"s": {"$ref": "#/$defs/A"}},
            "required": ["s"],
        },
        "'maxLength' beside 'pattern'",
        "$.$defs.A",
        {"s": "aaaa"},
    ),
    ({"const": "abc", "maxLength": 1}, "'maxLength' beside 'const'", "$", "abc"),
]


@pytest.mark.parametrize(("schema", "feature", "path", "breaking"), UNSUPPORTED)
def test_json_schema_keywords_xgrammar_ignores_are_refused_by_name_and_path(
    llm, schema, feature, path, breaking
):
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema))
    assert _is_grammar_accept_string(grammar, json.dumps(breaking))  # the reason to refuse
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(breaking, schema)
    message = f"the JSON schema uses {feature} at {path}, which is not supported"
    with pytest.raises(ValueError, match=f"^structured_outputs: {re.escape(message)}$"):
        llm.llm_engine.add_request(
            "unsupported",
            {"prompt_token_ids": [5, 6]},
            greedy(structured_outputs=constrained(json=schema)),
        )
    assert not llm.llm_engine.has_unfinished_requests()


def test_enum_values_the_type_excludes_are_refused():
    with pytest.raises(ValueError) as refused:
        check_xgrammar_support({"properties": {"n": {"type": "integer", "enum": [1, "two"]}}})
    assert str(refused.value) == (
        "the JSON schema at $.properties.n has \"two\" in 'enum', which its type (integer) excludes"
    )


# (schema, an instance that breaks it): keywords xgrammar 0.2.9 does enforce are let through.
ENFORCED = [
    ({"type": "integer", "multipleOf": 5}, 7),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, {"xa": "s"}),
    ({"type": ["object", "null"], "propertyNames": {"maxLength": 2}}, {"abc": 1}),
    ({"properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False}, {"z": 1}),
    ({"prefixItems": [{"type": "integer"}], "unevaluatedItems": False}, [1, 2]),
    ({"allOf": [{"type": "integer", "maximum": 5}], "description": "one subschema"}, 9),
    ({"$defs": {"I": {"type": "integer", "maximum": 5}}, "$ref": "#/$defs/I", "title": "t"}, 9),
    ({"type": "object", "anyOf": [{"properties": {"a": {"type": "integer"}}}]}, [1]),
    ({"type": "string", "const": "a", "enum": ["a"]}, "b"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": False, "maxItems": 1}, [1, 1]),
]


@pytest.mark.parametrize(("schema", "breaking"), ENFORCED)
def test_json_schema_keywords_xgrammar_enforces_are_accepted(schema, breaking):
    check_xgrammar_support(schema)
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema))
    assert not _is_grammar_accept_string(grammar, json.dumps(breaking))


def test_supported_schema_with_refs_anyof_enum_and_arrays_constrains_the_output(llm):
    schema = {
        "$defs": {"Fruit": {"type": "string", "enum": ["apple", "pear"]}},
        "type": "object",
        "properties": {
            "fruits": {
                "type": "array",
                "items": {"$ref": "#/$defs/Fruit"},
                "minItems": 1,
                "maxItems": 2,
            },
            "kg": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
        },
        "required": ["fruits", "kg"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        n=3,
        temperature=1.0,
        seed=0,
        max_tokens=60,
        structured_outputs=constrained(json=schema, disable_any_whitespace=True),
    )
    [output] = llm.generate([{"prompt_token_ids": tokens(8, seed=2)}], params, use_tqdm=False)
    for seq in output.outputs:
        assert seq.finish_reason == "stop", seq.text
        jsonschema.validate(json.loads(seq.text), schema)


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
