"""The greedy LM head (``kvpilot.kernels.cpu.greedy_head``): the same token as the argmax of the
GEMM kernel's float32 logits, bit for bit, on random heads, odd shapes, exact ties, logits one
float32 step apart and SmolLM2's real head; rows it must leave undecided; its place in the
layers (``cpu_gemm.greedy_tokens``).

The kernel needs AVX-512 BF16 (Zen 4, Cooper Lake, Sapphire Rapids on); elsewhere these tests
are skipped and every greedy row computes all its logits.
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.layers import cpu_gemm
from kvpilot.kernels.cpu import gemm, greedy_head

pytestmark = pytest.mark.skipif(
    not greedy_head.available(),
    reason="the greedy-head kernel needs AVX-512 BF16 and the GEMM kernel",
)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _both(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the argmax of the float32 GEMM's logits, the greedy head's tokens)."""
    packed = gemm.pack_weight(w)
    screen = greedy_head.build_screen(packed)
    assert screen is not None
    full = gemm.packed_linear(x, packed).argmax(dim=-1)
    return full, greedy_head.greedy_tokens(x, packed, screen)


@pytest.mark.parametrize(
    ("rows", "features", "tokens"),
    [(1, 64, 1), (5, 7, 31), (6, 128, 33), (7, 129, 64), (13, 300, 100), (64, 576, 1000)],
)
def test_the_token_is_the_float32_argmax(rows: int, features: int, tokens: int) -> None:
    x = _randn(rows, features, seed=rows) * 2
    w = _randn(tokens, features, seed=features) * 0.1
    full, screened = _both(x, w)
    assert screened.tolist() == full.tolist()


def test_equal_logits_give_the_first_token() -> None:
    w = _randn(500, 96, seed=1)
    w[[7, 120, 499]] = w[300].clone()  # four tokens with the same logits for every x
    x = w[300:301] * 3  # ...and the largest for this one
    full, screened = _both(x, w)
    assert full.item() == 7
    assert screened.item() == 7


