"""The thinking token budget (vLLM's ``thinking_token_budget``): once a request has thought for
its budget, the end of its think block is forced, one token a step, and sampling goes on freely
after it.

A sequence is thinking when the last think start (``ThinkingTokenIds.start``) in its tokens,
prompt included, comes after the last think end (``natural_end``). Its thinking tokens are those
after that start, the prompt's included (a prompt that opened ``<think>\\n`` has spent one). From
``budget`` thinking tokens on, the next token is forced: the first token of the end sequence
(``end``), or, where the sequence already ends with a prefix of it, the token after that prefix,
until the sequence holds the end. So a budget of N gives N thinking tokens, then the end. A
prompt whose think block is closed is not forced; a block the model opens later is counted
from its start.

Everything is read from the tokens, as vLLM's model runner V2 reads them (it keeps no count
that a preemption, a recomputation or a rejected draft could leave wrong); the positions of the
last markers are cached per sequence and extended with the tokens it gained since the last step.
With draft tokens (speculative decoding) each scored position sees the drafts before it, so a
draft that is not the forced token is rejected there.

The driver's :class:`ThinkingBudgetTracker` sets ``SchedulerOutput.forced_token_ids``, the
workers' samplers apply it with :func:`force_tokens` after the logits processors (vLLM forces
last, so nothing weakens the forced token). A step without a budgeted sequence in the engine
costs one empty-dict check.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.engine.reasoning_config import ThinkingTokenIds
from kvpilot.engine.request import Request
from kvpilot.engine.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    import torch

FORCED_LOGIT = 1e9
"""The logit a forced token gets (vLLM's): every other token's probability becomes 0 after
softmax at any temperature, and greedy decoding picks it."""


@dataclass
class _Markers:
    """Where a sequence's last think start and end begin (-1: none), over its first
    ``scanned`` tokens."""

    scanned: int = 0
    last_start: int = -1
    last_end: int = -1


class ThinkingBudgetTracker:
    """Forces the end of thinking for the sequences with a ``thinking_token_budget``.

    Args:
        token_ids: the engine's think markers (``ReasoningConfig.thinking_token_ids``).
    """

    def __init__(self, token_ids: ThinkingTokenIds) -> None:
        self.token_ids = token_ids
        self._markers: dict[str, _Markers] = {}

    def add_request(self, request_id: str) -> None:
        """Track a sequence (one with a budget)."""
        self._markers[request_id] = _Markers()

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Forget finished or aborted sequences (unknown ids are ignored)."""
        for request_id in request_ids:
            self._markers.pop(request_id, None)

    def set_forced_tokens(self, scheduler_output: SchedulerOutput) -> None:
        """Set ``scheduler_output.forced_token_ids`` for the tracked sequences that sample this
        step and must be forced (left empty otherwise, and at once without tracked ones)."""
        if not self._markers:
            return
        forced = {}
        for scheduled in scheduler_output.scheduled:
            request_id = scheduled.request.request_id
            if scheduled.sample and request_id in self._markers:
                rows = self.forced_rows(scheduled.request, scheduled.spec_token_ids)
                if any(token is not None for token in rows):
                    forced[request_id] = rows
        scheduler_output.forced_token_ids = forced

    def forced_rows(self, request: Request, drafts: Sequence[int]) -> list[int | None]:
        """Per logits row of a tracked ``request`` this step (one per draft, then one after
        them), the token to force there or None; row ``j`` follows the request's tokens and its
        first ``j`` drafts."""
        budget = request.sampling_params.thinking_token_budget
        committed = request.all_token_ids
        markers = self._markers[request.request_id]
        if markers.scanned > len(committed):  # output cut back (a stop string): scan again
            markers = self._markers[request.request_id] = _Markers()
        self._scan(markers, committed, len(committed))
        tokens = committed + list(drafts) if drafts else committed
        row_markers = _Markers(markers.scanned, markers.last_start, markers.last_end)
        rows = []
        for length in range(len(committed), len(tokens) + 1):
            self._scan(row_markers, tokens, length)
            rows.append(self._forced_token(tokens, length, row_markers, budget))
        return rows

    def _scan(self, markers: _Markers, tokens: Sequence[int], length: int) -> None:
        """Extend ``markers`` over ``tokens[:length]``: check the markers that end at each
        token not scanned yet."""
        start, end = self.token_ids.start, self.token_ids.natural_end
        for stop in range(markers.scanned + 1, length + 1):
            if _ends_with(tokens, stop, start):
                markers.last_start = stop - len(start)
            if _ends_with(tokens, stop, end):
                markers.last_end = stop - len(end)
        markers.scanned = max(markers.scanned, length)

    def _forced_token(
        self, tokens: Sequence[int], length: int, markers: _Markers, budget: int
    ) -> int | None:
        """The token ``tokens[:length]`` must be followed by, or None."""
        if markers.last_start < 0 or markers.last_start <= markers.last_end:
            return None  # not in a think block
        if length - (markers.last_start + len(self.token_ids.start)) < budget:
            return None
        end = self.token_ids.end
        for prefix in range(min(len(end) - 1, length), 0, -1):
            if _ends_with(tokens, length, end[:prefix]):
                return end[prefix]
        return end[0]


def _ends_with(tokens: Sequence[int], stop: int, pattern: Sequence[int]) -> bool:
    """Whether ``tokens[:stop]`` ends with ``pattern``."""
    begin = stop - len(pattern)
    if begin < 0 or tokens[stop - 1] != pattern[-1]:
        return False
    return all(tokens[begin + i] == token for i, token in enumerate(pattern))


def forced_logits_rows(
    forced_token_ids: dict[str, list[int | None]],
    request_ids: Sequence[str],
    num_rows: Sequence[int],
) -> list[tuple[int, int]]:
    """``(logits row, token id)`` of every forced token of a step.

    Args:
        forced_token_ids: ``SchedulerOutput.forced_token_ids``.
        request_ids: the sampled requests, in logits order.
        num_rows: each request's logits rows (drafts + 1).

    Returns:
        The pairs; at once an empty list when nothing is forced.
    """
    if not forced_token_ids:
        return []
    first_row: dict[str, int] = {}
    row = 0
    for request_id, count in zip(request_ids, num_rows, strict=True):
        first_row[request_id] = row
        row += count
    return [
        (first_row[request_id] + offset, token)
        for request_id, tokens in forced_token_ids.items()
        for offset, token in enumerate(tokens)
        if token is not None
    ]


def force_tokens(logits: torch.Tensor, forced: Sequence[tuple[int, int]]) -> None:
    """Give each ``(row, token id)`` of ``forced`` the logit ``FORCED_LOGIT``, in place.

    Args:
        logits: ``[num_rows, vocab_size]`` float32, after the logits processors.
        forced: the rows to force and their tokens (``forced_logits_rows``).
    """
    if not forced:
        return
    rows, token_ids = zip(*forced, strict=True)
    logits[list(rows), list(token_ids)] = FORCED_LOGIT
