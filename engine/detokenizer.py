"""Incremental, byte-safe detokenization with stop-string matching.

Algorithm (the prefix/read-offset scheme of vLLM's ``detokenize_incrementally`` and Hugging
Face's TGI): every step decodes a short window of recent tokens twice, once up to the last
emitted token (``prefix_offset:read_offset``) and once up to the newest token
(``prefix_offset:``); the new text is the difference. Decoding a window instead of single tokens
keeps tokenizer-specific context right (a SentencePiece ``▁`` becomes a space only after another
token; byte-level BPE splits one character over several tokens). When the window ends in an
incomplete UTF-8 sequence (the decoder yields U+FFFD there) the offsets stay put until a later
token completes it, so no replacement character is ever emitted; a character still incomplete
when the sequence ends (``max_tokens`` cut it) is left out, as vLLM leaves it out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from kvpilot.engine.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded with the first output token, so that it gets its context (a leading
# space, a merged byte sequence). vLLM uses the same number.
_INITIAL_PREFIX_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text as they arrive, and finds stop strings.

    Args:
        tokenizer: a Hugging Face tokenizer (``PreTrainedTokenizerBase``); only ``decode`` is
            used.
        prompt_token_ids: the prompt, ``[num_prompt_tokens]`` token ids; its last tokens give
            the first output token its context.
        params: ``stop``, ``include_stop_str_in_output``, ``min_tokens``,
            ``skip_special_tokens`` and ``spaces_between_special_tokens`` are read (the latter
            goes to the tokenizer's ``decode``: transformers' SentencePiece tokenizers honour
            it, fast ones put no spaces around special tokens, as vLLM's fast-tokenizer path).

    ``update`` appends tokens and reports a matched stop string; ``get_text`` returns the text
    that is safe to show. Text returned by ``get_text`` only ever grows, so streamed deltas
    concatenate exactly to the final text.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self._tokenizer = tokenizer
        self._params = params
        self._token_ids: list[int] = list(prompt_token_ids)
        self._num_prompt_tokens = len(prompt_token_ids)
        self._read_offset = len(prompt_token_ids)
        self._prefix_offset = max(len(prompt_token_ids) - _INITIAL_PREFIX_TOKENS, 0)
        # Text of windows that ended on a character boundary (final; never changes).
        self._text = ""
        # Text decoded after ``_read_offset``, still waiting for the rest of a character.
        self._pending = ""
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        self._checked_len = 0  # visible characters already searched for stop strings
        self._stop_text: str | None = None  # the final text once a stop string matched
        self.stop_reason: str | None = None

    @property
    def recent_output_token_ids(self) -> list[int]:
        """The last (up to) 4 output token ids: context enough for any UTF-8 character."""
        return self._token_ids[max(self._num_prompt_tokens, len(self._token_ids) - 4) :]

    @property
    def output_token_ids(self) -> list[int]:
        """The output token ids seen so far, ``[num_output_tokens]``."""
        return self._token_ids[self._num_prompt_tokens :]

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append newly generated tokens; return the stop string they complete, if any.

        Args:
            new_token_ids: token ids generated this step (usually one).

        Returns:
            The element of ``params.stop`` that now appears in the output text (the one that
            starts earliest), or None. A stop string counts only when a token after the first
            ``params.min_tokens`` completes it, as vLLM counts them. After a match the text is
            final: generation must stop
            with ``finish_reason="stop"`` and ``stop_reason`` set to the returned string.

        Raises:
            RuntimeError: when called again after a stop string matched.
        """
        if self.stop_reason is not None:
            raise RuntimeError(
                f"update() called after stop string {self.stop_reason!r} already ended the output"
            )
        if not new_token_ids:
            return None
        self._token_ids.extend(new_token_ids)
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._token_ids[self._prefix_offset :])
        new_text = window_text[len(prefix_text) :]
        if new_text.endswith(_REPLACEMENT_CHAR):
            self._pending = new_text
        else:
            self._text += new_text
            self._pending = ""
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._token_ids)
        if not self._params.stop:
            return None
        if len(self._token_ids) - self._num_prompt_tokens <= self._params.min_tokens:
            # As in vLLM, stop strings completed by the first min_tokens outputs do not count.
            self._checked_len = len(self._visible_text())
            return None
        return self._check_stop()

    def get_text(self, finished: bool) -> str:
        """Return the cumulative output text that is safe to emit now.

        Args:
            finished: True once the sequence is done (stop, length, EOS, abort): the text
                held back for a possible stop string is released; an incomplete trailing UTF-8
                sequence is not (vLLM leaves it out too; transformers' ``decode`` would end the
                text in U+FFFD).

        Returns:
            While not finished: the text up to the last complete character, minus the longest
            suffix that could still grow into a stop string (unless
            ``include_stop_str_in_output``). After a stop string matched: the text before it
            (or through it with ``include_stop_str_in_output``). Each result extends the
            previous one.
        """
        if self._stop_text is not None:
            return self._stop_text
        if finished:
            return self._visible_text()
        visible = self._visible_text()
        if self._params.include_stop_str_in_output or not self._params.stop:
            return visible
        return visible[: len(visible) - self._stop_prefix_suffix_len(visible)]

    def _visible_text(self) -> str:
        # Characters before the trailing U+FFFD of a pending window are complete and final.
        return self._text + self._pending.rstrip(_REPLACEMENT_CHAR)

    def _check_stop(self) -> str | None:
        visible = self._visible_text()
        checked, self._checked_len = self._checked_len, len(visible)
        best: tuple[int, int, str] | None = None  # (position, -length, stop string)
        for stop in self._params.stop:
            # Only occurrences that end in the new text: one that ended in the text already
            # searched, or before min_tokens outputs, does not count (vLLM's window, per string).
            pos = visible.find(stop, max(checked - len(stop) + 1, 0))
            if pos != -1 and (best is None or (pos, -len(stop)) < best[:2]):
                best = (pos, -len(stop), stop)
        if best is None:
            return None
        pos, _, stop = best
        end = pos + len(stop) if self._params.include_stop_str_in_output else pos
        self._stop_text = visible[:end]
        self.stop_reason = stop
        return stop

    def _stop_prefix_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for length in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            suffix = text[-length:]
            if any(stop.startswith(suffix) for stop in self._params.stop):
                return length
        return 0

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._params.skip_special_tokens,
            spaces_between_special_tokens=self._params.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )


