"""Structured outputs: sampling constrained to a JSON Schema, JSON, a regex, choices or a grammar.

vLLM V1's design on the xgrammar backend (Dong et al. 2024, "XGrammar: Flexible and Efficient
Structured Generation Engine for Large Language Models"): a request's constraint is compiled
once against the tokenizer's vocabulary into a grammar with precomputed token masks (xgrammar
caches compiled grammars by their source, so a schema sent again is not compiled again); each
sequence gets a ``GrammarMatcher`` (a pushdown automaton over the grammar); before every step
that samples a constrained sequence the engine asks its matcher for a bitmask of the tokens
allowed next, the model runner sets every other token's logit to -inf before sampling, and the
matcher then accepts the sampled token. When the grammar is complete only EOS is allowed; once
the matcher has accepted it (or, with ``ignore_eos``, any token that ends the grammar) the
sequence is finished.

The manager lives in the engine's process next to the scheduler (the bitmask travels to
tensor-parallel workers inside the ``SchedulerOutput``). xgrammar is imported on first use: an
engine that never sees a constrained request never loads it, and unconstrained requests cost
one empty-dict check per step.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from kvpilot.engine.sampling_params import StructuredOutputsParams
from kvpilot.engine.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger("kvpilot.engine")

# Most bytes of compiled grammars xgrammar keeps cached (vLLM's default, 512 MiB).
GRAMMAR_CACHE_LIMIT_BYTES = 512 * 2**20
# Threads xgrammar may use to compile one grammar.
COMPILE_THREADS = 2
# xgrammar prefixes its errors with "[hh:mm:ss] /path/to/file.cc:123: ".
_XGRAMMAR_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class StructuredOutputManager:
    """Compiles constraints and keeps one grammar matcher per constrained sequence.

    Args:
        load_tokenizer: returns a tokenizer for this manager alone (called once, on first
            compile): building xgrammar's vocabulary table reads the whole tokenizer, and the
            engine's own tokenizer is busy on the engine thread.
        vocab_size: the model's vocabulary size (its logits' width, possibly padded beyond the
            tokenizer's).
        eos_token_ids: the tokens that end a sequence once its grammar is complete.

    ``compile`` is thread-safe (a server compiles on a worker thread before it adds the
    request); everything else runs on the engine's thread.
    """

    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: Iterable[int]
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._matchers: dict[str, xgrammar.GrammarMatcher] = {}

    @property
    def is_loaded(self) -> bool:
        """Whether xgrammar's compiler exists (False until the first constrained request)."""
        return self._compiler is not None

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """Compile a constraint (or fetch it from xgrammar's cache).

        Args:
            params: the constraint; ``choice`` becomes the grammar ``root ::= "a" | "b" ...``,
                ``json_object`` the JSON Schema ``{"type": "object"}``.

        Returns:
            The compiled grammar, from which ``add_request`` builds matchers.

        Raises:
            ValueError: ``structured_outputs: ...`` naming what is invalid (a JSON Schema that
                does not parse or uses an unsupported feature, a bad regex or grammar).
        """
        compiler = self._get_compiler()
        kind = params.kind
        any_whitespace = not params.disable_any_whitespace
        try:
            if kind == "json":
                schema = params.json
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, dict):
                    raise ValueError("a JSON Schema must be a JSON object")
                return compiler.compile_json_schema(
                    json.dumps(schema), any_whitespace=any_whitespace
                )
            if kind == "json_object":
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=any_whitespace
                )
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
                return compiler.compile_grammar(f"root ::= {alternatives}")
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"structured_outputs: invalid {kind}: {_reason(exc)}") from None

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._load_tokenizer(),
                    vocab_size=self.vocab_size,
                    stop_token_ids=self.eos_token_ids or None,
                )
                self._compiler = xgrammar.GrammarCompiler(
                    info,
                    max_threads=COMPILE_THREADS,
                    cache_limit_bytes=GRAMMAR_CACHE_LIMIT_BYTES,
                )
            return self._compiler

    def add_request(self, request_id: str, grammar: xgrammar.CompiledGrammar) -> None:
        """Start a matcher at the beginning of ``grammar`` for one sequence."""
        import xgrammar

        self._matchers[request_id] = xgrammar.GrammarMatcher(grammar)

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Forget the matchers of finished or aborted sequences (unknown ids are ignored)."""
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        """Whether the sequence is constrained."""
        return request_id in self._matchers

    @property
    def num_requests(self) -> int:
        """Constrained sequences in flight."""
        return len(self._matchers)

    def set_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        """Set ``scheduler_output.grammar_bitmask`` for the constrained sequences that sample
        this step (left None when there are none).

        The bitmask is ``[num_constrained, ceil(vocab_size / 32)]`` int32 on the CPU: bit
        ``j % 32`` of word ``j // 32`` is set when token ``j`` may come next; its rows follow
        ``scheduler_output.structured_output_request_ids``.
        """
        if not self._matchers:
            return
        request_ids = [
            s.request.request_id
            for s in scheduler_output.scheduled
            if s.sample and s.request.request_id in self._matchers
        ]
        if not request_ids:
            return
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(request_ids), self.vocab_size)
        for row, request_id in enumerate(request_ids):
            self._matchers[request_id].fill_next_token_bitmask(bitmask, row)
        scheduler_output.structured_output_request_ids = request_ids
        scheduler_output.grammar_bitmask = bitmask

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance a sequence's matcher over its newly sampled tokens.

        Returns:
            False when the sequence cannot go on: its grammar is complete and has taken its
            end token, or the matcher refused a token (possible only when every allowed token
            was masked by another rule, e.g. EOS before ``min_tokens``). True otherwise, and
            for sequences without a constraint.
        """
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return True
        for token_id in token_ids:
            if not matcher.accept_token(token_id):
                logger.warning(
                    "request %s: token %d is outside its grammar; ending it", request_id, token_id
                )
                return False
        return not matcher.is_terminated()


def check_json_schema(schema: dict[str, Any]) -> None:
    """Check that ``schema`` is a JSON Schema structured outputs can enforce, without compiling
    it against a vocabulary (xgrammar converts it to a grammar in about a millisecond and needs
    no tokenizer). Keywords xgrammar does not know are ignored, as JSON Schema allows.

    Raises:
        ValueError: what is wrong (e.g. ``Unsupported type "objekt"``), as xgrammar reports it.
    """
    import xgrammar

    try:
        xgrammar.Grammar.from_json_schema(json.dumps(schema))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(_reason(exc)) from None


def _reason(exc: Exception) -> str:
    return _XGRAMMAR_ERROR_PREFIX.sub("", str(exc)).strip()


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of the tokens a grammar does not allow next to -inf, in place.

    Args:
        logits: ``[num_rows, vocab_size]`` float logits.
        bitmask: ``[len(rows), ceil(vocab_size / 32)]`` int32 (xgrammar's layout: bit ``j % 32``
            of word ``j // 32`` set when token ``j`` is allowed), on any device.
        rows: the logits row each bitmask row applies to.
    """
    vocab_size = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    words = bitmask.to(device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
