"""The rejection sampler keeps the target distribution (chi-square over many draws), catches a
deliberately biased variant, and reduces to exact argmax matching for greedy requests."""

from __future__ import annotations

import math

import pytest
import torch

from kvpilot.engine.spec_decode import rejection_sampler
from kvpilot.engine.spec_decode.rejection_sampler import rejection_sample

VOCAB = 5
K = 2
NUM_TRIALS = 40_000
# Groups with fewer draws are left out of the chi-square (expected counts would be too small).
MIN_GROUP = 400
# Upper tail probability of the chi-square bound: a correct sampler fails about once in 10^6.
Z_TAIL = 4.75


def chi_square_critical(df: int) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at ``1 - Phi(-Z_TAIL)``."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + Z_TAIL * math.sqrt(h)) ** 3


def conditional_table(
    generator: torch.Generator, depth: int
) -> dict[tuple[int, ...], torch.Tensor]:
    """A distribution over the vocabulary for every prefix up to ``depth`` tokens: softmax of
    wide random logits, peaked enough that drafts are often but not always accepted."""
    table = {}
    prefixes: list[tuple[int, ...]] = [()]
    for _ in range(depth + 1):
        next_prefixes = []
        for prefix in prefixes:
            table[prefix] = (2.0 * torch.randn(VOCAB, generator=generator)).softmax(dim=0)
            next_prefixes += [prefix + (t,) for t in range(VOCAB)]
        prefixes = next_prefixes
    return table


def run_trials(
    target: dict,
    draft: dict | None,
    seed: int,
    reported_draft: dict | None = None,
) -> list[list[int]]:
    """``NUM_TRIALS`` independent requests with K drafts each, in one batch.

    Drafts are drawn from ``draft`` (conditional on the drafted prefix), or are the argmax of
    ``target`` (a deterministic proposer) when ``draft`` is None. Target row j is the target's
    distribution after the first j drafts, as a model scoring the drafted sequence gives it.
    ``reported_draft`` (default ``draft``) is what the sampler is told the drafts came from;
    deterministic drafts pass no draft probabilities.
    """
    reported_draft = reported_draft or draft
    generator = torch.Generator().manual_seed(seed)
    drafts = torch.zeros(NUM_TRIALS, K, dtype=torch.int64)
    draft_rows, target_rows = [], []
    prefixes = [()] * NUM_TRIALS
    for j in range(K + 1):
        target_rows.append(torch.stack([target[p] for p in prefixes]))
        if j == K:
            break
        if draft is None:
            drafts[:, j] = target_rows[-1].argmax(dim=-1)
        else:
            q = torch.stack([draft[p] for p in prefixes])
            draft_rows.append(torch.stack([reported_draft[p] for p in prefixes]))
            drafts[:, j] = torch.multinomial(q, 1, generator=generator).squeeze(1)
        prefixes = [p + (d,) for p, d in zip(prefixes, drafts[:, j].tolist(), strict=True)]
    target_probs = torch.stack(target_rows, dim=1).reshape(-1, VOCAB)
    draft_probs = torch.stack(draft_rows, dim=1).reshape(-1, VOCAB) if draft_rows else None
    return rejection_sample(
        draft_token_ids=drafts.reshape(-1),
        num_draft_tokens=[K] * NUM_TRIALS,
        target_probs=target_probs,
        draft_probs=draft_probs,
        uniform=torch.rand(NUM_TRIALS * K, generator=generator),
        exponential=torch.empty(NUM_TRIALS * (K + 1), VOCAB).exponential_(generator=generator),
        is_greedy=[False] * NUM_TRIALS,
    )