def logprob_token_text(tokenizer: Any, token_id: int, text: str, context: Sequence[int]) -> str:
    """The text a logprobs entry shows for ``token_id``, as vLLM's logprobs show it.

    A token decoded alone is usually its text. A byte-level token that holds part of a UTF-8
    character decodes alone to U+FFFD; then the text is what the token adds to the sequence
    once its character is complete: the whole character on the token that completes it (with
    the bytes the tokens before it held), and ``""`` on the tokens before, so that the entries'
    texts join into the output text and their ``bytes`` are real UTF-8.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode`` is used).
        token_id: the token of the entry (the sampled one or an alternative).
        text: ``token_id`` decoded alone.
        context: the token ids before it in the sequence, oldest first; the last 4 are read
            (a UTF-8 character has at most 4 bytes).

    Returns:
        ``text`` when it does not end in U+FFFD; else the completed character(s) the token
        adds, or ``""`` while the character is still incomplete.
    """
    if not text.endswith(_REPLACEMENT_CHAR):
        return text
    context = list(context[-4:])
    for size in range(1, len(context) + 1):
        window = context[-size:]
        full = tokenizer.decode(window + [token_id])
        if full.endswith(_REPLACEMENT_CHAR):
            continue
        # The window's trailing tokens that are themselves parts of this character give their
        # bytes to this token; the text of those before them is not this token's.
        clean = len(window)
        while clean and tokenizer.decode(window[clean - 1 : clean]).endswith(_REPLACEMENT_CHAR):
            clean -= 1
        prefix = tokenizer.decode(window[:clean]) if clean else ""
        return full[len(os.path.commonprefix([prefix, full])) :]
    return ""
