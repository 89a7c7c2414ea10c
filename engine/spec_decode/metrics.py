"""Counters of speculative decoding, as vLLM exports them (``vllm:spec_decode_*``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Drafts proposed and accepted since the engine started.

    Attributes:
        num_drafts: verification steps of requests that had at least one draft token
            (``vllm:spec_decode_num_drafts_total``).
        num_draft_tokens: draft tokens scored by the target model
            (``vllm:spec_decode_num_draft_tokens_total``).
        num_accepted_tokens: draft tokens accepted (``vllm:spec_decode_num_accepted_tokens_total``);
            counted before stop conditions cut an accepted run short.
        num_accepted_tokens_per_pos: ``[k]`` accepted tokens at each draft position (position 0
            is the first draft of a step; ``vllm:spec_decode_num_accepted_tokens_per_pos``).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Record one request's verification: ``num_accepted_tokens`` of its
        ``num_draft_tokens`` drafts were accepted (always a prefix of them).

        Raises:
            ValueError: when more tokens are accepted than were drafted, or counts are negative.
        """
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted_tokens} of {num_draft_tokens} draft tokens")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for pos in range(num_accepted_tokens):
            per_pos[pos] += 1

    def snapshot(self) -> SpecDecodingStats:
        """An independent copy (the engine keeps counting into this one)."""
        return SpecDecodingStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
