"""The mixture-of-experts MLP: a router, top-k routing and the experts as one fused layer.

Sparsely-gated mixture of experts (Shazeer et al. 2017) as Mixtral (Jiang et al. 2024) and
Qwen3-MoE run it: a replicated router ``gate`` scores the experts, each token goes to its
``top_k`` best (softmax over all experts, then top-k, renormalised to sum to 1 where the model
says so), and the token's output is the routing-weighted sum of those experts' SwiGLU MLPs.
All experts' weights are stacked (vLLM's ``FusedMoE``): ``w13_weight`` ``[experts, 2 *
intermediate, hidden]`` (each expert's gate rows, then its up rows) and ``w2_weight``
``[experts, hidden, intermediate]``. The (token, expert) pairs are sorted by expert
(:mod:`kvpilot.kernels.moe_segments`) and each expert's run is multiplied by that expert's
weights in one grouped matmul: ``torch.nn.functional.grouped_mm`` on the CPU, the Triton
kernel (:mod:`kvpilot.kernels.fused_moe`) on the GPU.

Tensor parallelism, as vLLM does it: by default every rank holds a slice of every expert's
intermediate dimension (Megatron-LM's column/row split inside each expert: ``w13`` rows, ``w2``
columns); with expert parallelism (``--enable-expert-parallel``) the experts are placed whole,
``num_experts / tp`` consecutive ones per rank, and a pair routed to another rank's expert adds
nothing here. Either way each rank's output is a partial sum and one all-reduce completes it.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.distributed import divide, get_tp_state, tensor_model_parallel_all_reduce
from kvpilot.engine.layers.activation import get_act_and_mul
from kvpilot.engine.layers.custom_op import CustomOp
from kvpilot.engine.layers.linear import Linear
from kvpilot.engine.layers.weight_loading import CheckpointTensor, shape_of
from kvpilot.kernels.moe_segments import expert_segments

# Per-expert checkpoint tensors (Mixtral's w1/w3/w2, Qwen-MoE's gate/up/down_proj) -> the
# stacked parameter and the shard they fill.
_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_PROJECTIONS = {
    "w1": ("w13_weight", "w1"),
    "gate_proj": ("w13_weight", "w1"),
    "w3": ("w13_weight", "w3"),
    "up_proj": ("w13_weight", "w3"),
    "w2": ("w2_weight", "w2"),
    "down_proj": ("w2_weight", "w2"),
}
# Experts already stacked (transformers 5's in-memory layout, what ``save_pretrained(...,
# save_original_format=False)`` writes): ``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``.
_STACKED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
_STACKED_PARAMS = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}

ExpertShard = tuple[int, str]


def expert_param_name(name: str) -> tuple[str, ExpertShard | None] | None:
    """The parameter a checkpoint expert tensor fills, and its shard: ``(expert, "w1" | "w3" |
    "w2")`` for a per-expert tensor, None for an already stacked one; None for other names.

    E.g. ``model.layers.0.block_sparse_moe.experts.3.w1.weight`` ->
    ``("model.layers.0.block_sparse_moe.experts.w13_weight", (3, "w1"))``.
    """
    match = _PER_EXPERT.search(name)
    if match:
        param, shard = _PROJECTIONS[match[2]]
        return f"{name[: match.start()]}.experts.{param}", (int(match[1]), shard)
    match = _STACKED.search(name)
    if match:
        return f"{name[: match.start()]}.experts.{_STACKED_PARAMS[match[1]]}", None
    return None


def expert_shard_ids(param_name: str, num_experts: int) -> set[ExpertShard]:
    """Every shard a stacked expert parameter needs from a per-expert checkpoint."""
    shards = ("w2",) if param_name.endswith("w2_weight") else ("w1", "w3")
    return {(e, s) for e in range(num_experts) for s in shards}


def fused_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: softmax over all experts in float32, the ``top_k`` largest, divided by
    their sum when ``renormalize`` (Mixtral always; Qwen3-MoE when ``norm_topk_prob``).

    Args:
        router_logits: ``[num_tokens, num_experts]`` float, the router's output.
        top_k: experts per token.
        renormalize: whether the chosen weights are rescaled to sum to 1.

    Returns:
        ``(topk_weights [num_tokens, top_k] float32, topk_ids [num_tokens, top_k] int64)``,
        weights in descending order.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(CustomOp):
    """All experts of one layer, this rank's part of them, run as grouped matmuls.

    Args:
        num_experts: experts of the whole layer.
        hidden_size: model width.
        intermediate_size: one expert's MLP width (whole, unsharded).
        hidden_act: the config's ``hidden_act`` (``silu`` for every supported model).
        kernel_backend: ``"torch"`` (the grouped CPU path) or ``"triton"`` (the kernel).

    Attributes:
        w13_weight: ``[num_local_experts, 2 * intermediate_per_rank, hidden_size]``.
        w2_weight: ``[num_local_experts, hidden_size, intermediate_per_rank]``.
        expert_map: ``[num_experts]`` int32 buffer, global expert -> local index or ``-1``,
            under expert parallelism; None when this rank holds every expert.
        local_experts: the global ids of this rank's experts, in order.

    Raises:
        ValueError: ``intermediate_size`` (tensor parallelism) or ``num_experts`` (expert
            parallelism) not divisible by the tensor-parallel size; an unsupported
            ``hidden_act``.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str = "silu",
        kernel_backend: str = "torch",
    ) -> None:
        super().__init__(kernel_backend)
        state = get_tp_state()
        self.tp_rank, self.tp_size = state.rank, state.world_size
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        expert_map = None
        if state.enable_expert_parallel and self.tp_size > 1:
            per_rank = divide(num_experts, self.tp_size, "num_experts")
            first = self.tp_rank * per_rank
            self.local_experts = list(range(first, first + per_rank))
            self.intermediate_per_rank = intermediate_size
            expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
            expert_map[first : first + per_rank] = torch.arange(per_rank, dtype=torch.int32)
        else:
            self.local_experts = list(range(num_experts))
            self.intermediate_per_rank = divide(
                intermediate_size, self.tp_size, "moe intermediate_size"
            )
        self.register_buffer("expert_map", expert_map, persistent=False)
        self._local_index = {e: i for i, e in enumerate(self.local_experts)}
        num_local, width = len(self.local_experts), self.intermediate_per_rank
        self.w13_weight = nn.Parameter(
            torch.empty(num_local, 2 * width, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_local, hidden_size, width), requires_grad=False
        )
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        self.act_fn = get_act_and_mul(hidden_act, kernel_backend)

    def weight_loader(
        self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: ExpertShard | None = None
    ) -> None:
        """Copy this rank's part of one checkpoint tensor: one expert's ``w1`` (gate) or ``w3``
        (up) ``[intermediate, hidden]`` or ``w2`` (down) ``[hidden, intermediate]`` (``shard_id``
        ``(expert, name)``), or every expert's stacked ``[experts, 2 * intermediate, hidden]`` /
        ``[experts, hidden, intermediate]`` tensor (``shard_id`` None). Experts of other ranks
        are skipped; only this rank's rows (or columns) are read from a lazy slice.

        Raises:
            ValueError: the tensor's shape does not match, or an expert id out of range.
        """
        size, hidden = self.intermediate_size, self.hidden_size
        is_w13 = param is self.w13_weight
        if shard_id is None:
            rows = (2 * size, hidden) if is_w13 else (hidden, size)
            self._check_shape(loaded, (self.num_experts, *rows))
            for expert in self.local_experts:
                index = slice(expert, expert + 1)
                if is_w13:
                    self._copy(param, expert, "w1", loaded, (index, self._rows(0)))
                    self._copy(param, expert, "w3", loaded, (index, self._rows(size)))
                else:
                    self._copy(param, expert, "w2", loaded, (index, slice(None), self._rows(0)))
            return
        expert, name = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"is expert {expert}; the layer has {self.num_experts}")
        self._check_shape(loaded, (hidden, size) if name == "w2" else (size, hidden))
        if expert not in self._local_index:
            return
        index = (slice(None), self._rows(0)) if name == "w2" else (self._rows(0),)
        self._copy(param, expert, name, loaded, index)

    def _rows(self, offset: int) -> slice:
        # This rank's slice of one expert's intermediate dimension, from ``offset``.
        width = self.intermediate_per_rank
        start = offset + (0 if self.expert_map is not None else self.tp_rank * width)
        return slice(start, start + width)

    @staticmethod
    def _check_shape(loaded: CheckpointTensor, expected: tuple[int, ...]) -> None:
        if shape_of(loaded) != expected:
            raise ValueError(f"has shape {shape_of(loaded)}, the model expects {expected}")

    def _copy(
        self, param: nn.Parameter, expert: int, name: str, loaded: CheckpointTensor, index: tuple
    ) -> None:
        local, width = self._local_index[expert], self.intermediate_per_rank
        target = param.data[local]
        if name != "w2":
            target = target.narrow(0, 0 if name == "w1" else width, width)
        piece = loaded[index]
        with torch.no_grad():
            target.copy_(piece.reshape(target.shape))

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The experts' routing-weighted sum, completed across ranks.

        Args:
            hidden: ``[num_tokens, hidden_size]``, model dtype.
            topk_weights: ``[num_tokens, top_k]`` float routing weights (from
                :func:`fused_topk`).
            topk_ids: ``[num_tokens, top_k]`` int64 global expert ids.

        Returns:
            ``[num_tokens, hidden_size]``, ``hidden``'s dtype, the same on every rank.
        """
        return tensor_model_parallel_all_reduce(super().forward(hidden, topk_weights, topk_ids))

    def forward_native(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's partial sum: the pairs sorted by expert, then one grouped matmul
        (``torch.nn.functional.grouped_mm``, each expert's run by its own weights) for gate/up
        and one for down; each pair's row, scaled by its routing weight, is added into its
        token's row (``index_add_``, in ascending expert order per token, as transformers'
        eager ``MixtralExperts`` adds them). Reads the number of local pairs on the host.
        """
        top_k = topk_ids.shape[1]
        out = torch.zeros_like(hidden)
        segments = expert_segments(topk_ids, len(self.local_experts), self.expert_map)
        offsets = torch.cumsum(segments.expert_num_pairs, 0, dtype=torch.int32)
        num_pairs = int(offsets[-1])
        if num_pairs == 0:
            return out
        pairs = segments.pair_indices[:num_pairs].long()
        tokens = pairs // top_k
        gate_up = F.grouped_mm(hidden[tokens], self.w13_weight.transpose(1, 2), offs=offsets)
        down = F.grouped_mm(self.act_fn(gate_up), self.w2_weight.transpose(1, 2), offs=offsets)
        scaled = down * topk_weights.flatten()[pairs, None]
        return out.index_add_(0, tokens, scaled.to(out.dtype))

    def forward_triton(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's partial sum by the Triton grouped-matmul kernel.

        Raises:
            ValueError: from the kernel's input checks.
        """
        from kvpilot.kernels.fused_moe import fused_experts

        return fused_experts(
            hidden.contiguous(),
            self.w13_weight,
            self.w2_weight,
            topk_weights,
            topk_ids,
            self.expert_map,
            self.act_fn,
        )


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one decoder layer: the router ``gate`` (replicated ``[num_experts,
    hidden]``), top-k routing and the :class:`FusedMoE` ``experts`` (Hugging Face's names).

    Args:
        num_experts, top_k: experts per layer and per token.
        hidden_size: model width.
        intermediate_size: one expert's MLP width.
        renormalize: rescale the top-k weights to sum to 1 (Mixtral; Qwen3-MoE's
            ``norm_topk_prob``).
        hidden_act: the config's ``hidden_act``.
        kernel_backend: ``"torch"`` or ``"triton"``.
        weights_in_model_dtype: round the routing weights to the model dtype before they
            scale the experts' outputs (Qwen3-MoE does; Mixtral scales in float32).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        hidden_act: str = "silu",
        kernel_backend: str = "torch",
        weights_in_model_dtype: bool = False,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, {num_experts}]")
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_model_dtype = weights_in_model_dtype
        self.gate = Linear(hidden_size, num_experts)
        self.experts = FusedMoE(
            num_experts, hidden_size, intermediate_size, hidden_act, kernel_backend
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[num_tokens, hidden_size]`` -> same shape and dtype."""
        weights, ids = fused_topk(self.gate(hidden), self.top_k, self.renormalize)
        if self.weights_in_model_dtype:
            weights = weights.to(hidden.dtype)
        return self.experts(hidden, weights, ids)
