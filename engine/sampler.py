"""Turns next-token logits into tokens: logits processors, temperature, top-k/top-p/min-p, draw."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvpilot.engine.logits_processors import apply_logits_processors, compute_logprobs
from kvpilot.engine.request import Request
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.thinking_budget import force_tokens
from kvpilot.kernels.cpu import elementwise


@dataclass
class SamplerOutput:
    """Tokens drawn for one batch.

    Attributes:
        token_ids: ``[num_reqs]`` sampled token ids, in batch order.
        logprobs: per request None, or ``(sampled_logprob, {token_id: (logprob, rank)})``
            computed from the raw logits (see ``compute_logprobs``).
    """

    token_ids: list[int]
    logprobs: list[tuple[float, dict[int, tuple[float, int]]] | None]


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (``[num_reqs, vocab_size]`` -> ``[num_reqs]`` int64): through
    the CPU kernel ``kvpilot.kernels.cpu.elementwise.argmax`` (the same indices, ~10x faster
    than ATen's on a 49,152-token vocabulary) where it takes the logits, else torch's."""
    if (
        logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[0] > 0
        and logits.shape[1] > 0
        and elementwise.enabled()
        and elementwise.supports(logits)
    ):
        return elementwise.argmax(logits)
    return logits.argmax(dim=-1)


CANDIDATES = 64
"""Tokens a truncated row is taken from without looking at the rest of the vocabulary (see
:meth:`Sampler._sample_random` and :func:`_top_p`)."""


