"""The sampler's truncation and draw on their own: the nucleus cut from the top candidates is
the one a whole-vocabulary sort gives, and the race among the candidates draws each token
with its probability."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvpilot.engine.sampler import CANDIDATES, Sampler, _top_p
from kvpilot.engine.sampling_params import SamplingParams


def _nucleus_by_full_sort(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(before >= top_p.unsqueeze(1), 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def test_the_nucleus_from_the_top_candidates_is_the_full_sorts():
    gen = torch.Generator().manual_seed(0)
    # Peaked rows (their nucleus is within the candidates) and flat ones (it is not).
    logits = torch.randn(12, 5000, generator=gen) * torch.tensor([8.0] * 6 + [0.5] * 6)[:, None]
    probs = logits.softmax(dim=-1)
    top_p = torch.tensor([0.5, 0.9, 0.95, 0.99, 1e-6, 0.999] * 2)
    got = _top_p(probs, top_p)
    assert torch.equal(got, _nucleus_by_full_sort(probs, top_p))
    support = (got > 0).sum(dim=-1)
    assert support[:6].max() <= CANDIDATES  # cut from the candidates
    assert support[[6, 7, 8, 9, 11]].min() > CANDIDATES  # the whole sort (tiny top_p: 1 token)


def _requests(params: SamplingParams, n: int) -> list[SimpleNamespace]:
    return [
        SimpleNamespace(sampling_params=params, seed=None, request_id=f"r{i}") for i in range(n)
    ]


def test_the_race_among_the_candidates_draws_each_token_with_its_probability():
    vocab, draws = 1000, 6000
    logits = torch.full((draws, vocab), -30.0)  # a tail top_p cuts off
    for token, p in ((5, 0.5), (7, 0.3), (9, 0.2)):
        logits[:, token] = torch.log(torch.tensor(p))
    params = SamplingParams(temperature=1.0, top_p=0.999)
    sampled = Sampler(0, torch.device("cpu"), set())._sample_random(
        logits, _requests(params, draws)
    )
    counts = torch.bincount(sampled, minlength=vocab).float() / draws
    assert set(sampled.tolist()) == {5, 7, 9}
    torch.testing.assert_close(counts[[5, 7, 9]], torch.tensor([0.5, 0.3, 0.2]), atol=0.03, rtol=0)
    # Without truncation every token can be drawn: the race runs over the whole vocabulary.
    flat = Sampler(0, torch.device("cpu"), set())._sample_random(
        torch.zeros(draws, vocab), _requests(SamplingParams(temperature=1.0), draws)
    )
    assert len(set(flat.tolist())) > 900
