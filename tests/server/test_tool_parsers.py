"""Tool parsers on fixed strings: the ``hermes`` parser (one call, several, text around them,
malformed JSON, blocks left open, streaming split at awkward points), ``llama3_json``,
``mistral`` and ``pythonic`` (Python call lists, read as vLLM reads them), the parsers of
constrained outputs (named and ``required`` tool_choice) with their JSON Schemas, and which
parser a request gets."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.protocol import ChatCompletionRequest, DeltaMessage
from kvpilot.engine.server.tool_parsers import (
    AUTO_TOOL_CHOICE_DISABLED,
    Hermes2ProToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    NamedToolParser,
    PythonicToolParser,
    RequiredToolParser,
    ToolParser,
    get_tool_parser,
    merge_deltas,
)

CALL_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_TIME = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>'
MALFORMED = '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>'
MIXED = f"Let me check.\n{CALL_WEATHER}\n{MALFORMED} and {CALL_TIME}\nDone <tool"
CALL_LYON = CALL_WEATHER.replace("Paris", "Lyon")
# The tester's output: two calls with a newline between them, and no content.
TWO_CALLS = f"{CALL_WEATHER}\n{CALL_LYON}"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
            "required": ["city"],
            "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}},
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def calls(extracted) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in extracted.tool_calls]


def stream(parser: ToolParser, pieces: list[str]) -> list[DeltaMessage | None]:
    """Feed ``pieces`` as deltas; the last one finishes the output."""
    return [
        parser.extract_tool_calls_streaming(piece, finished=i == len(pieces) - 1)
        for i, piece in enumerate(pieces)
    ]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_hermes_one_call_has_no_content_and_finishes_with_tool_calls():
    parser = Hermes2ProToolParser()
    extracted = parser.extract_tool_calls(CALL_WEATHER)
    assert extracted.tools_called
    assert calls(extracted) == [("get_weather", {"city": "Paris"})]
    assert extracted.content is None
    [call] = extracted.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and len(call.id) == len("chatcmpl-tool-") + 32
    assert call.type == "function"
    assert parser.finish_reason("stop") == "tool_calls"
    assert parser.finish_reason("length") == "length"


def test_hermes_two_calls_get_distinct_ids():
    extracted = Hermes2ProToolParser().extract_tool_calls(f"{CALL_WEATHER}\n{CALL_TIME}")
    assert calls(extracted) == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"timezone": "CET"}),
    ]
    assert len({c.id for c in extracted.tool_calls}) == 2
    assert extracted.content is None


def test_hermes_text_around_calls_and_malformed_blocks_stay_content():
    extracted = Hermes2ProToolParser().extract_tool_calls(MIXED)
    assert calls(extracted) == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"timezone": "CET"}),
    ]
    assert extracted.content == f"Let me check.\n\n{MALFORMED} and \nDone <tool"


@pytest.mark.parametrize(
    "text",
    [
        MALFORMED,
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": "city=Paris"}</tool_call>',  # not an object
        "<tool_call>[1, 2]</tool_call>",
        "x < y and <tool_call",
    ],
)
def test_hermes_text_without_a_valid_call_is_returned_unchanged(text):
    parser = Hermes2ProToolParser()
    extracted = parser.extract_tool_calls(text)
    assert (extracted.tools_called, extracted.tool_calls, extracted.content) == (False, [], text)
    assert parser.finish_reason("stop") == "stop"


def test_hermes_block_left_open_at_the_end_is_parsed_as_if_closed():
    extracted = Hermes2ProToolParser().extract_tool_calls('<tool_call>\n{"name": "f"}\n')
    assert calls(extracted) == [("f", {})]
    broken = Hermes2ProToolParser().extract_tool_calls('Hi <tool_call>\n{"name": "f", "argu')
    assert (broken.tool_calls, broken.content) == ([], 'Hi <tool_call>\n{"name": "f", "argu')


def test_hermes_keeps_only_the_first_call_without_parallel_tool_calls():
    parser = Hermes2ProToolParser(parallel_tool_calls=False)
    extracted = parser.extract_tool_calls(f"{CALL_WEATHER}\n{CALL_TIME}")
    assert calls(extracted) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 64])
def test_hermes_streaming_in_any_split_equals_the_whole_output(size):
    pieces = [MIXED[i : i + size] for i in range(0, len(MIXED), size)] + [""]
    deltas = stream(Hermes2ProToolParser(), pieces)
    whole = Hermes2ProToolParser().extract_tool_calls(MIXED)
    streamed = merge_deltas(deltas)
    assert calls(streamed) == calls(whole)
    assert streamed.content == whole.content
    # A call arrives in one delta, whole: id, type, name and complete arguments.
    pieces_of_calls = [c for d in deltas if d is not None for c in d.tool_calls or []]
    assert [c.index for c in pieces_of_calls] == [0, 1]
    for piece in pieces_of_calls:
        assert piece.id and piece.type == "function"
        assert json.loads(piece.function.arguments)


def splits(text: str, tokenizer) -> list[list[str]]:
    """Ways to cut ``text`` into deltas: the model's own tokens, every character, fixed sizes,
    and random cuts (fixed seed)."""
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    tokens = [tokenizer.decode(token_ids[:i]) for i in range(len(token_ids) + 1)]
    result = [[after[len(before) :] for before, after in zip(tokens, tokens[1:], strict=False)]]
    result += [[text[i : i + size] for i in range(0, len(text), size)] for size in (1, 2, 7, 64)]
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(12, len(text) - 1))))
        result.append([text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for pieces in result:
        assert "".join(pieces) == text
    return result


def assert_streams_like_the_whole(
    text: str, tokenizer, parser: type[ToolParser] = Hermes2ProToolParser, **parser_args
) -> None:
    """Every split, streamed, gives the whole output's calls and content: the content pieces a
    client receives, joined, are the whole content (nothing where it is None)."""
    whole = parser(**parser_args).extract_tool_calls(text)
    for pieces in splits(text, tokenizer):
        for end in ([], [""]):  # the last token finishes, or an empty final delta does
            deltas = stream(parser(**parser_args), pieces + end)
            received = "".join(d.content for d in deltas if d is not None and d.content)
            assert received == (whole.content or ""), pieces
            assert not any(d is not None and d.content == "" for d in deltas)
            streamed = merge_deltas(deltas)
            assert (calls(streamed), streamed.content) == (calls(whole), whole.content), pieces


def test_hermes_two_calls_with_whitespace_between_stream_no_content(default_tokenizer):
    whole = Hermes2ProToolParser().extract_tool_calls(TWO_CALLS)
    assert calls(whole) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]
    assert whole.content is None
    assert_streams_like_the_whole(TWO_CALLS, default_tokenizer)
    # Whitespace around the calls too.
    assert_streams_like_the_whole(f"\n  {TWO_CALLS}\n\n", default_tokenizer)
    assert_streams_like_the_whole(f"\n{TWO_CALLS}\n", default_tokenizer, parallel_tool_calls=False)


def test_hermes_text_before_the_calls_keeps_the_whitespace_between_them(default_tokenizer):
    text = f"\nI will check both cities.\n{CALL_WEATHER}\n\n{CALL_LYON}\n"
    whole = Hermes2ProToolParser().extract_tool_calls(text)
    assert whole.content == "\nI will check both cities.\n\n\n\n"
    assert len(whole.tool_calls) == 2
    assert_streams_like_the_whole(text, default_tokenizer)
    assert_streams_like_the_whole(MIXED, default_tokenizer)


@pytest.mark.parametrize("text", ["  \n", "\n\nHello\n", "Hello\n  world\n"])
def test_hermes_text_without_calls_keeps_its_whitespace(text, default_tokenizer):
    assert Hermes2ProToolParser().extract_tool_calls(text).content == text
    assert_streams_like_the_whole(text, default_tokenizer)


def test_hermes_streams_text_at_once_and_holds_only_leading_whitespace():
    parser = Hermes2ProToolParser()
    pieces = ["\n", "Hello", "\n", " ", "world", "\n"]
    deltas = [parser.extract_tool_calls_streaming(piece, False) for piece in pieces]
    assert [d and d.content for d in deltas] == [None, "\nHello", "\n", " ", "world", "\n"]
    assert parser.extract_tool_calls_streaming("", True) is None
    # Whitespace after a call waits for what follows it.
    parser = Hermes2ProToolParser()
    assert parser.extract_tool_calls_streaming(CALL_WEATHER, False).content is None
    assert parser.extract_tool_calls_streaming("\n", False) is None
    assert parser.extract_tool_calls_streaming("Done", False) == DeltaMessage(content="\nDone")


def test_hermes_streaming_holds_back_a_tag_split_across_deltas():
    parser = Hermes2ProToolParser()
    pieces = ["Sure <tool", "_ca", 'll>{"name": "f", "argu', 'ments": {"a": 1}}</tool_', "call> ok"]
    deltas = stream(parser, pieces)
    assert deltas[0] == DeltaMessage(content="Sure ")
    assert deltas[1:4] == [None, None, None]
    [call] = deltas[4].tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("f", {"a": 1})
    assert deltas[4].content == " ok"
    # "<" that does not start a tag is released once it cannot.
    other = Hermes2ProToolParser()
    assert other.extract_tool_calls_streaming("a <", False) == DeltaMessage(content="a ")
    assert other.extract_tool_calls_streaming("b", False) == DeltaMessage(content="<b")


def test_hermes_keeps_special_tokens_in_the_text():
    params = SamplingParams()
    Hermes2ProToolParser().adjust_request(params)
    assert params.skip_special_tokens is False


LLAMA_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TIME = '{"name": "get_time", "arguments": {"timezone": "CET"}}'


@pytest.mark.parametrize(
    ("text", "expected", "content"),
    [
        (LLAMA_WEATHER, [("get_weather", {"city": "Paris"})], None),
        (f"<|python_tag|>{LLAMA_WEATHER}", [("get_weather", {"city": "Paris"})], None),
        (
            f" <|python_tag|>{LLAMA_WEATHER}; {LLAMA_TIME}\n",
            [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "CET"})],
            None,
        ),
        ("The weather in Paris is sunny.", [], "The weather in Paris is sunny."),
        ('{"answer": 42}', [], '{"answer": 42}'),
        (f'{LLAMA_WEATHER}; {{"name": "get_time", "param', [("get_weather", {"city": "Paris"})],
         '{"name": "get_time", "param'),
        ("<|python_tag|>", [], "<|python_tag|>"),
    ],
)  # fmt: skip
def test_llama3_json_reads_the_calls_llama_writes(text, expected, content, default_tokenizer):
    extracted = Llama3JsonToolParser().extract_tool_calls(text)
    assert calls(extracted) == expected
    assert extracted.content == content
    assert extracted.tools_called == bool(expected)
    assert_streams_like_the_whole(text, default_tokenizer, Llama3JsonToolParser)


def test_llama3_json_streams_plain_answers_at_once_and_keeps_special_tokens():
    parser = Llama3JsonToolParser()
    assert parser.extract_tool_calls_streaming("<|py", finished=False) is None  # the tag?
    assert parser.extract_tool_calls_streaming("thon", finished=False) is None
    parser = Llama3JsonToolParser()
    first = parser.extract_tool_calls_streaming("Sunny", finished=False)
    assert first.content == "Sunny" and first.tool_calls is None
    params = SamplingParams()
    parser.adjust_request(params)
    assert params.skip_special_tokens is False
    single = Llama3JsonToolParser(parallel_tool_calls=False)
    assert calls(single.extract_tool_calls(f"{LLAMA_WEATHER};{LLAMA_TIME}")) == [
        ("get_weather", {"city": "Paris"})
    ]


PARIS = ("get_weather", {"city": "Paris"})
CET = ("get_time", {"timezone": "CET"})


@pytest.mark.parametrize(
    ("text", "expected", "content"),
    [
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', [PARIS], None),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]'
            '{"timezone": "CET"}',
            [PARIS, CET],
            None,
        ),
        ('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}', [PARIS], None),
        (
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {"timezone": "CET"}}]',
            [PARIS, CET],
            None,
        ),
        (
            'Let me look. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
            [PARIS],
            "Let me look. ",
        ),
        ("It is sunny [TOOL_ in Paris.", [], "It is sunny [TOOL_ in Paris."),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', [], '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa'),
        ('[TOOL_CALLS][{"answer": 42}]', [], '[TOOL_CALLS][{"answer": 42}]'),
    ],
)  # fmt: skip
def test_mistral_reads_both_tool_call_forms(text, expected, content, default_tokenizer):
    extracted = MistralToolParser().extract_tool_calls(text)
    assert calls(extracted) == expected
    assert extracted.content == content
    assert_streams_like_the_whole(text, default_tokenizer, MistralToolParser)


def test_mistral_without_parallel_calls_keeps_the_first():
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    assert calls(MistralToolParser(parallel_tool_calls=False).extract_tool_calls(text)) == [PARIS]


PY_WEATHER = 'get_weather(city="Paris", unit="celsius")'
PY_PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
PY_LITERALS = (
    "[f(a=None, b=True, c=false, d=null, e=-1.5, f=+2, g=(1, 'x'), h={3}, "
    "i={'k': [1, {'n': 'é'}]}, j=f'plain', k=\"\"\"two\nlines\"\"\")]"
)


@pytest.mark.parametrize(
    ("text", "expected", "content"),
    [
        (f"[{PY_WEATHER}]", [PY_PARIS], None),
        (f"[{PY_WEATHER}, get_time(timezone='CET')]", [PY_PARIS, CET], None),
        ("[get_time()]", [("get_time", {})], None),
        (f"\n [{PY_WEATHER}]\n", [PY_PARIS], None),
        # vLLM's literals: JSON names, signs, tuples and sets as arrays, dicts, plain f-strings.
        (
            PY_LITERALS,
            [("f", {"a": None, "b": True, "c": False, "d": None, "e": -1.5, "f": 2,
                    "g": [1, "x"], "h": [3], "i": {"k": [1, {"n": "é"}]}, "j": "plain",
                    "k": "two\nlines"})],
            None,
        ),
        ("[tools.search.run(q='kv cache')]", [("tools.search.run", {"q": "kv cache"})], None),
        ("It is sunny in Paris.", [], "It is sunny in Paris."),
        # Not a list of calls with literal keyword arguments: content, as it came.
        ("[1, 2, 3]", [], "[1, 2, 3]"),
        ("[]", [], "[]"),
        ("[the docs](https://example.com)", [], "[the docs](https://example.com)"),
        ('[get_weather("Paris")]', [], '[get_weather("Paris")]'),
        ("[get_weather(city=paris)]", [], "[get_weather(city=paris)]"),
        ("[f(x=__import__('os').getcwd())]", [], "[f(x=__import__('os').getcwd())]"),
        ("[f(x=f'{y}')]", [], "[f(x=f'{y}')]"),
        ("[f(**kw)]", [], "[f(**kw)]"),
        ("[f(x=1e999)]", [], "[f(x=1e999)]"),
        ("[f(x=b'raw')]", [], "[f(x=b'raw')]"),
        (f"[{PY_WEATHER}] is what I would call.", [], f"[{PY_WEATHER}] is what I would call."),
        (f"[{PY_WEATHER}, 42]", [], f"[{PY_WEATHER}, 42]"),
        (f"[{PY_WEATHER}", [], f"[{PY_WEATHER}"),  # cut short
    ],
)  # fmt: skip
def test_pythonic_reads_python_call_lists(text, expected, content, default_tokenizer):
    extracted = PythonicToolParser().extract_tool_calls(text)
    assert calls(extracted) == expected
    assert extracted.content == content
    assert extracted.tools_called == bool(expected)
    assert_streams_like_the_whole(text, default_tokenizer, PythonicToolParser)


def test_pythonic_streams_plain_answers_at_once_and_sends_calls_whole():
    parser = PythonicToolParser()
    assert parser.extract_tool_calls_streaming("Sunny", finished=False).content == "Sunny"
    # "[" and a name may still start a call list; "[the docs" no longer can.
    parser = PythonicToolParser()
    assert parser.extract_tool_calls_streaming("[the", finished=False) is None
    assert parser.extract_tool_calls_streaming(" docs", finished=False).content == "[the docs"
    # A call list is held back, then sent whole, each call with its id, name and arguments.
    parser = PythonicToolParser()
    pieces = ["[get_", "weather(city=", '"Paris", unit="celsius"), get_time(', "timezone='CET')]"]
    assert [parser.extract_tool_calls_streaming(p, finished=False) for p in pieces] == [None] * 4
    delta = parser.extract_tool_calls_streaming("", finished=True)
    assert delta.content is None
    assert [(c.index, c.type, c.function.name) for c in delta.tool_calls] == [
        (0, "function", "get_weather"),
        (1, "function", "get_time"),
    ]
    assert all(c.id.startswith("chatcmpl-tool-") for c in delta.tool_calls)
    assert parser.finish_reason("stop") == "tool_calls"
    params = SamplingParams()
    parser.adjust_request(params)
    assert params.skip_special_tokens is True  # no special tokens mark the calls


def test_pythonic_without_parallel_calls_keeps_the_first():
    text = f"[{PY_WEATHER}, get_time(timezone='CET')]"
    assert calls(PythonicToolParser(parallel_tool_calls=False).extract_tool_calls(text)) == [
        PY_PARIS
    ]


def test_named_parser_streams_the_arguments_of_the_named_function():
    parser = NamedToolParser(request(tools=[WEATHER]).tools[0].function)
    deltas = stream(parser, ['{"ci', 'ty": "Pa', 'ris"}', ""])
    first = deltas[0].tool_calls[0]
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    assert first.id.startswith("chatcmpl-tool-")
    rest = [d.tool_calls[0] for d in deltas[1:3]]
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in rest)
    assert deltas[3] is None
    assert calls(merge_deltas(deltas)) == [("get_weather", {"city": "Paris"})]
    assert parser.finish_reason("stop") == "stop"  # as OpenAI and vLLM, for a named call


def test_named_parser_constrains_to_the_parameters_schema():
    weather, no_parameters = request(tools=[WEATHER, TIME]).tools
    params = SamplingParams()
    NamedToolParser(weather.function).adjust_request(params)
    assert params.structured_outputs.json == WEATHER["function"]["parameters"]
    NamedToolParser(no_parameters.function).adjust_request(params)
    assert params.structured_outputs.json == {"type": "object", "properties": {}}


def test_required_schema_accepts_calls_to_any_tool_and_nothing_else():
    tools = request(tools=[WEATHER, TIME]).tools
    schema = RequiredToolParser(tools).json_schema()
    assert schema["$defs"] == {"unit": {"enum": ["celsius", "fahrenheit"]}}
    valid = [
        {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}},
        {"name": "get_time", "parameters": {}},
    ]
    jsonschema.validate(valid, schema)
    for invalid in (
        [],
        [{"name": "get_weather", "parameters": {"unit": "celsius"}}],  # city missing
        [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}}],
        [{"name": "send_email", "parameters": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(invalid, schema)
    single = RequiredToolParser(tools, parallel_tool_calls=False).json_schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(valid, single)
    params = SamplingParams()
    RequiredToolParser(tools).adjust_request(params)
    assert params.structured_outputs.json == schema


def test_required_schema_refuses_tools_defining_one_def_differently():
    other = json.loads(json.dumps(WEATHER))
    other["function"]["name"] = "get_forecast"
    other["function"]["parameters"]["$defs"]["unit"] = {"enum": ["kelvin"]}
    with pytest.raises(ValueError, match="^tools: \\$defs 'unit'"):
        RequiredToolParser(request(tools=[WEATHER, other]).tools).json_schema()


def test_required_parser_sends_each_call_once_its_object_closes():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    first_end = text.index("}}") + 2
    parser = RequiredToolParser([])
    assert parser.extract_tool_calls_streaming(text[: first_end - 1], False) is None
    [first] = parser.extract_tool_calls_streaming(text[first_end - 1 : first_end], False).tool_calls
    assert (first.index, first.function.name) == (0, "get_weather")
    assert json.loads(first.function.arguments) == {"city": "Paris"}
    [second] = parser.extract_tool_calls_streaming(text[first_end:], True).tool_calls
    assert (second.index, second.function.name, second.function.arguments) == (1, "get_time", "{}")
    assert parser.finish_reason("stop") == "tool_calls"
    for size in (1, 4, 9):
        pieces = [text[i : i + size] for i in range(0, len(text), size)] + [""]
        streamed = merge_deltas(stream(RequiredToolParser([]), pieces))
        assert calls(streamed) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
        assert streamed.content is None


def test_required_output_cut_short_is_content():
    cut = '[{"name": "get_weather", "parameters": {"ci'
    parser = RequiredToolParser([])
    extracted = parser.extract_tool_calls(cut)
    assert (extracted.tools_called, extracted.content) == (False, cut)
    assert parser.finish_reason("length") == "length"


def test_tool_choice_picks_the_parser():
    assert get_tool_parser(request(), "hermes") is None
    assert get_tool_parser(request(tools=[WEATHER], tool_choice="none"), "hermes") is None
    auto = request(tools=[WEATHER], parallel_tool_calls=False)
    assert auto.tool_choice == "auto"  # the default when tools are given
    parser = get_tool_parser(auto, "hermes")()
    assert isinstance(parser, Hermes2ProToolParser) and parser.parallel_tool_calls is False
    assert isinstance(get_tool_parser(auto, "pythonic")(), PythonicToolParser)
    with pytest.raises(ValueError) as refused:
        get_tool_parser(auto, None)
    assert str(refused.value) == AUTO_TOOL_CHOICE_DISABLED
    assert AUTO_TOOL_CHOICE_DISABLED == (
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    )
    required = get_tool_parser(request(tools=[WEATHER, TIME], tool_choice="required"), None)()
    assert isinstance(required, RequiredToolParser) and len(required.tools) == 2
    named = request(
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    parser = get_tool_parser(named, None)()
    assert isinstance(parser, NamedToolParser) and parser.function.name == "get_time"