class Sampler:
    """Samples one token per request, each row independent of the others in the batch.

    Order as in vLLM V1: logprobs of the raw logits, logits processors (min_tokens, logit_bias,
    penalties), the thinking budget's forced tokens, then greedy argmax for
    ``temperature == 0``; otherwise temperature, top-k, top-p (nucleus, Holtzman et al. 2019),
    min-p, and a draw by the exponential race
    (``argmax(probs / q)``, ``q ~ Exp(1)``, which picks token ``i`` with probability
    ``probs[i]``). A request with a ``seed`` draws its noise from its own ``torch.Generator``, so
    its tokens do not depend on what else shares the batch; the others share one generator
    seeded with the engine's ``seed``.

    Args:
        seed: the engine seed.
        device: where logits live.
        eos_token_ids: the model's EOS ids (masked before ``min_tokens``).
    """

    def __init__(self, seed: int, device: torch.device, eos_token_ids: set[int]) -> None:
        self.device = device
        self.eos_token_ids = set(eos_token_ids)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Forget the generators of finished requests."""
        for request_id in request_ids:
            self.request_generators.pop(request_id, None)

    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        forced: Sequence[tuple[int, int]] = (),
    ) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: ``[num_reqs, vocab_size]`` float32 model logits (modified in place).
            requests: one request per row.
            forced: ``(row, token id)`` pairs: the rows whose thinking budget is spent get the
                token forced after the logits processors (``thinking_budget.force_tokens``).

        Returns:
            The tokens and, for requests that asked, their logprobs.
        """
        params = [r.sampling_params for r in requests]
        num_logprobs = [p.logprobs for p in params]
        raw = logits.clone() if any(k is not None for k in num_logprobs) else None
        logits = apply_logits_processors(
            logits,
            params,
            [r.prompt_token_ids for r in requests],
            [r.output_token_ids for r in requests],
            self.eos_token_ids,
        )
        force_tokens(logits, forced)
        sampled = greedy_argmax(logits)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            sampled[random_rows] = self._sample_random(
                logits[random_rows], [requests[i] for i in random_rows]
            )
        logprobs = (
            compute_logprobs(raw, sampled, num_logprobs)
            if raw is not None
            else [None] * len(requests)
        )
        return SamplerOutput(token_ids=sampled.tolist(), logprobs=logprobs)

    def _sample_random(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Draw from ``[n, vocab]`` logits after temperature and truncation; ``[n]`` int64.

        A row whose truncated distribution has at most ``CANDIDATES`` tokens (top-k, top-p or
        min-p leave a few) races among its top ``CANDIDATES`` tokens only, with that many
        ``Exp(1)`` draws: a token outside them has probability 0 and cannot win, so the draw
        is the same distribution as over the whole vocabulary, without a vocabulary's worth
        of random numbers per row. Other rows race over the vocabulary.
        """
        probs = compute_probs(logits, [r.sampling_params for r in requests])
        sampled = torch.empty(len(requests), dtype=torch.long, device=probs.device)
        few = ((probs > 0).sum(dim=-1) <= CANDIDATES).tolist()
        for rows, width in ((_rows(few, True), CANDIDATES), (_rows(few, False), probs.shape[1])):
            if not rows:
                continue
            noise = self.exponential_noise([requests[i] for i in rows], width)
            if width == probs.shape[1]:
                sampled[rows] = (probs[rows] / noise).argmax(dim=-1)
            else:
                top, token_ids = probs[rows].topk(width, dim=-1)
                sampled[rows] = token_ids.gather(1, (top / noise).argmax(dim=-1, keepdim=True))[
                    :, 0
                ]
        return sampled

    def exponential_noise(self, requests: list[Request], width: int) -> torch.Tensor:
        """``[len(requests), width]`` float32 ``Exp(1)`` draws, each row from its request's own
        generator when it has a seed, else from the shared one."""
        noise = torch.empty(len(requests), width, device=self.device)
        shared_rows = []
        for row, request in enumerate(requests):
            generator = self.generator_for(request)
            if generator is None:
                shared_rows.append(row)
            else:
                noise[row].exponential_(generator=generator)
        if shared_rows:
            noise[shared_rows] = torch.empty(
                len(shared_rows), width, device=self.device
            ).exponential_(generator=self.generator)
        return noise

    def generator_for(self, request: Request) -> torch.Generator | None:
        """The request's own generator (created on first use from its seed), or None when
        it has no seed and draws from the shared one."""
        if request.seed is None:
            return None
        generator = self.request_generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(request.seed)
            self.request_generators[request.request_id] = generator
        return generator


def compute_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: temperature, then top-k, top-p, min-p.

    Args:
        logits: ``[n, vocab_size]`` float32 logits (after the logits processors), rows with
            ``temperature > 0``.
        params: one ``SamplingParams`` per row.

    Returns:
        ``[n, vocab_size]`` float32 probabilities; truncated tokens are 0 and rows need not sum
        to 1 after top-p / min-p (sampling by the exponential race does not need it).
    """
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temperature.unsqueeze(1)
    top_k = [p.top_k for p in params]
    if any(top_k):
        vocab = logits.shape[1]
        k = torch.tensor([t if 0 < t < vocab else vocab for t in top_k], device=logits.device)
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        probs = _top_p(probs, torch.tensor(top_p, device=probs.device))
    min_p = [p.min_p for p in params]
    if any(min_p):
        floor = torch.tensor(min_p, device=probs.device).unsqueeze(1)
        probs = probs.masked_fill(probs < floor * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tail of each row outside its nucleus (the smallest set with mass >= top_p).

    The most likely token always survives, so ``top_p`` near 0 degenerates to greedy. A row
    whose ``CANDIDATES`` most likely tokens already hold ``top_p`` of the mass (the usual case)
    is cut from those alone (a partial selection); only the others sort the whole vocabulary.
    Both give the same nucleus: the mass before a token is the same running sum of the same
    descending values either way.
    """
    width = min(CANDIDATES, probs.shape[1])
    top, order = probs.topk(width, dim=-1)
    mass_before = top.cumsum(dim=-1) - top
    enough = (mass_before[:, -1] + top[:, -1] >= top_p) | (width == probs.shape[1])
    out = torch.zeros_like(probs)
    near = enough.nonzero().flatten()
    if len(near):
        kept = top[near].masked_fill(mass_before[near] >= top_p[near].unsqueeze(1), 0.0)
        out[near] = out[near].scatter_(1, order[near], kept)
    far = (~enough).nonzero().flatten()
    if len(far):
        sorted_probs, full_order = probs[far].sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= top_p[far].unsqueeze(1), 0.0)
        out[far] = out[far].scatter_(1, full_order, sorted_probs)
    return out


def _rows(flags: list[bool], value: bool) -> list[int]:
    return [i for i, flag in enumerate(flags) if flag is value]
