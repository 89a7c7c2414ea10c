"""Reasoning parsers on fixed strings: ``deepseek_r1`` and ``qwen3`` split an output as vLLM
0.32's parsers do (the expected values below are vLLM's streamed answers for the same text;
where its whole answer differs from its own stream, a comment says so), streamed in any split
(the default model's tokens write ``<think>`` in pieces) as whole, with tool calls read from the
content; and the ``--reasoning-parser`` flag."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from kvpilot.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvpilot.engine.server import cli
from kvpilot.engine.server.app import ServerConfig
from kvpilot.engine.server.output_parsers import OutputParsers
from kvpilot.engine.server.protocol import DeltaMessage
from kvpilot.engine.server.reasoning_parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    get_reasoning_parser,
)
from kvpilot.engine.server.tool_parsers import (
    Hermes2ProToolParser,
    PythonicToolParser,
    ToolParser,
)
from tests.server.test_tool_parsers import splits

PARSERS = [DeepSeekR1ReasoningParser, Qwen3ReasoningParser]


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("The user greets me.</think>Hello!", "The user greets me.", "Hello!"),
        ("<think>The user greets me.</think>Hello!", "The user greets me.", "Hello!"),
        ("<think>\nHmm.\n</think>\n\nHello!", "\nHmm.\n", "\n\nHello!"),
        # No </think>: all reasoning (the model was cut short, or never closed it).
        ("Still thinking", "Still thinking", None),
        ("<think>Still thinking", "Still thinking", None),
        ("Done.</think>", "Done.", None),
        ("<think>a<think>b</think>c", "ab", "c"),  # vLLM's whole deepseek_r1: "a<think>b"
        ("", None, None),
        ("</think>", None, None),  # vLLM's whole deepseek_r1: reasoning ""
    ],
)
def test_both_parsers_split_at_the_end_of_the_block(parser, text, reasoning, content):
    assert parser().extract_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize("parser", PARSERS)
def test_think_tags_after_the_block_are_dropped_from_the_content(parser):
    # vLLM's streamed answer with single-token tags; its whole answer keeps the second tag.
    assert parser().extract_reasoning("a</think>b</think>c") == ("a", "bc")
    assert parser().extract_reasoning("a</think>\n<think>b</think>c") == ("a", "\nbc")
    # vLLM's streamed answer; its non-streamed deepseek_r1 answer drops the "x" ("a").
    assert parser().extract_reasoning("x<think>a</think>b") == ("xa", "b")
    # Streamed in single characters: no piece of a tag is ever sent.
    reasoner = parser()
    deltas = [reasoner.extract_reasoning_streaming(c, False) for c in "a</think>b</thi"]
    deltas.append(reasoner.extract_reasoning_streaming("nk>c<th", True))
    content = "".join(d.content or "" for d in deltas if d is not None)
    assert content == "bc<th"  # an unfinished tag at the very end is text


def test_qwen3_tool_call_ends_the_reasoning_and_deepseek_r1_does_not():
    text = 'Let me check.<tool_call>{"name": "f"}</tool_call>'
    assert Qwen3ReasoningParser().extract_reasoning(text) == (
        "Let me check.",
        '<tool_call>{"name": "f"}</tool_call>',
    )
    assert DeepSeekR1ReasoningParser().extract_reasoning(text) == (text, None)


@pytest.mark.parametrize("enable_thinking", [False, 0])
def test_qwen3_without_thinking_is_all_content(enable_thinking):
    parser = Qwen3ReasoningParser({"enable_thinking": enable_thinking})
    text = "<think>a</think>b"
    assert parser.extract_reasoning(text) == (None, text)
    assert Qwen3ReasoningParser({"enable_thinking": True}).extract_reasoning(text) == ("a", "b")
    # deepseek_r1 has no such switch, as in vLLM.
    assert DeepSeekR1ReasoningParser({"enable_thinking": False}).extract_reasoning(text) == (
        "a",
        "b",
    )


@pytest.mark.parametrize("parser", PARSERS)
def test_constrained_output_is_content_unless_it_opens_the_block(parser):
    assert parser(constrained=True).extract_reasoning('{"a": 1}') == (None, '{"a": 1}')
    assert parser(constrained=True).extract_reasoning("a</think>b") == (None, "a</think>b")
    assert parser(constrained=True).extract_reasoning("<think>a</think>b") == ("a", "b")
    assert parser(constrained=True).extract_reasoning("<thi") == (None, "<thi")
    # Streamed, the start waits only while it may still be <think>.
    streaming = parser(constrained=True)
    assert streaming.extract_reasoning_streaming("<th", False) is None
    assert streaming.extract_reasoning_streaming("is", False) == DeltaMessage(content="<this")


def stream(parser: ReasoningParser, pieces: list[str]) -> list[DeltaMessage | None]:
    """Feed ``pieces`` as deltas; the last one finishes the output."""
    return [
        parser.extract_reasoning_streaming(piece, finished=i == len(pieces) - 1)
        for i, piece in enumerate(pieces)
    ]


def joined(deltas: list[DeltaMessage | None], field: str) -> str | None:
    return "".join(getattr(d, field) or "" for d in deltas if d is not None) or None


FORCED = "<think>\nThe user wants the weather.\n</think>\n\nIt is sunny in Paris."


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize(
    "text",
    [
        FORCED,
        FORCED.removeprefix("<think>"),
        "No end in sight <",
        "a </thinking> b</think>c <think> d",
        "x <tool_call> y</think>z",
    ],
)
def test_streaming_in_any_split_equals_the_whole_output(parser, text, default_tokenizer):
    # The default model's tokenizer has no <think> token: the tags arrive in pieces.
    assert len(default_tokenizer.encode("</think>", add_special_tokens=False)) > 1
    whole = parser().extract_reasoning(text)
    for pieces in splits(text, default_tokenizer):
        for end in ([], [""]):  # the last token finishes, or an empty final delta does
            deltas = stream(parser(), pieces + end)
            assert (joined(deltas, "reasoning"), joined(deltas, "content")) == whole, pieces
            assert not any(d is not None and "" in (d.reasoning, d.content) for d in deltas)


def test_a_tag_split_across_deltas_is_held_back_and_never_sent():
    parser = DeepSeekR1ReasoningParser()
    deltas = stream(parser, ["I think", " so</", "thi", "nk>", "Yes", "!"])
    assert deltas == [
        DeltaMessage(reasoning="I think"),
        DeltaMessage(reasoning=" so"),
        None,
        None,
        DeltaMessage(content="Yes"),
        DeltaMessage(content="!"),
    ]
    # "<" that does not start a tag is released once it cannot; at the end, whatever waits.
    other = DeepSeekR1ReasoningParser()
    assert other.extract_reasoning_streaming("a <", False) == DeltaMessage(reasoning="a ")
    assert other.extract_reasoning_streaming("b", False) == DeltaMessage(reasoning="<b")
    assert other.extract_reasoning_streaming("</thi", False) is None
    assert other.extract_reasoning_streaming("", True) == DeltaMessage(reasoning="</thi")
    # Reasoning and content of one delta come together.
    both = Qwen3ReasoningParser().extract_reasoning_streaming("a</think>b", False)
    assert both == DeltaMessage(reasoning="a", content="b")


def test_qwen3_keeps_special_tokens_and_deepseek_r1_leaves_them():
    params = SamplingParams()
    DeepSeekR1ReasoningParser().adjust_request(params)
    assert params.skip_special_tokens is True
    Qwen3ReasoningParser().adjust_request(params)
    assert params.skip_special_tokens is False


def test_the_request_picks_the_parser():
    free, constrained = SamplingParams(), SamplingParams()
    constrained.structured_outputs = StructuredOutputsParams(json_object=True)
    assert get_reasoning_parser(None, {}, free) is None
    parser = get_reasoning_parser("qwen3", {"enable_thinking": False}, free)()
    assert isinstance(parser, Qwen3ReasoningParser) and not parser.thinking_enabled()
    parser = get_reasoning_parser("deepseek_r1", None, constrained)()
    assert isinstance(parser, DeepSeekR1ReasoningParser) and parser.constrained
    assert list(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]


def parse_both(
    reasoning: type[ReasoningParser] | None,
    tools: type[ToolParser] | None,
    text: str,
    pieces: list[str],
):
    """``OutputParsers`` on ``text``, whole and streamed in ``pieces`` (joined as a client
    does), each as ``(reasoning, content, [(name, arguments)] or None, finish_reason)``."""
    parsers = OutputParsers(reasoning, tools, include_reasoning=True)
    reasoning_text, content, tool_calls, finish_reason = parsers.choice().whole(text, "stop")
    pairs = [(c.function.name, c.function.arguments) for c in tool_calls or []]
    whole = (reasoning_text, content, pairs or None, finish_reason)
    choice = parsers.choice()
    deltas = [choice.delta(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for piece in delta and delta.tool_calls or []:
            call = calls.setdefault(piece.index, ["", ""])
            call[0] += piece.function.name or ""
            call[1] += piece.function.arguments or ""
    streamed = (
        joined(deltas, "reasoning"),
        joined(deltas, "content"),
        [tuple(call) for call in calls.values()] or None,
        choice.finish_reason("stop"),
    )
    return whole, streamed


@pytest.mark.parametrize(
    ("reasoning", "tools", "text", "expected"),
    [
        # (vLLM's pythonic parser wants "[" first; kvpilot skips the whitespace after </think>.)
        (
            DeepSeekR1ReasoningParser,
            PythonicToolParser,
            'Paris, then.</think>\n\n[get_weather(city="Paris")]',
            ("Paris, then.", None, [("get_weather", '{"city": "Paris"}')], "tool_calls"),
        ),
        (
            Qwen3ReasoningParser,
            Hermes2ProToolParser,
            'Paris.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
            ("Paris.", None, [("get_weather", '{"city": "Paris"}')], "tool_calls"),
        ),
        # A call inside the reasoning is no call: vLLM reads the content only.
        (
            DeepSeekR1ReasoningParser,
            PythonicToolParser,
            '[get_weather(city="Paris")]</think>Sunny.',
            ('[get_weather(city="Paris")]', "Sunny.", None, "stop"),
        ),
        # All reasoning: no content for the tool parser.
        (DeepSeekR1ReasoningParser, PythonicToolParser, "Hmm", ("Hmm", None, None, "stop")),
        (DeepSeekR1ReasoningParser, None, "Hmm</think>Hi", ("Hmm", "Hi", None, "stop")),
        (None, PythonicToolParser, "Hmm</think>Hi", (None, "Hmm</think>Hi", None, "stop")),
    ],
)
def test_tool_calls_are_read_from_the_content_only(
    reasoning, tools, text, expected, default_tokenizer
):
    for pieces in splits(text, default_tokenizer)[:20]:
        assert parse_both(reasoning, tools, text, pieces) == (expected, expected), pieces


def test_include_reasoning_false_drops_the_reasoning_only():
    text = "Hmm</think>Hi"
    parsers = OutputParsers(DeepSeekR1ReasoningParser, None, include_reasoning=False)
    assert parsers.hides_tokens
    assert parsers.choice().whole(text, "stop") == (None, "Hi", None, "stop")
    choice = parsers.choice()
    assert [choice.delta(p, p == "Hi") for p in ["Hm", "m</thi", "nk>", "Hi"]] == [
        None,
        None,
        None,
        DeltaMessage(content="Hi"),
    ]
    assert not OutputParsers(None, None, include_reasoning=False).hides_tokens
    assert not OutputParsers(DeepSeekR1ReasoningParser, None, include_reasoning=True).hides_tokens


def test_reasoning_parser_flag_takes_vllms_names_and_refuses_others(capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--reasoning-parser", "qwen3"])
    assert cli._configure(args)[1].reasoning_parser == "qwen3"
    assert cli._configure(parser.parse_args([]))[1].reasoning_parser is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-parser", "deepseek"])
    assert (
        "argument --reasoning-parser: invalid choice: 'deepseek' "
        "(choose from 'deepseek_r1', 'qwen3')"
    ) in capsys.readouterr().err
    # vLLM 0.32 has no --enable-reasoning (the parser alone turns reasoning on).
    with pytest.raises(SystemExit):
        parser.parse_args(["--enable-reasoning", "--reasoning-parser", "qwen3"])
    assert "unrecognized arguments: --enable-reasoning" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--reasoning-parser: unknown parser 'x' \(choose from"):
        ServerConfig(served_model_names=["m"], reasoning_parser="x")


def test_kvpilot_serve_with_an_unknown_reasoning_parser_stops_before_loading():
    result = subprocess.run(
        [sys.executable, "-m", "kvpilot", "serve", "--reasoning-parser", "r1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "invalid choice: 'r1' (choose from 'deepseek_r1', 'qwen3')" in result.stderr


# Tokens of a fixed vocabulary, the tags in pieces ("</", "think", ">"), as many tokenizers
# write them: the count must find the token that completes the end tag.
PIECES = ["<", "think", ">", "Let", " me", " see", ".", "</", "<tool_call>", "It", " is", " 4"]


def piece_ids(*pieces: str) -> list[int]:
    return [PIECES.index(piece) for piece in pieces]


def decode_pieces(token_ids) -> str:
    return "".join(PIECES[i] for i in token_ids)


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize(
    ("pieces", "expected"),
    [
        # Up to the ">" that completes "</think>": 8 tokens (the opening tag's 3 included).
        (("<", "think", ">", "Let", " me", "</", "think", ">", "It", " is", " 4"), 8),
        # Starting inside the block (the template opened it): "Let me</think>" is 5 tokens.
        (("Let", " me", "</", "think", ">", "It"), 5),
        # Never closed: all reasoning.
        (("Let", " me", " see", "."), 4),
        # Closed at the last token: no content, every token reasoning.
        (("Let", "</", "think", ">"), 4),
    ],
)
def test_reasoning_tokens_end_with_the_token_that_completes_the_end_tag(parser, pieces, expected):
    ids = piece_ids(*pieces)
    assert parser().count_reasoning_tokens(ids, decode_pieces) == expected


def test_reasoning_tokens_of_outputs_without_reasoning_are_zero():
    ids = piece_ids("It", " is", " 4")
    # A constrained output that does not open the block, and thinking turned off.
    assert Qwen3ReasoningParser(constrained=True).count_reasoning_tokens(ids, decode_pieces) == 0
    off = Qwen3ReasoningParser({"enable_thinking": False})
    closed = piece_ids("Let", "</", "think", ">", "It")
    assert off.count_reasoning_tokens(closed, decode_pieces) == 0
    # The interface's default: a parser that cannot tell counts none.
    assert ReasoningParser().count_reasoning_tokens(closed, decode_pieces) == 0


def test_qwen3_reasoning_tokens_end_at_a_tool_call():
    ids = piece_ids("Let", " me", "<tool_call>", "It")
    assert Qwen3ReasoningParser().count_reasoning_tokens(ids, decode_pieces) == 3
    assert DeepSeekR1ReasoningParser().count_reasoning_tokens(ids, decode_pieces) == 4