def chi_square(outputs: list[list[int]], target: dict) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of every emitted token against the target's
    conditional distribution given the tokens emitted before it (groups by prefix)."""
    counts: dict[tuple[int, ...], torch.Tensor] = {}
    for tokens in outputs:
        for j, token in enumerate(tokens):
            counts.setdefault(tuple(tokens[:j]), torch.zeros(VOCAB))[token] += 1
    statistic, df = 0.0, 0
    for prefix, observed in counts.items():
        n = observed.sum()
        if n < MIN_GROUP:
            continue
        expected = n * target[prefix]
        keep = expected > 0
        statistic += float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
        df += int(keep.sum()) - 1
    return statistic, df


@pytest.fixture(scope="module")
def tables() -> tuple[dict, dict]:
    target = conditional_table(torch.Generator().manual_seed(1), K)
    draft = conditional_table(torch.Generator().manual_seed(2), K)
    return target, draft


def test_sampled_drafts_keep_target_distribution(tables):
    target, draft = tables
    outputs = run_trials(target, draft, seed=0)
    statistic, df = chi_square(outputs, target)
    assert df >= 10
    assert statistic < chi_square_critical(df), (statistic, df)
    lengths = torch.tensor([len(o) for o in outputs])
    # The draws exercised acceptance, rejection and the bonus token.
    assert (lengths == 1).any() and (lengths == 2).any() and (lengths == K + 1).any()


def test_deterministic_drafts_keep_target_distribution(tables):
    target, _ = tables
    outputs = run_trials(target, None, seed=1)
    statistic, df = chi_square(outputs, target)
    assert statistic < chi_square_critical(df), (statistic, df)


def test_mismatched_draft_probs_are_caught(tables):
    """Drafts drawn from q but scored with another distribution (the draft's temperature
    applied on one side only) bias the output; the bound must see it."""
    target, draft = tables
    sharpened = {prefix: q**2 / (q**2).sum() for prefix, q in draft.items()}
    outputs = run_trials(target, draft, seed=0, reported_draft=sharpened)
    statistic, df = chi_square(outputs, target)
    assert statistic > chi_square_critical(df), (statistic, df)


@pytest.mark.parametrize(
    ("sampled_drafts", "seed"),
    [
        # Deterministic drafts: accepting p(d) and then redrawing from p itself (d not
        # excluded) over-emits d.
        pytest.param(False, 1, id="deterministic-drafts-without-residual"),
        # The classic bug: after a rejection, draw from p rather than norm(max(0, p - q)).
        pytest.param(True, 0, id="resampling-from-target-instead-of-residual"),
    ],
)
def test_target_in_place_of_residual_is_caught(tables, monkeypatch, sampled_drafts, seed):
    target, draft = tables
    monkeypatch.setattr(rejection_sampler, "residual_distribution", lambda p, q, d: p)
    outputs = run_trials(target, draft if sampled_drafts else None, seed=seed)
    statistic, df = chi_square(outputs, target)
    assert statistic > chi_square_critical(df), (statistic, df)


def test_greedy_accepts_exact_argmax_prefix_then_corrects():
    # Two greedy requests and one with no drafts; rows are logits (only argmax matters).
    logits = torch.tensor(
        [
            [0.0, 5.0, 1.0],  # req 0, draft 0 = 1: accept
            [3.0, 0.0, 1.0],  # req 0, draft 1 = 2: reject, emit 0
            [0.0, 0.0, 9.0],  # req 0, bonus row (unused)
            [0.0, 1.0, 2.0],  # req 1, draft 0 = 2: accept
            [2.0, 1.0, 0.0],  # req 1, bonus: 0
            [0.0, 4.0, 0.0],  # req 2 (no drafts): 1
        ]
    )
    outputs = rejection_sample(
        draft_token_ids=torch.tensor([1, 2, 2]),
        num_draft_tokens=[2, 1, 0],
        target_probs=logits,
        draft_probs=None,
        uniform=torch.ones(3),  # would reject every random draft: greedy must ignore it
        exponential=torch.ones(6, 3),
        is_greedy=[True, True, True],
    )
    assert outputs == [[1, 0], [2, 0], [1]]


@pytest.mark.parametrize("seed", range(5))
def test_greedy_verify_emits_what_rejection_sampling_emits_for_a_greedy_request(seed):
    # greedy_verify (the greedy head's verification) on the argmax tokens against
    # rejection_sample on the logits: the same tokens, drafts often right, sometimes wrong.
    generator = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 5, (6,), generator=generator).tolist()
    logits = torch.randn(sum(counts) + len(counts), 4, generator=generator)
    argmax = logits.argmax(dim=-1).tolist()
    drafts, row = [], 0
    for k in counts:
        mine = [
            argmax[row + j] if torch.rand(1, generator=generator) < 0.7 else 3 for j in range(k)
        ]
        drafts.append(mine)
        row += k + 1
    expected = rejection_sample(
        draft_token_ids=torch.tensor([t for d in drafts for t in d], dtype=torch.int64),
        num_draft_tokens=counts,
        target_probs=logits,
        draft_probs=None,
        uniform=torch.ones(sum(counts)),
        exponential=torch.ones_like(logits),
        is_greedy=[True] * len(counts),
    )
    got, row = [], 0
    for k, d in zip(counts, drafts, strict=True):
        got.append(rejection_sampler.greedy_verify(d, argmax[row : row + k + 1]))
        row += k + 1
    assert got == expected
    with pytest.raises(ValueError, match="2 drafts need 3 target tokens"):
        rejection_sampler.greedy_verify([1, 2], [1, 2])


def test_mixed_batch_rows_stay_with_their_request():
    """A random request with p concentrated on one token beside greedy ones: every request
    reads its own rows, whatever k each has."""
    probs = torch.tensor(
        [
            [0.0, 1.0, 0.0],  # random req 0, draft 1: p(d) = 1, always accepted
            [0.0, 0.0, 1.0],  # random req 0, bonus: 2
            [1.0, 0.0, 0.0],  # greedy req 1, draft 2 rejected: emit 0
            [0.0, 1.0, 0.0],  # greedy req 1, bonus row (unused)
        ]
    )
    outputs = rejection_sample(
        draft_token_ids=torch.tensor([1, 2]),
        num_draft_tokens=[1, 1],
        target_probs=probs,
        draft_probs=None,
        uniform=torch.tensor([0.999, 0.0]),
        exponential=torch.empty(4, 3).exponential_(generator=torch.Generator().manual_seed(0)),
        is_greedy=[False, True],
    )
    assert outputs == [[1, 2], [0]]


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="target rows"):
        rejection_sample(
            draft_token_ids=torch.tensor([1]),
            num_draft_tokens=[1],
            target_probs=torch.ones(1, 3),
            draft_probs=None,
            uniform=torch.zeros(1),
            exponential=torch.ones(1, 3),
            is_greedy=[False],
        )
