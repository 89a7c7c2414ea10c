"""Lossless acceptance of draft tokens by rejection sampling.

Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding" (Algorithm 1),
and Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling":
draft token ``d_j ~ q_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``, where
``p_j`` is the target model's distribution at that position; at the first rejection the token is
drawn from the residual ``norm(max(0, p_j - q_j))`` and the rest of the drafts are dropped; when
every draft is accepted a bonus token is drawn from ``p_{k}``. Every emitted token is then
distributed exactly as if drawn from the target model one step at a time.

A proposer without probabilities (n-gram lookup, greedy drafting) is the special case
``q_j = onehot(d_j)``: accept with probability ``p_j(d_j)``, residual ``p_j`` without ``d_j``.
Greedy requests (temperature 0) accept a draft iff it equals the target's argmax, and emit the
argmax at the first mismatch, so their output equals non-speculative greedy decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpilot.engine.logits_processors import (
    TokenLogprobs,
    apply_logits_processors,
    compute_logprobs,
)
from kvpilot.engine.request import Request
from kvpilot.engine.sampler import Sampler, compute_probs, greedy_argmax
from kvpilot.engine.thinking_budget import force_tokens


@dataclass
class RejectionSamplerOutput:
    """Tokens emitted for one batch of requests with drafts.

    Attributes:
        token_ids: per request, its accepted drafts then one target token (``1..k + 1``).
        logprobs: per request None, or one ``(sampled_logprob, {token_id: (logprob, rank)})``
            per emitted token (see ``compute_logprobs``).
    """

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]


class RejectionSampler:
    """Scores every request's drafts with the target's logits and accepts a prefix of them.

    Each request owns ``k + 1`` logits rows (the target at each draft position and after the
    last draft). Row ``j`` sees the request's outputs followed by its first ``j`` drafts, so
    the logits processors (penalties, ``min_tokens``, ``logit_bias``) and then temperature,
    top-k, top-p and min-p give exactly the distribution the plain ``Sampler`` would sample
    from had those drafts been its own tokens; ``rejection_sample`` then keeps the output
    distribution equal to the target's. Noise comes from the ``Sampler``'s generators, so a
    request with a ``seed`` draws from its own stream. Drafts are deterministic (``q`` one-hot:
    n-gram lookup and greedy draft models), as in vLLM V1.

    Args:
        sampler: the engine's sampler (generators and EOS ids).
    """

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        spec_token_ids: list[list[int]],
        forced: Sequence[tuple[int, int]] = (),
    ) -> RejectionSamplerOutput:
        """Verify the drafts.

        Args:
            logits: ``[num_drafts_total + num_reqs, vocab_size]`` float32 target logits,
                request by request (modified in place).
            requests: the requests, in row order.
            spec_token_ids: per request its drafts (possibly none).
            forced: ``(row, token id)`` pairs forced after the logits processors (a spent
                thinking budget, ``thinking_budget.force_tokens``): a draft there is accepted
                only if it is that token, which is emitted otherwise.

        Returns:
            The emitted tokens and, for requests that asked, their logprobs (of the raw
            logits, as the plain sampler reports them).
        """
        rows: list[tuple[Request, list[int]]] = [
            (request, request.output_token_ids + drafts[:j])
            for request, drafts in zip(requests, spec_token_ids, strict=True)
            for j in range(len(drafts) + 1)
        ]
        params = [request.sampling_params for request, _ in rows]
        wants_logprobs = any(p.logprobs is not None for p in params)
        raw = logits.clone() if wants_logprobs else None
        target = apply_logits_processors(
            logits,
            params,
            [request.prompt_token_ids for request, _ in rows],
            [outputs for _, outputs in rows],
            self.sampler.eos_token_ids,
        )
        force_tokens(target, forced)
        vocab_size = target.shape[1]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        exponential = torch.ones_like(target)
        if random_rows:
            target[random_rows] = compute_probs(
                target[random_rows], [params[i] for i in random_rows]
            )
            exponential[random_rows] = self.sampler.exponential_noise(
                [rows[i][0] for i in random_rows], vocab_size
            )
        token_ids = rejection_sample(
            draft_token_ids=torch.tensor(
                [t for drafts in spec_token_ids for t in drafts],
                dtype=torch.int64,
                device=target.device,
            ),
            num_draft_tokens=[len(d) for d in spec_token_ids],
            target_probs=target,
            draft_probs=None,
            uniform=self._uniform(requests, spec_token_ids, target.device),
            exponential=exponential,
            is_greedy=[r.sampling_params.greedy for r in requests],
        )
        logprobs = (
            self._logprobs(raw, requests, spec_token_ids, token_ids)
            if raw is not None
            else [None] * len(requests)
        )
        return RejectionSamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def _uniform(
        self, requests: list[Request], spec_token_ids: list[list[int]], device: torch.device
    ) -> torch.Tensor:
        """``U[0, 1)`` per draft: a seeded request's from its own generator, the others' from
        the shared one; greedy requests draw nothing."""
        parts = []
        for request, drafts in zip(requests, spec_token_ids, strict=True):
            if request.sampling_params.greedy or not drafts:
                parts.append(torch.zeros(len(drafts), device=device))
                continue
            generator = self.sampler.generator_for(request) or self.sampler.generator
            parts.append(torch.rand(len(drafts), generator=generator, device=device))
        return torch.cat(parts) if parts else torch.zeros(0, device=device)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor,
        requests: list[Request],
        spec_token_ids: list[list[int]],
        token_ids: list[list[int]],
    ) -> list[list[TokenLogprobs] | None]:
        """Logprobs of each emitted token from its own row of raw logits."""
        row_index, sampled, counts = [], [], []
        start = 0
        for request, drafts, emitted in zip(requests, spec_token_ids, token_ids, strict=True):
            if request.sampling_params.logprobs is not None:
                row_index += range(start, start + len(emitted))
                sampled += emitted
                counts += [request.sampling_params.logprobs] * len(emitted)
            start += len(drafts) + 1
        flat = compute_logprobs(
            raw[row_index], torch.tensor(sampled, dtype=torch.int64, device=raw.device), counts
        )
        out: list[list[TokenLogprobs] | None] = []
        for request, emitted in zip(requests, token_ids, strict=True):
            if request.sampling_params.logprobs is None:
                out.append(None)
                continue
            out.append(flat[: len(emitted)])
            flat = flat[len(emitted) :]
        return out


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniform: torch.Tensor,
    exponential: torch.Tensor,
    is_greedy: Sequence[bool],
) -> list[list[int]]:
    """Accept a prefix of each request's drafts and append one target token.

    Requests are laid out back to back: request ``i`` has ``k_i = num_draft_tokens[i]`` drafts
    (0 allowed) and ``k_i + 1`` target rows, row ``j < k_i`` scoring draft ``j`` and row ``k_i``
    giving the bonus token.

    Args:
        draft_token_ids: ``[num_draft_tokens_total]`` int64, the drafts of all requests.
        num_draft_tokens: ``[num_reqs]`` drafts per request.
        target_probs: ``[num_draft_tokens_total + num_reqs, vocab_size]`` float32, the target's
            distribution at every row after temperature and truncation (top-k, top-p, min-p).
            Greedy requests' rows are only compared by argmax, so logits do as well.
        draft_probs: ``[num_draft_tokens_total, vocab_size]`` float32 distributions the drafts
            were drawn from, or None when the drafts are deterministic (one-hot ``q``).
        uniform: ``[num_draft_tokens_total]`` float32 ``U[0, 1)`` draws, one per draft.
        exponential: ``[num_draft_tokens_total + num_reqs, vocab_size]`` float32 ``Exp(1)``
            draws; ``argmax(probs / exponential)`` draws from ``probs`` (the exponential race).
        is_greedy: ``[num_reqs]`` whether each request decodes greedily.

    Returns:
        Per request, the emitted tokens: the accepted drafts followed by the recovered token
        (first rejection) or the bonus token (all accepted); ``1..k_i + 1`` tokens.

    Raises:
        ValueError: when the tensors' shapes disagree with ``num_draft_tokens``.
    """
    num_reqs = len(num_draft_tokens)
    num_drafts = sum(num_draft_tokens)
    num_rows = num_drafts + num_reqs
    if len(is_greedy) != num_reqs:
        raise ValueError(f"is_greedy has {len(is_greedy)} entries for {num_reqs} requests")
    if draft_token_ids.shape != (num_drafts,) or uniform.shape != (num_drafts,):
        raise ValueError(
            f"expected {num_drafts} draft tokens and uniforms, got {tuple(draft_token_ids.shape)} "
            f"and {tuple(uniform.shape)}"
        )
    if target_probs.shape[0] != num_rows or exponential.shape != target_probs.shape:
        raise ValueError(
            f"expected {num_rows} target rows and exponentials of the same shape, got "
            f"{tuple(target_probs.shape)} and {tuple(exponential.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (num_drafts, target_probs.shape[1]):
        raise ValueError(
            f"draft_probs must be [{num_drafts}, {target_probs.shape[1]}], got "
            f"{tuple(draft_probs.shape)}"
        )
    device = target_probs.device
    counts = torch.tensor(list(num_draft_tokens), dtype=torch.int64, device=device)
    req_of_draft = torch.repeat_interleave(torch.arange(num_reqs, device=device), counts)
    # Row of draft j of request i: that request's first row plus j, and requests before it
    # each hold one extra (bonus) row.
    draft_rows = torch.arange(num_drafts, device=device) + req_of_draft
    bonus_rows = torch.cumsum(counts + 1, dim=0) - 1
    greedy = torch.tensor(list(is_greedy), dtype=torch.bool, device=device)
    greedy_of_draft = greedy[req_of_draft]

    target_argmax = greedy_argmax(target_probs)
    p_draft = target_probs[draft_rows]
    p_of_d = p_draft.gather(1, draft_token_ids.unsqueeze(1)).squeeze(1)
    if draft_probs is None:
        q_of_d = torch.ones_like(p_of_d)
    else:
        q_of_d = draft_probs.gather(1, draft_token_ids.unsqueeze(1)).squeeze(1)
    residual = residual_distribution(p_draft, draft_probs, draft_token_ids)
    # u < p/q without dividing by a q that may be 0.
    accepted_random = uniform * q_of_d < p_of_d
    accepted_greedy = draft_token_ids == target_argmax[draft_rows]
    accepted = torch.where(greedy_of_draft, accepted_greedy, accepted_random)
    recovered_random = (residual / exponential[draft_rows]).argmax(dim=-1)
    recovered = torch.where(greedy_of_draft, target_argmax[draft_rows], recovered_random)
    bonus_random = (target_probs[bonus_rows] / exponential[bonus_rows]).argmax(dim=-1)
    bonus = torch.where(greedy, target_argmax[bonus_rows], bonus_random)

    drafts, accepted, recovered = (
        draft_token_ids.tolist(),
        accepted.tolist(),
        recovered.tolist(),
    )
    bonus = bonus.tolist()
    outputs: list[list[int]] = []
    start = 0
    for i, k in enumerate(num_draft_tokens):
        emitted: list[int] = []
        for j in range(start, start + k):
            if not accepted[j]:
                emitted.append(recovered[j])
                break
            emitted.append(drafts[j])
        else:
            emitted.append(bonus[i])
        outputs.append(emitted)
        start += k
    return outputs


def greedy_verify(draft_token_ids: Sequence[int], target_token_ids: Sequence[int]) -> list[int]:
    """The tokens greedy verification emits (:func:`rejection_sample` for a greedy request):
    the drafts up to the first that differs from the target's argmax at its position, then
    that argmax; all of them kept, the argmax after the last.

    Args:
        draft_token_ids: ``[k]`` the request's drafts.
        target_token_ids: ``[k + 1]`` the target model's argmax at each draft's position and
            after the last draft.

    Returns:
        The emitted tokens (1 to ``k + 1``).

    Raises:
        ValueError: ``target_token_ids`` is not one longer than ``draft_token_ids``.
    """
    if len(target_token_ids) != len(draft_token_ids) + 1:
        raise ValueError(
            f"{len(draft_token_ids)} drafts need {len(draft_token_ids) + 1} target tokens, got "
            f"{len(target_token_ids)}"
        )
    for j, draft in enumerate(draft_token_ids):
        if draft != target_token_ids[j]:
            return list(target_token_ids[: j + 1])
    return list(target_token_ids)


def residual_distribution(
    target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_token_ids: torch.Tensor
) -> torch.Tensor:
    """Unnormalised ``max(0, p - q)``, what a rejected position is resampled from.

    Args:
        target_probs: ``[num_drafts, vocab_size]`` float32 ``p`` at the draft positions.
        draft_probs: ``[num_drafts, vocab_size]`` float32 ``q``, or None for one-hot drafts
            (then the residual is ``p`` with the draft token zeroed).
        draft_token_ids: ``[num_drafts]`` int64.

    Returns:
        ``[num_drafts, vocab_size]`` float32 weights (rows need not sum to 1). A row with no
        mass (``p == q``, where a rejection cannot happen) is ``p``, so that sampling from it
        stays defined.
    """
    if draft_probs is None:
        residual = target_probs.scatter(1, draft_token_ids.unsqueeze(1), 0.0)
    else:
        residual = (target_probs - draft_probs).clamp_min(0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, target_probs, residual)
