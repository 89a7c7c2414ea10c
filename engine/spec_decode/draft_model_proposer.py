"""Draft tokens from a smaller model that shares the target's tokenizer.

Leviathan et al. 2023: a cheap model guesses ``k`` tokens one at a time; the target scores
them all in one forward pass. The draft model keeps its own paged KV cache (its own layers,
heads and head size) addressed by the target's block tables: the block manager allocates once
for both, so prefix caching, preemption and the rollback of rejected tokens apply to the draft's
cache too. Drafts are greedy (the argmax of the draft's logits), as in vLLM V1's draft
proposers; a deterministic draft keeps rejection sampling lossless at any temperature.
"""

from __future__ import annotations

import json
import pathlib

import torch

from kvpilot.engine.model_runner import allocate_kv_caches, build_model_inputs
from kvpilot.engine.request import Request
from kvpilot.engine.sampler import greedy_argmax
from kvpilot.engine.scheduler_output import SchedulerOutput


class DraftModelProposer:
    """Runs the draft model after each target step and sets ``request.spec_token_ids``.

    Every step the draft first computes the K/V of the tokens the target computed for real
    (so a block cached for prefix reuse holds the draft's K/V too), then, for requests that
    want drafts, ``k`` greedy tokens, one forward pass each. Its K/V for the proposals land in
    the ``num_lookahead_tokens`` slots the scheduler reserves past each request's tokens.

    Args:
        model: the draft model (the engine's model interface).
        num_blocks: blocks of the shared block pool (the target's count).
        block_size: tokens per block.
        device: where the model and its cache live.
        num_speculative_tokens: drafts per request and step (k).
        cache_dtype: its KV cache's dtype, the target's (``--kv-cache-dtype``); None for the
            draft model's dtype.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        num_speculative_tokens: int,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.k = num_speculative_tokens
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, device, cache_dtype)

    @torch.inference_mode()
    def propose(self, scheduler_output: SchedulerOutput, requests: list[Request]) -> None:
        """Catch the draft's cache up with the step that ran, then draft for ``requests``.

        Args:
            scheduler_output: the step the target just ran (``update_from_output`` applied:
                ``num_computed_tokens`` counts only accepted tokens).
            requests: unfinished requests that sampled this step; each gets up to
                ``min(k, max_tokens - num_output_tokens - 1)`` drafts.
        """
        wanted = {r.request_id for r in requests}
        token_ids, num_computed, block_ids, proposing = [], [], [], []
        for sched in scheduler_output.scheduled:
            request = sched.request
            start = sched.num_computed_tokens
            # Requests that draft also feed their newest token (not in the target's cache yet);
            # the others only the tokens the target kept.
            proposes = request.request_id in wanted
            end = (
                request.num_tokens
                if proposes
                else min(request.num_computed_tokens, request.num_tokens)
            )
            if end <= start:
                continue
            limit = min(self.k, request.max_tokens - request.num_output_tokens - 1)
            if proposes and limit > 0:
                proposing.append((len(token_ids), request, sched.block_ids, limit))
            token_ids.append(request.all_token_ids[start:end])
            num_computed.append(start)
            block_ids.append(sched.block_ids)
        for request in requests:
            request.spec_token_ids = []
        if not token_ids:
            return
        hidden, last_token = self._forward(token_ids, num_computed, block_ids)
        if not proposing:
            return
        rows = torch.tensor([row for row, *_ in proposing], device=hidden.device)
        drafts = self._argmax(hidden[last_token[rows]])
        for (_, request, _, _), token in zip(proposing, drafts, strict=True):
            request.spec_token_ids.append(token)
        for j in range(1, self.k):
            active = [(request, blocks) for _, request, blocks, limit in proposing if limit > j]
            if not active:
                break
            # Draft j - 1 sits at position num_tokens + j - 1.
            hidden, _ = self._forward(
                [[request.spec_token_ids[-1]] for request, _ in active],
                [request.num_tokens + j - 1 for request, _ in active],
                [blocks for _, blocks in active],
            )
            for (request, _), token in zip(active, self._argmax(hidden), strict=True):
                request.spec_token_ids.append(token)

    def _forward(
        self, token_ids: list[list[int]], num_computed: list[int], block_ids: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states ``[num_tokens, hidden_size]`` and each sequence's last token index."""
        input_ids, positions, metadata = build_model_inputs(
            token_ids, num_computed, block_ids, self.block_size, self.device
        )
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        return hidden, metadata.query_start_loc[1:].long() - 1

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        return greedy_argmax(self.model.compute_logits(hidden)).tolist()


def check_draft_vocabulary(target_dir: pathlib.Path, draft_dir: pathlib.Path) -> None:
    """Refuse a draft model whose tokens mean something else than the target's.

    Compares ``vocab_size`` in both ``config.json`` files, then both tokenizers' token-to-id
    maps (a draft with the same size but another tokenizer would propose nonsense ids).

    Raises:
        ValueError: naming both models and the first difference found.
    """
    from kvpilot.engine.model_loader import load_tokenizer

    sizes = [
        json.loads((d / "config.json").read_text()).get("vocab_size")
        for d in (target_dir, draft_dir)
    ]
    if sizes[0] != sizes[1]:
        raise ValueError(
            f"speculative_config: the draft model {draft_dir} has vocab_size {sizes[1]}, the "
            f"target {target_dir} has {sizes[0]}; a draft model must share the target's tokenizer"
        )
    target_vocab = load_tokenizer(target_dir).get_vocab()
    draft_vocab = load_tokenizer(draft_dir).get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(
            t
            for t in target_vocab.keys() | draft_vocab.keys()
            if target_vocab.get(t) != draft_vocab.get(t)
        )
        raise ValueError(
            f"speculative_config: the draft model {draft_dir} has a different tokenizer than the "
            f"target {target_dir} ({len(differing)} tokens differ, e.g. {differing[:3]}); a "
            "draft model must share the target's tokenizer"
        )
