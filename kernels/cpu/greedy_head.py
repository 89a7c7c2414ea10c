"""The greedy token of the LM head without every float32 logit (a C++ PyTorch extension).

A greedy request that asks for no logprobs and whose logits no processor changes needs only
the argmax of ``x W^T``. :func:`greedy_tokens` finds it from a bfloat16 copy of the head
(AVX-512 BF16 dot products: twice the multiply-adds per instruction of float32 FMAs, half the
bytes), a rigorous bound on how far each screened logit can be from the float32 one, and the
float32 logits of the few tokens the bound cannot rule out (1-35 of SmolLM2's 49,152, median
2), computed in :mod:`kvpilot.kernels.cpu.gemm`'s summation order. The token is therefore the
one ``argmax(packed_linear(x, W))`` gives, bit for bit: the first index of the largest float32
logit. The bound and its proof are in ``greedy_head.cpp``'s header; no reduced precision
reaches a token.

On SmolLM2's head (49,152 x 576) it takes 0.55-0.65x the time of the float32 GEMM and argmax
at 32-128 rows, and 0.4-0.6x at 1-4 rows, where both read the weights at the memory's
bandwidth (1 and 2 threads, Zen 4; ``benchmarks/greedy_head.py``, figures in
docs/benchmarks.md). The screen costs a second copy of the head in bfloat16 (half the float32
head's bytes: 56.6 MB for SmolLM2).

It needs AVX-512F, AVX-512 BF16 and FMA (Zen 4, Intel Cooper Lake and Sapphire Rapids on):
:func:`available` is False elsewhere, when the build fails (one warning) or when
``KVPILOT_CPU_GREEDY_HEAD=0`` turns it off; every logit is then computed as before.
"""

from __future__ import annotations

import functools
import math
import pathlib
from dataclasses import dataclass

import torch

from kvpilot.kernels.cpu import extension, gemm

ENV_VAR = "KVPILOT_CPU_GREEDY_HEAD"
SOURCE = pathlib.Path(__file__).with_name("greedy_head.cpp")
EXTENSION_NAME = "kvpilot_cpu_greedy_head"
KERNEL = extension.Kernel(
    EXTENSION_NAME,
    SOURCE,
    "CPU greedy-head kernel",
    "greedy rows compute every logit",
    headers=(SOURCE.with_name("x86.h"),),
)
MAX_CANDIDATES = 1024
"""A row with more tokens the screen cannot rule out (its logits all nearly equal) is left to
the full float32 logits."""
_COLS = 64  # tokens per bfloat16 panel (greedy_head.cpp's kCols)


load_extension = extension.loader(KERNEL)


def enabled() -> bool:
    """Whether ``$KVPILOT_CPU_GREEDY_HEAD`` lets greedy rows take the screen
    (:func:`extension.env_enabled`)."""
    return extension.env_enabled(ENV_VAR)


@functools.cache
def available() -> bool:
    """Whether the kernel runs here: enabled, built (builds on the first call), the GEMM kernel
    available (the candidates' logits are its sums) and a CPU with AVX-512 BF16."""
    return enabled() and gemm.available() and extension.cpu_supported(load_extension)


@dataclass(frozen=True)
class Screen:
    """The bfloat16 copy of a packed LM head and its per-token error terms.

    Attributes:
        weight: ``[ceil(N / 64), ceil(K / 2), 64, 2]`` int16 (bfloat16 bits): 64 tokens a
            panel, their features in pairs; zero past ``N`` and ``K``.
        norms: ``[N]`` float32, each at least ``max(||w_j||, ||bfloat16(w_j)||)``.
        gaps: ``[N]`` float32, each at least ``||bfloat16(w_j) - w_j||``.
    """

    weight: torch.Tensor
    norms: torch.Tensor
    gaps: torch.Tensor


def build_screen(weight: gemm.PackedWeight) -> Screen | None:
    """The screen of a packed (not gated) float32 head ``[N, K]``; None when one of its
    weights is not finite (every logit is then computed in full).

    Raises:
        RuntimeError: the kernel is not available, or a gated weight.
    """
    if not available():
        raise RuntimeError("the CPU greedy-head kernel is not available")
    if weight.gated:
        raise RuntimeError("kvpilot greedy head: an LM head is not a gated projection")
    if not bool(torch.isfinite(weight.panels).all()):
        return None
    n, k = weight.shape
    screen = Screen(
        weight=torch.empty((math.ceil(n / _COLS), math.ceil(k / 2), _COLS, 2), dtype=torch.int16),
        norms=torch.empty(n),
        gaps=torch.empty(n),
    )
    load_extension().pack_screen(weight.panels, n, screen.weight, screen.norms, screen.gaps)
    return screen


def greedy_tokens(
    x: torch.Tensor,
    weight: gemm.PackedWeight,
    screen: Screen,
    max_candidates: int = MAX_CANDIDATES,
) -> torch.Tensor:
    """Each row's greedy token: ``argmax(gemm.packed_linear(x, weight), dim=-1)``, the first
    index of the largest float32 logit, without computing most of them (module docstring).

    Args:
        x: ``[M, K]`` float32 on the CPU (copied first if not contiguous): the final hidden
            states of the sampled rows.
        weight: the head ``[N, K]`` from :func:`gemm.pack_weight`.
        screen: ``build_screen(weight)``.
        max_candidates: the most tokens a row re-checks in float32 before it is left undecided.

    Returns:
        ``[M]`` int64 token ids in ``[0, N)``, or -1 for a row left to the full logits (a
        hidden state or a logit that is not finite, or more than ``max_candidates`` tokens
        within the bound of the largest).

    Raises:
        RuntimeError: the kernel is not available, or shapes, dtypes or devices that do not
            match (the message names them).
    """
    ext = load_extension()
    if ext is None:
        raise RuntimeError("the CPU greedy-head kernel could not be built")
    tokens = torch.empty(x.shape[0], dtype=torch.int64)
    ext.greedy_tokens(
        tokens,
        x.contiguous(),
        weight.panels,
        weight.shape[0],
        screen.weight,
        screen.norms,
        screen.gaps,
        max_candidates,
    )
    return tokens