@pytest.mark.parametrize("seed", range(6))
def test_logits_one_float32_step_apart_are_told_apart(seed: int) -> None:
    # Token 200's weights are token 50's with the last feature nudged by a few float32 steps
    # either way: the two logits differ in their last bits, far inside bfloat16's rounding, so
    # only the float32 re-check can order them, and it must order them as the GEMM does.
    w = _randn(400, 256, seed=100 + seed) * 0.05
    x = (w[50:51] * 40).repeat(8, 1)
    for row in range(8):
        nudged = w[50].clone()
        nudged[-1] = torch.nextafter(
            nudged[-1], torch.tensor(float("inf") if row % 2 else float("-inf"))
        )
        for _ in range(row // 2):
            nudged[-1] = torch.nextafter(nudged[-1], torch.tensor(float("inf")))
        w_row = w.clone()
        w_row[200] = nudged
        full, screened = _both(x[row : row + 1], w_row)
        assert screened.item() == full.item()
        assert full.item() in (50, 200)


def test_a_token_the_bfloat16_screen_ranks_first_loses_to_the_float32_one() -> None:
    # Token 1's first weight lies just past a bfloat16 rounding midpoint (it rounds up to
    # 1 + 2^-7) and token 0's just short of it (down to 1); token 1's 63 others are 2^-16 below
    # token 0's, which bfloat16 cannot see. So the screen ranks token 1 first (32.5078 against
    # 32.5) while its float32 logit is the smaller (by 63 * 2^-16 - 2^-19): a screen that took
    # its own ranking, or a bound too tight to keep token 0, would answer 1.
    w = _randn(1000, 64, seed=9) * 0.01
    w[0] = 0.5
    w[0, 0] = 1 + 2**-8 - 2**-20
    w[1] = 0.5 - 2**-16
    w[1, 0] = 1 + 2**-8 + 2**-20
    x = torch.ones(1, 64)
    bf16 = x.bfloat16().float() @ w.bfloat16().float().T
    assert bf16[0, 1] > bf16[0, 0]
    full, screened = _both(x, w)
    assert full.item() == 0
    assert screened.item() == 0


def test_subnormal_weights_and_hidden_states_are_inside_the_bound() -> None:
    # A BF16 unit may take subnormal inputs as zero (found by a walkthrough: token 0's weights,
    # all 1e-39, screened as 0 against x = 1e30 lost to token 1). Both ways round:
    w = torch.zeros(100, 64)
    w[0] = 1e-39  # subnormal weights...
    w[1, 0] = 2e-38
    w[2:] = -1e-38 * (1 + _randn(98, 64, seed=10).abs())
    x = torch.full((1, 64), 1e30)  # ...against a large hidden state
    full, screened = _both(x, w)
    assert full.item() == 0
    assert screened.item() == 0
    w = torch.zeros(100, 64)
    w[0, 1:] = 1e30  # large weights...
    w[1, 0] = 1e30
    w[2:] = -1e30 * (1 + _randn(98, 64, seed=11).abs())
    x = torch.full((1, 64), 1e-39)  # ...against a subnormal hidden state but for one feature
    x[0, 0] = 2e-38
    full, screened = _both(x, w)
    assert full.item() == 0
    assert screened.item() == 0


def test_the_real_head_on_real_hidden_states(default_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    ids = torch.randint(3, 49152, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1].reshape(-1, 576)
    head = model.lm_head.weight.detach()
    full, screened = _both(hidden, head)
    assert screened.tolist() == full.tolist()
    # ...and the float32 argmax is transformers' own greedy pick on these rows.
    assert full.tolist() == model.lm_head(hidden).argmax(dim=-1).tolist()


def test_rows_it_cannot_decide_are_left_to_the_full_logits() -> None:
    w = _randn(300, 64, seed=3)
    packed = gemm.pack_weight(w)
    screen = greedy_head.build_screen(packed)
    x = _randn(4, 64, seed=4)
    x[1, 5] = float("nan")
    x[2, 0] = float("inf")
    x[3] = 0.0  # every logit 0: all 300 tokens tie, more than worth a re-check each
    tokens = greedy_head.greedy_tokens(x, packed, screen, max_candidates=100).tolist()
    assert tokens[0] == gemm.packed_linear(x[:1], packed).argmax().item()
    assert tokens[1:] == [-1, -1, -1]


def test_a_head_with_a_weight_that_is_not_finite_gets_no_screen() -> None:
    w = _randn(100, 32, seed=5)
    w[10, 3] = float("inf")
    assert greedy_head.build_screen(gemm.pack_weight(w)) is None
    assert cpu_gemm.greedy_tokens(_randn(2, 32, seed=6), cpu_gemm.prepack([w])[0]) is None


def test_the_layer_keeps_one_screen_per_packed_weight_and_rebuilds_it_for_a_new_one() -> None:
    w = _randn(200, 48, seed=7)
    x = _randn(3, 48, seed=8)
    [packed] = cpu_gemm.prepack([w])
    first = cpu_gemm.greedy_tokens(x, packed)
    screen = packed._kvpilot_screen
    assert cpu_gemm.greedy_tokens(x, packed).tolist() == first.tolist()
    assert packed._kvpilot_screen is screen
    assert first.tolist() == cpu_gemm.linear(x, packed).argmax(dim=-1).tolist()
    # A dense (tied) weight is packed on first use and repacked when it changes in place;
    # its screen goes with the packed copy.
    dense = w.clone()
    before = cpu_gemm.greedy_tokens(x, dense)
    with torch.no_grad():
        dense.neg_()
    after = cpu_gemm.greedy_tokens(x, dense)
    assert before.tolist() == first.tolist()
    assert after.tolist() == cpu_gemm.linear(x, dense).argmax(dim=-1).tolist() != first.tolist()
    # Other dtypes are not its business.
    assert cpu_gemm.greedy_tokens(x.double(), w.double()) is None
