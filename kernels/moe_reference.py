"""PyTorch reference of the fused mixture-of-experts kernel (``kvpilot.kernels.fused_moe``).

Written per token, for clarity, not speed, and in float32 whatever the input dtype (the result
is cast back): the specification the Triton kernel and the engine's grouped CPU path are
tested against. Sparsely-gated mixture of experts (Shazeer et al. 2017) with SwiGLU experts,
as Mixtral (Jiang et al. 2024) and Qwen3-MoE define them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpilot.kernels import reference


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    act_and_mul: Callable[[torch.Tensor], torch.Tensor] = reference.silu_and_mul,
) -> torch.Tensor:
    """``out[t] = sum_k topk_weights[t, k] * w2[e] @ act_and_mul(w13[e] @ hidden[t])`` with
    ``e`` the local expert of ``topk_ids[t, k]``; pairs routed to experts held by other ranks
    add nothing.

    Args:
        hidden: ``[num_tokens, hidden_size]`` float.
        w13: ``[num_local_experts, 2 * intermediate, hidden_size]``: each expert's gate rows,
            then its up rows.
        w2: ``[num_local_experts, hidden_size, intermediate]``: each expert's down projection.
        topk_weights: ``[num_tokens, top_k]`` float routing weights.
        topk_ids: ``[num_tokens, top_k]`` int global expert ids.
        expert_map: ``[num_experts]`` int: global expert -> local index or ``-1``; None when
            all experts are local.
        act_and_mul: the gated activation on ``[..., 2 * intermediate]`` (SwiGLU by default).

    Returns:
        ``[num_tokens, hidden_size]``, ``hidden``'s dtype.
    """
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    x, gate_up_w, down_w = hidden.float(), w13.float(), w2.float()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            h = act_and_mul(gate_up_w[e] @ x[t])
            out[t] += topk_weights[t, k].float() * (down_w[e] @ h)
    return out.to(hidden.dtype)
