"""Per-request logits adjustments applied before sampling, and sample log-probabilities.

Order follows vLLM V1's sampler: ``allowed_token_ids``, ``bad_words``, ``min_tokens`` masking
and ``logit_bias`` first, then the penalties (repetition, frequency, presence). Temperature,
top-k/top-p/min-p and the draw itself belong to the sampler, which runs after
``apply_logits_processors``.
"""

from __future__ import annotations

import torch

from kvpilot.engine.sampling_params import SamplingParams


def apply_logits_processors(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    eos_token_ids: set[int],
) -> torch.Tensor:
    """Apply min_tokens, logit_bias and the three penalties to a batch of next-token logits.

    Args:
        logits: ``[num_reqs, vocab_size]`` float32 raw model logits; modified in place.
        params: one ``SamplingParams`` per row.
        prompt_token_ids: per row, the prompt's token ids (repetition penalty only).
        output_token_ids: per row, the tokens generated so far.
        eos_token_ids: the model's end-of-sequence ids, masked with ``stop_token_ids`` while a
            row has fewer than ``min_tokens`` outputs (unless the row sets ``ignore_eos``).

    Semantics:
        - ``allowed_token_ids`` (vLLM): every other token gets ``-inf``.
        - ``bad_words`` (vLLM): a bad word's last token gets ``-inf`` where the output so far
          ends with the rest of its token sequence (``bad_words_token_ids``; a one-token word
          always).
        - ``min_tokens``: EOS and ``stop_token_ids`` get ``-inf`` until ``min_tokens`` tokens
          exist (vLLM).
        - ``logit_bias``: ``logits[token] += bias`` (OpenAI).
        - ``repetition_penalty`` p (CTRL, Keskar et al. 2019, as in vLLM): for every token seen
          in the prompt or the output, a positive logit is divided by p, a negative one
          multiplied by p.
        - ``frequency_penalty`` f and ``presence_penalty`` r (OpenAI): ``logit -= f * count +
          r * (count > 0)``, counting the output tokens only.

    Returns:
        ``logits`` (the same tensor).

    Token ids in ``logit_bias`` and ``stop_token_ids`` are in ``[0, vocab_size)``: the input
    processor refuses others when the request arrives (``check_sampling_params``).

    Raises:
        ValueError: when the row counts differ.
    """
    num_reqs = logits.shape[0]
    if not len(params) == len(prompt_token_ids) == len(output_token_ids) == num_reqs:
        raise ValueError(
            f"apply_logits_processors: {num_reqs} logits rows but {len(params)} params, "
            f"{len(prompt_token_ids)} prompts and {len(output_token_ids)} outputs"
        )
    for row, (p, output) in enumerate(zip(params, output_token_ids, strict=True)):
        if p.allowed_token_ids is not None:
            allowed = logits[row, p.allowed_token_ids].clone()
            logits[row] = float("-inf")
            logits[row, p.allowed_token_ids] = allowed
        for word in p.bad_words_token_ids or ():
            *start, last = word
            if not start or output[len(output) - len(start) :] == start:
                logits[row, last] = float("-inf")
        if len(output) < p.min_tokens:
            # As in vLLM, EOS only counts as a stop token when it is not ignored.
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
            banned = sorted(stops)
            logits[row, banned] = float("-inf")
        if p.logit_bias:
            ids = [int(t) for t in p.logit_bias]
            bias = torch.tensor(
                list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device
            )
            index = torch.tensor(ids, dtype=torch.long, device=logits.device)
            logits[row].index_add_(0, index, bias)
    _apply_penalties(logits, params, prompt_token_ids, output_token_ids)
    return logits


