"""The output-tile scheme shared by the quantized matmul kernels (``int4_matmul``,
``fp8_matmul``): a 2-D grid of programs, each computing one ``[BLOCK_M, BLOCK_N]`` tile of
``out [M, N]`` (program id 0 along ``M``, 1 along ``N``) by walking ``K`` in ``BLOCK_K``
slices; activations ``x [M, K]`` have unit stride along ``K``, ``out`` is contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels._utils import cdiv, check_dot_dims

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32
# The block sizes as launch keywords: ``kernel[grid](..., **TILE)``.
TILE = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K}


def tile_output(
    fn: str, num_m: int, num_n: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, tuple[int, int]]:
    """The uninitialised output ``[num_m, num_n]`` of ``dtype`` on ``device``, and the launch
    grid that covers it with :data:`TILE` tiles.

    Raises:
        ValueError: a block size a GPU's ``tl.dot`` cannot compile (see ``check_dot_dims``),
            named with ``fn``.
    """
    check_dot_dims(fn, TILE)
    out = torch.empty(num_m, num_n, dtype=dtype, device=device)
    return out, (cdiv(num_m, BLOCK_M), cdiv(num_n, BLOCK_N))


@triton.jit
def tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile: ``(offs_m [BLOCK_M], offs_n [BLOCK_N], mask_m, mask_n)``, the
    rows and columns of ``out`` it covers and which of them lie inside ``[M, N]``."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def load_x_slice(x_ptr, stride_xm, offs_m, mask_m, k0, K, BLOCK_K: tl.constexpr):
    """The activation slice ``x[offs_m, k0 : k0 + BLOCK_K]`` (``[BLOCK_M, BLOCK_K]``, 0 outside
    ``x``), with its input features ``offs_k`` and their mask ``mask_k``."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    x = tl.load(
        x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
        mask=mask_m[:, None] & mask_k[None, :],
        other=0.0,
    )
    return x, offs_k, mask_k


@triton.jit
def store_tile(out_ptr, acc, offs_m, offs_n, mask_m, mask_n, N):
    """Write the float32 tile ``acc`` into ``out`` (``[M, N]`` contiguous) in ``out``'s dtype,
    the rows and columns inside it only."""
    tl.store(
        out_ptr + offs_m[:, None] * N + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )
