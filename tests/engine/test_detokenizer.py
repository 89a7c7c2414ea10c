"""IncrementalDetokenizer on the default model's real tokenizer (SmolLM2, byte-level BPE)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from transformers import PreTrainedTokenizerFast

from kvpilot.engine.detokenizer import IncrementalDetokenizer, logprob_token_text
from kvpilot.engine.model_loader import load_tokenizer, resolve_model
from kvpilot.engine.sampling_params import SamplingParams

CHAT_PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode(CHAT_PROMPT)


def stream(tokenizer, prompt_ids, output_ids, **params):
    """Feed ``output_ids`` one token at a time, as the engine does.

    Returns (final text, list of texts seen while running, matched stop, tokens consumed).
    Checks on the way that every text extends the previous one.
    """
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(**params))
    seen: list[str] = []
    stop = None
    consumed = 0
    for token_id in output_ids:
        stop = detok.update([token_id])
        consumed += 1
        text = detok.get_text(finished=stop is not None)
        assert text.startswith(seen[-1] if seen else "")
        seen.append(text)
        if stop is not None:
            break
    final = detok.get_text(finished=True)
    assert final.startswith(seen[-1] if seen else "")
    return final, seen, stop, consumed


@pytest.mark.parametrize(
    "text",
    [
        "你好，世界！今天天气很好。",
        "Launch 🚀🎉 party, family: 👨‍👩‍👧",
        "café naïve Ünïcödé — ½ €",
        "日本語とEnglishの混在 😀 text",
    ],
)
def test_multibyte_characters_split_across_tokens_are_never_garbled(tokenizer, prompt_ids, text):
    output_ids = tokenizer.encode(text)
    # The case is only meaningful when some token alone is an incomplete UTF-8 sequence.
    assert any("\ufffd" in tokenizer.decode([t]) for t in output_ids)
    final, seen, stop, _ = stream(tokenizer, prompt_ids, output_ids)
    assert stop is None
    assert final == text
    for partial in seen:
        assert "\ufffd" not in partial
        assert text.startswith(partial)
    # Deltas are emitted as soon as a character is complete, not only at the end.
    assert len(set(seen)) > len(text) // 3


def test_text_equals_tokenizer_decode_for_random_token_sequences(tokenizer, prompt_ids):
    rng = random.Random(0)
    vocab = range(17, tokenizer.vocab_size)  # ids below 17 are special tokens
    for _ in range(20):
        output_ids = [rng.choice(vocab) for _ in range(rng.randint(1, 30))]
        final, seen, _, _ = stream(tokenizer, prompt_ids, output_ids)
        assert final == tokenizer.decode(output_ids)
        for partial in seen:
            assert final.startswith(partial)


def test_unfinished_trailing_bytes_are_held_then_left_out(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("ok 🚀")
    cut = output_ids[:-1]  # the rocket's last byte is missing
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    for token_id in cut:
        detok.update([token_id])
    assert detok.get_text(finished=False) == "ok "  # complete characters are released
    # A character max_tokens cut in half is left out (vLLM), where decode() ends in U+FFFD.
    assert tokenizer.decode(cut) == "ok \ufffd"
    assert detok.get_text(finished=True) == "ok "


def test_stop_string_spanning_tokens_is_removed(tokenizer, prompt_ids):
    text = "The quick brown fox jumps over the lazy dog."
    output_ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([t]) for t in output_ids]
    assert " brown" in pieces and " fox" in pieces  # the stop string spans two tokens
    final, seen, stop, consumed = stream(tokenizer, prompt_ids, output_ids, stop=["brown fox"])
    assert stop == "brown fox"
    assert final == "The quick "
    assert consumed == pieces.index(" fox") + 1  # found as soon as its last token arrives
    assert all("brown" not in partial for partial in seen)


def test_stop_string_included_when_asked(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    final, seen, stop, _ = stream(
        tokenizer, prompt_ids, output_ids, stop=["brown fox"], include_stop_str_in_output=True
    )
    assert stop == "brown fox"
    assert final == "The quick brown fox"
    assert seen[-1] == final


def test_stop_string_inside_one_token_truncates_within_it(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("The quick brown fox")
    final, _, stop, consumed = stream(tokenizer, prompt_ids, output_ids, stop=["uic"])
    assert (final, stop, consumed) == ("The q", "uic", 2)


def test_earliest_stop_string_wins(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("alpha beta gamma delta")
    final, _, stop, _ = stream(tokenizer, prompt_ids, output_ids, stop=["delta", "beta gamma"])
    assert (final, stop) == ("alpha ", "beta gamma")


def test_multibyte_stop_string_split_across_byte_tokens(tokenizer, prompt_ids):
    text = "你好，世界！再见"
    output_ids = tokenizer.encode(text)
    final, seen, stop, _ = stream(tokenizer, prompt_ids, output_ids, stop=["世界"])
    assert (final, stop) == ("你好，", "世界")
    assert all("\ufffd" not in partial and "世" not in partial for partial in seen)


def test_text_that_might_start_a_stop_string_is_held_back_then_released(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("Hello world")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=[" worldwide"]))
    assert detok.update(output_ids) is None
    assert detok.get_text(finished=False) == "Hello"
    assert detok.get_text(finished=True) == "Hello world"


def test_update_after_stop_is_an_error(tokenizer, prompt_ids):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=["lo"]))
    assert detok.update(tokenizer.encode("Hello")) == "lo"
    with pytest.raises(RuntimeError, match="'lo'"):
        detok.update(tokenizer.encode(" again"))


def _special_output(tokenizer) -> list[int]:
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    return [*tokenizer.encode("Hello"), im_end, im_start, *tokenizer.encode("world")]


def test_special_tokens_skipped_by_default(tokenizer, prompt_ids):
    final, *_ = stream(tokenizer, prompt_ids, _special_output(tokenizer))
    assert final == "Helloworld"


def test_special_tokens_kept_without_spaces_by_a_fast_tokenizer(tokenizer, prompt_ids):
    # vLLM's fast-tokenizer detokenizer puts no spaces around special tokens, whatever
    # spaces_between_special_tokens says; transformers' fast decode() neither.
    output_ids = _special_output(tokenizer)
    for spaced in (True, False):
        final, *_ = stream(
            tokenizer,
            prompt_ids,
            output_ids,
            skip_special_tokens=False,
            spaces_between_special_tokens=spaced,
        )
        assert final == "Hello<|im_end|><|im_start|>world"


def test_output_token_ids_exclude_the_prompt(tokenizer, prompt_ids):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    detok.update([19556])
    detok.update([905])
    assert detok.output_token_ids == [19556, 905]


@pytest.fixture(scope="module")
def sentencepiece_style_tokenizer():
    """A small Llama-2-style tokenizer: ``▁`` for spaces, byte-fallback tokens ``<0xE4>``, and a
    decoder that strips the first leading space (so single tokens decode without context)."""
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizer
    corpus = ["hello world the quick brown fox jumps over the lazy dog"] * 20
    base.train_from_iterator(corpus, trainers.BpeTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    trained = json.loads(base.to_str())["model"]
    pieces = [t for t in sorted(trained["vocab"], key=trained["vocab"].get) if t[0] != "<"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *byte_tokens, *pieces])}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.mark.parametrize("text", ["the fox jumps 你好 over 🚀 dog", "über lazy 😀😀 world"])
def test_space_prefix_and_byte_fallback_tokenizer_keeps_context(
    sentencepiece_style_tokenizer, text
):
    tok = sentencepiece_style_tokenizer
    prompt_ids = tok.encode("hello world")
    output_ids = tok.encode(text, add_special_tokens=False)
    assert any(t.startswith("<0x") for t in tok.convert_ids_to_tokens(output_ids))
    final, seen, _, _ = stream(tok, prompt_ids, output_ids)
    # Decoded after the prompt, the first token keeps its leading space.
    prompt_text = tok.decode(prompt_ids)
    assert final == tok.decode(prompt_ids + output_ids)[len(prompt_text) :] == " " + text
    assert all("\ufffd" not in partial for partial in seen)


def test_stop_strings_before_min_tokens_are_ignored(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("ab ab ab ab")
    assert [tokenizer.decode([t]) for t in output_ids] == ["ab", " ab", " ab", " ab"]
    final, _, stop, consumed = stream(tokenizer, prompt_ids, output_ids, stop=["ab"], min_tokens=2)
    # As in vLLM, the "ab"s completed by output tokens 1 and 2 (of at least 2) are ignored: the
    # third one stops.
    assert (final, stop, consumed) == ("ab ab ", "ab", 3)


def test_a_short_stop_string_before_min_tokens_stays_ignored_beside_a_long_one(
    tokenizer, prompt_ids
):
    # "." ends within the first min_tokens outputs; "\n\nThe", which is longer, is searched
    # back over it later, but "." must not be found there (vLLM searches each string's own
    # window): "\n\nThe" stops, with " Paris." kept.
    output_ids = tokenizer.encode(" Paris.\n\nThe end")
    pieces = [tokenizer.decode([t]) for t in output_ids]
    assert pieces[:5] == [" Paris", ".", "\n", "\n", "The"]
    for stops in ([".", "\n\nThe"], ["\n\nThe", "."]):
        final, _, stop, consumed = stream(
            tokenizer, prompt_ids, output_ids, stop=stops, min_tokens=3
        )
        assert (final, stop, consumed) == (" Paris.", "\n\nThe", 5)


def test_logprob_texts_of_a_split_character_join_into_the_text(tokenizer):
    # vLLM's logprobs: "" for the tokens that hold the first bytes of a character, the whole
    # character on the token that completes it; so the entries join into the text and their
    # UTF-8 bytes are real (never U+FFFD's).
    text = " 🌟 ok 世界🚀"
    ids = tokenizer.encode(text)
    alone = [tokenizer.decode([t]) for t in ids]
    assert any(piece.endswith("\ufffd") for piece in alone)
    shown = [
        logprob_token_text(tokenizer, t, piece, ids[:i])
        for i, (t, piece) in enumerate(zip(ids, alone, strict=True))
    ]
    assert "".join(shown) == text
    assert not any("\ufffd" in piece for piece in shown)
    assert shown[0] == "" and " ok" in shown
    # Without the tokens before it (the first output token) an incomplete part shows "".
    assert logprob_token_text(tokenizer, ids[1], alone[1], []) == ""