def changes_logits(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether :func:`apply_logits_processors` changes a row's logits at this step
    (``allowed_token_ids``, ``bad_words``, ``min_tokens`` not yet reached, ``logit_bias``, a
    penalty), given the tokens the request has generated so far."""
    return bool(
        params.allowed_token_ids is not None
        or params.bad_words_token_ids
        or num_output_tokens < params.min_tokens
        or params.logit_bias
        or _penalized(params)
    )


def _penalized(params: SamplingParams) -> bool:
    """Whether a row has a repetition, frequency or presence penalty."""
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def _apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
) -> None:
    rows = [i for i, p in enumerate(params) if _penalized(p)]
    if not rows:
        return
    vocab_size = logits.shape[1]
    sub = logits[rows]
    output_counts = _token_counts([output_token_ids[i] for i in rows], vocab_size, logits.device)
    output_seen = output_counts > 0
    device, dtype = logits.device, logits.dtype
    repetition = torch.tensor([params[i].repetition_penalty for i in rows], dtype=dtype)
    repetition = repetition.to(device).unsqueeze(1)
    seen = output_seen | (
        _token_counts([prompt_token_ids[i] for i in rows], vocab_size, device) > 0
    )
    penalised = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(seen, penalised, sub)
    frequency = torch.tensor([params[i].frequency_penalty for i in rows], dtype=dtype)
    presence = torch.tensor([params[i].presence_penalty for i in rows], dtype=dtype)
    sub -= frequency.to(device).unsqueeze(1) * output_counts.to(dtype)
    sub -= presence.to(device).unsqueeze(1) * output_seen.to(dtype)
    logits[rows] = sub


def _token_counts(
    token_ids: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``[len(token_ids), vocab_size]`` int64 occurrence counts of each token id per row."""
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.long, device=device)
    flat = [t for ids in token_ids for t in ids]
    if flat:
        lengths = torch.tensor([len(ids) for ids in token_ids])
        rows = torch.repeat_interleave(torch.arange(len(token_ids)), lengths).to(device)
        columns = torch.tensor(flat, dtype=torch.long, device=device)
        counts.index_put_((rows, columns), torch.ones_like(columns), accumulate=True)
    return counts


TokenLogprobs = tuple[float, dict[int, tuple[float, int]]]
"""One scored token: ``(its logprob, {token_id: (logprob, rank)})``, the candidates being the top
``k`` tokens (ranks 1..k) plus the token itself."""


def compute_logprobs(
    raw_logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: list[int | None]
) -> list[TokenLogprobs | None]:
    """Log-probabilities of the sampled tokens and of each request's top candidates.

    As vLLM V1 does by default, these are ``log_softmax`` of the raw model logits, before any
    penalty, temperature or truncation, in float32. Prompt logprobs use it too, with the next
    prompt token in place of the sampled one.

    Args:
        raw_logits: ``[num_reqs, vocab_size]`` float32 model logits.
        sampled: ``[num_reqs]`` int64 sampled token ids.
        num_logprobs: per request the number of top tokens wanted (``SamplingParams.logprobs``),
            or None for none at all.

    Returns:
        Per request None, or ``(sampled_logprob, {token_id: (logprob, rank)})`` with the top
        ``k`` tokens (ranks 1..k) plus the sampled token; a rank is 1 + the number of tokens
        with a strictly higher log-probability.
    """
    wanted = [i for i, k in enumerate(num_logprobs) if k is not None]
    results: list[TokenLogprobs | None] = [None] * len(num_logprobs)
    if not wanted:
        return results
    rows = raw_logits if len(wanted) == len(num_logprobs) else raw_logits[wanted]
    logprobs = torch.log_softmax(rows.float(), dim=-1)
    chosen = sampled[wanted].to(logprobs.device).long()
    chosen_logprobs = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    chosen_ranks = (logprobs > chosen_logprobs.unsqueeze(1)).sum(dim=1) + 1
    max_k = max(num_logprobs[i] for i in wanted)
    # One device-to-host copy per tensor: element-wise reads would sync once per value.
    top_values = top_ids = [[] for _ in wanted]
    if max_k:
        best = logprobs.topk(max_k, dim=-1)
        top_values, top_ids = best.values.tolist(), best.indices.tolist()
    chosen_ids, chosen_values = chosen.tolist(), chosen_logprobs.tolist()
    chosen_ranks = chosen_ranks.tolist()
    for row, i in enumerate(wanted):
        k = num_logprobs[i]
        top = {top_ids[row][r]: (top_values[row][r], r + 1) for r in range(k)}
        top[chosen_ids[row]] = (chosen_values[row], chosen_ranks[row])
        results[i] = (chosen_values[row], top)
    return results
