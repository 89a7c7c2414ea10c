"""Pipeline parallelism: which layers a stage holds, and the activations it passes on.

GPipe's split (Huang et al. 2019) as vLLM runs it for inference: the decoder layers are cut
into ``pipeline_parallel_size`` contiguous stages; stage 0 also holds the token embedding, the
last stage the final norm and the LM head. A stage's forward pass starts from the previous
stage's hidden states and residual stream (:class:`IntermediateTensors`), received point to
point from the rank with the same tensor-parallel rank one stage up, and ends by sending its own
to the next stage. Every rank of a stage holds the whole (all-reduced) activations, so each
sends its copy: ``2 * num_tokens * hidden_size`` elements per rank per stage boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from kvpilot.engine.distributed.parallel_state import get_pp_state

if TYPE_CHECKING:
    from kvpilot.engine.model_shape import ModelShape


@dataclass
class IntermediateTensors:
    """What a stage hands the next one (vLLM's name).

    Attributes:
        hidden_states: ``[num_tokens, hidden_size]``, model dtype: the last layer's output.
        residual: ``[num_tokens, hidden_size]``, model dtype: the residual stream it is still
            to be added to (the next layer's norm adds it).
    """

    hidden_states: torch.Tensor
    residual: torch.Tensor


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The layers ``[start, end)`` of stage ``pp_rank`` of ``pp_size`` (vLLM's function).

    An even split; the ``num_layers % pp_size`` leftover layers go one each to the stages
    just before the last, as vLLM places them (the first stage also holds the embedding, the
    last the norm and the LM head), so 30 layers over 4 stages are 7, 8, 8, 7.

    Raises:
        ValueError: fewer layers than stages (the message names both).
    """
    if num_layers < pp_size:
        raise ValueError(
            f"num_hidden_layers {num_layers} is smaller than pipeline_parallel_size {pp_size}"
        )
    base, extra = divmod(num_layers, pp_size)
    sizes = [base] * pp_size
    for stage in range(pp_size - 1 - extra, pp_size - 1):
        sizes[stage] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def max_stage_layers(num_layers: int, pp_size: int) -> int:
    """Layers of the largest stage: what sizes every rank's KV cache (blocks are shared)."""
    return max(
        end - start
        for start, end in (get_pp_indices(num_layers, r, pp_size) for r in range(pp_size))
    )


def check_pipeline_parallel_size(spec: ModelShape, pipeline_parallel_size: int) -> None:
    """Check that ``spec``'s layers can be split into ``pipeline_parallel_size`` stages and
    that its architecture's implementation supports it.

    Raises:
        ValueError: not a positive integer, more stages than layers, or a model class
            without ``supports_pp`` (each named in the message).
    """
    pp = pipeline_parallel_size
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pipeline_parallel_size must be a positive integer, got {pp!r}")
    get_pp_indices(spec.num_layers, 0, pp)
    if pp > 1 and spec.architectures:
        from kvpilot.engine.models import MODEL_REGISTRY, get_model_class

        architecture = spec.architectures[0]
        if architecture in MODEL_REGISTRY:
            model_cls = get_model_class(SimpleNamespace(architectures=[architecture]))
            if not getattr(model_cls, "supports_pp", False):
                raise ValueError(
                    f"pipeline_parallel_size {pp}: {architecture} does not support pipeline "
                    "parallelism"
                )


class PPMissingLayer(nn.Module):
    """Placeholder for a layer another stage holds: no parameters, never called (vLLM's name)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this layer belongs to another pipeline stage")


def send_intermediate_tensors(tensors: IntermediateTensors) -> None:
    """Send this stage's activations to the next stage's rank (blocks until received).

    Raises:
        RuntimeError: from ``torch.distributed`` when the peer is gone or the group's
            timeout expires.
    """
    peer = get_pp_state().next_rank
    dist.send(tensors.hidden_states.contiguous(), dst=peer)
    dist.send(tensors.residual.contiguous(), dst=peer)


def recv_intermediate_tensors(
    num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
) -> IntermediateTensors:
    """Receive the previous stage's activations, ``[num_tokens, hidden_size]`` each.

    Raises:
        RuntimeError: from ``torch.distributed`` when the peer is gone or the group's
            timeout (``distributed_timeout_s``) expires.
    """
    peer = get_pp_state().prev_rank
    hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
    residual = torch.empty_like(hidden)
    dist.recv(hidden, src=peer)
    dist.recv(residual, src=peer)
    return IntermediateTensors(hidden, residual)
