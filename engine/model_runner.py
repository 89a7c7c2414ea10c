"""Runs one scheduled step: flat input tensors, the model's forward pass, sampling.

The batch layout is vLLM V1's: the new tokens of every scheduled request are concatenated into
one ``[num_tokens]`` dimension, prefill chunks and decodes alike, and attention finds each
sequence's context through its block table (PagedAttention). Under pipeline parallelism a
stage after the first starts from the previous stage's activations and every stage but the
last passes its own on; only the last computes logits and samples.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.distributed import get_pp_state
from kvpilot.engine.distributed.pipeline import (
    IntermediateTensors,
    recv_intermediate_tensors,
    send_intermediate_tensors,
)
from kvpilot.engine.logits_processors import TokenLogprobs, changes_logits
from kvpilot.engine.prompt_logprobs import compute_prompt_logprobs, rows_per_slice
from kvpilot.engine.request import Request
from kvpilot.engine.sampler import Sampler
from kvpilot.engine.scheduler_output import SchedulerOutput
from kvpilot.engine.spec_decode.rejection_sampler import RejectionSampler, greedy_verify
from kvpilot.engine.structured_output import apply_grammar_bitmask
from kvpilot.engine.thinking_budget import forced_logits_rows
from kvpilot.kernels.cpu import huge_pages

if TYPE_CHECKING:
    from kvpilot.engine.lora.manager import LoRAManager


@dataclass
class ModelRunnerOutput:
    """What one step produced.

    Attributes:
        sampled_token_ids: request id -> the tokens emitted, for requests whose ``sample`` was
            set: one token, or with draft tokens the accepted drafts then one target token.
        logprobs: request id -> one ``(sampled_logprob, {token_id: (logprob, rank)})`` per
            emitted token, for requests that asked for logprobs.
        prompt_logprobs: request id -> the same per prompt token scored this step, the first
            being prompt token ``num_computed_tokens + 1`` (see ``compute_prompt_logprobs``),
            for requests that still need their prompt logprobs.
    """

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]]
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class ModelRunner:
    """Owns the model, its paged KV cache tensors and the sampler.

    Args:
        model: a model with the engine's interface (``forward(input_ids, positions, kv_caches,
            attn_metadata)``, ``compute_logits``, ``vocab_size``, ``num_layers``,
            ``num_kv_heads``, ``head_dim``, ``dtype``).
        num_blocks: KV cache blocks to allocate.
        block_size: tokens per block.
        device: where the model and cache live.
        sampler: draws the tokens.
        cache_dtype: the KV cache's dtype (``--kv-cache-dtype``); None for the model's.

    Attributes:
        lora_manager: the model's LoRA slots, set by the engine when LoRA is enabled (the
            model's projections are then wrapped); each step maps its tokens to their adapters.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        sampler: Sampler,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.lora_manager: LoRAManager | None = None
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.rejection_sampler = RejectionSampler(sampler)
        self.cache_dtype = cache_dtype or model.dtype
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, device, self.cache_dtype)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the scheduled tokens' K/V and hidden states, then sample where a token is due.

        A partial prefill chunk (``sample`` False) only fills the cache; its logits are never
        computed, except for a request that needs its prompt logprobs, whose prompt rows are
        scored (``compute_prompt_logprobs``). Requests with draft tokens get logits at every
        draft position and after the last one, and the rejection sampler decides how many
        drafts they keep. Constrained requests (structured outputs) get their grammar's bitmask
        applied before sampling; sequences whose thinking budget is spent get their forced
        tokens (``scheduler_output.forced_token_ids``) after the logits processors.
        """
        self.sampler.remove_requests(scheduler_output.finished_request_ids)
        scheduled = scheduler_output.scheduled
        input_ids, positions, attn_metadata = self.prepare_inputs(scheduler_output)
        if self.lora_manager is not None:
            self.lora_manager.set_batch(
                [s.request.lora_name for s in scheduled], [s.num_new_tokens for s in scheduled]
            )
        rows = [i for i, s in enumerate(scheduled) if s.sample]
        spec_token_ids = [scheduled[i].spec_token_ids for i in rows]
        logits_indices = _logits_indices(attn_metadata, rows, spec_token_ids)
        pp = get_pp_state()
        # Only the rows the LM head reads leave the model, unless prompt logprobs read them all
        # (a decode-only step reads every row anyway); pipeline stages pass every row on.
        prune = (
            pp.world_size == 1
            and len(logits_indices) < len(input_ids)
            and not any(s.request.needs_prompt_logprobs for s in scheduled)
        )
        if pp.world_size == 1:
            extra = {"logits_indices": logits_indices} if prune else {}
            hidden = self.model(input_ids, positions, self.kv_caches, attn_metadata, **extra)
        else:
            hidden = self._run_stage(input_ids, positions, attn_metadata)
            if not pp.is_last_rank:
                return ModelRunnerOutput({}, {})
        prompt_logprobs = (
            {}
            if prune
            else compute_prompt_logprobs(
                self.model.compute_logits, hidden, scheduled, self.model.vocab_size
            )
        )
        if not rows:
            return ModelRunnerOutput({}, {}, prompt_logprobs)
        hidden = hidden if prune else hidden[logits_indices]
        requests = [scheduled[i].request for i in rows]
        ids = [r.request_id for r in requests]
        token_ids, logprobs = self._sample(hidden, requests, spec_token_ids, scheduler_output)
        return ModelRunnerOutput(
            sampled_token_ids=dict(zip(ids, token_ids, strict=True)),
            logprobs={rid: lp for rid, lp in zip(ids, logprobs, strict=True) if lp is not None},
            prompt_logprobs=prompt_logprobs,
        )

    def _sample(
        self,
        hidden: torch.Tensor,
        requests: list[Request],
        spec_token_ids: list[list[int]],
        scheduler_output: SchedulerOutput,
    ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """The tokens each request emits this step, and their logprobs where asked.

        Args:
            hidden: ``[num_rows, hidden_size]``, each request's rows in turn: one per draft
                token of ``spec_token_ids`` and one after the last (one row without drafts).
            requests: the sampled requests, in row order.
            spec_token_ids: per request its draft tokens (possibly none).
            scheduler_output: the step (grammars, forced tokens).

        A request whose every row only needs the argmax of its raw logits (greedy, no logprobs,
        no logits processor at this step, no grammar, no forced token) takes the model's greedy
        head where it has one (``greedy_tokens``: the same token as the argmax of every logit,
        bit for bit, from a fraction of the work): without drafts it emits that argmax; with
        drafts, greedy verification (``greedy_verify``, what the rejection sampler does for a
        greedy request). The others, and a request with a row the head leaves undecided, get
        their logits computed and go through the sampler, or through the rejection sampler
        when the step verifies drafts (as every request of such a step did before the head).
        """
        num_rows = [len(d) + 1 for d in spec_token_ids]
        starts = list(itertools.accumulate(num_rows, initial=0))
        greedy = self._greedy_tokens(hidden, requests, starts, scheduler_output)
        token_ids: list[list[int]] = [
            greedy_verify(spec_token_ids[i], greedy[i]) if i in greedy else []
            for i in range(len(requests))
        ]
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(requests)
        rest = [i for i in range(len(requests)) if i not in greedy]
        if not rest:
            return token_ids, logprobs
        rest_requests = [requests[i] for i in rest]
        rest_ids = [r.request_id for r in rest_requests]
        rest_rows = [row for i in rest for row in range(starts[i], starts[i + 1])]
        logits = self.model.compute_logits(
            hidden if len(rest_rows) == hidden.shape[0] else hidden[rest_rows]
        ).float()
        rest_num_rows = [num_rows[i] for i in rest]
        _apply_grammar_bitmask(logits, scheduler_output, rest_ids, rest_num_rows)
        forced = forced_logits_rows(scheduler_output.forced_token_ids, rest_ids, rest_num_rows)
        if any(spec_token_ids):
            rest_drafts = [spec_token_ids[i] for i in rest]
            spec_out = self.rejection_sampler(logits, rest_requests, rest_drafts, forced)
            rest_tokens, rest_logprobs = spec_out.token_ids, spec_out.logprobs
        else:
            out = self.sampler(logits, rest_requests, forced)
            rest_tokens = [[token] for token in out.token_ids]
            rest_logprobs = [None if lp is None else [lp] for lp in out.logprobs]
        for i, tokens, lp in zip(rest, rest_tokens, rest_logprobs, strict=True):
            token_ids[i] = tokens
            logprobs[i] = lp
        return token_ids, logprobs

    def _greedy_tokens(
        self,
        hidden: torch.Tensor,
        requests: list[Request],
        starts: list[int],
        scheduler_output: SchedulerOutput,
    ) -> dict[int, list[int]]:
        """``{request: its rows' tokens}`` for the requests whose every row (``starts[i]`` to
        ``starts[i + 1]``) the model's greedy head decided (see :meth:`_sample`)."""
        greedy_tokens = self._greedy_head()
        if greedy_tokens is None:
            return {}
        constrained = set(scheduler_output.structured_output_request_ids)
        # changes_logits at the first row covers the drafts' rows: only min_tokens depends on
        # the output's length, and a longer output reaches it sooner.
        eligible = [
            i
            for i, r in enumerate(requests)
            if r.sampling_params.greedy
            and r.sampling_params.logprobs is None
            and not changes_logits(r.sampling_params, len(r.output_token_ids))
            and r.request_id not in constrained
            and r.request_id not in scheduler_output.forced_token_ids
        ]
        if not eligible:
            return {}
        rows = [row for i in eligible for row in range(starts[i], starts[i + 1])]
        tokens = greedy_tokens(hidden if len(rows) == hidden.shape[0] else hidden[rows])
        if tokens is None:
            return {}
        flat = tokens.tolist()
        decided: dict[int, list[int]] = {}
        at = 0
        for i in eligible:
            mine = flat[at : at + starts[i + 1] - starts[i]]
            at += len(mine)
            if min(mine) >= 0:
                decided[i] = mine
        return decided

    def _greedy_head(self) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
        """The model's greedy head (``greedy_tokens``) on the CPU, where it has one; else None
        (a GPU computes the logits; the CPU kernel is not even built there)."""
        return getattr(self.model, "greedy_tokens", None) if self.device.type == "cpu" else None

    def _run_stage(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """This pipeline stage's forward pass: receive (after the first stage), run its layers,
        send (before the last); the final hidden states on the last stage."""
        pp = get_pp_state()
        intermediate = None
        if not pp.is_first_rank:
            intermediate = recv_intermediate_tensors(
                input_ids.shape[0], self.model.config.hidden_size, self.model.dtype, self.device
            )
        out = _forward(
            self.model, input_ids, positions, self.kv_caches, attn_metadata, intermediate
        )
        if not pp.is_last_rank:
            send_intermediate_tensors(out)
        return out

    def prepare_inputs(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten a step into ``input_ids`` ``[num_tokens]`` int64, ``positions``
        ``[num_tokens]`` int64 and the attention metadata (slot mapping, block tables, ...);
        a request's draft tokens follow its real ones."""
        scheduled = scheduler_output.scheduled
        token_ids = []
        for s in scheduled:
            end = s.num_computed_tokens + s.num_new_tokens - len(s.spec_token_ids)
            token_ids.append(
                s.request.all_token_ids[s.num_computed_tokens : end] + s.spec_token_ids
            )
        return build_model_inputs(
            token_ids,
            [s.num_computed_tokens for s in scheduled],
            [s.block_ids for s in scheduled],
            self.block_size,
            self.device,
            prompt_seqs=[s.num_computed_tokens < s.request.num_prompt_tokens for s in scheduled],
        )

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int, max_model_len: int) -> int:
        """Run a forward pass of ``num_tokens`` prompt tokens, score a slice of its rows as
        prompt logprobs do, and return the peak GPU memory (bytes) it needed, weights included,
        with a one-block scratch cache (nothing is written: every slot is -1).

        Raises:
            ValueError: when the runner is not on a CUDA device.
        """
        if self.device.type != "cuda":
            raise ValueError(f"profiling needs a CUDA device, got {self.device}")
        lens = [max_model_len] * (num_tokens // max_model_len)
        if num_tokens % max_model_len:
            lens.append(num_tokens % max_model_len)
        scratch = allocate_kv_caches(self.model, 1, self.block_size, self.device, self.cache_dtype)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        hidden, last_rows = self._dummy_forward(lens, scratch)
        if not get_pp_state().is_last_rank:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        self.model.compute_logits(hidden[last_rows])
        # The largest logits a step holds: one slice of prompt-logprobs rows, log-softmaxed.
        rows = min(num_tokens, rows_per_slice(self.model.vocab_size))
        torch.log_softmax(self.model.compute_logits(hidden[:rows]), dim=-1)
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One small step's work on made-up tokens, nothing written to the cache (every slot
        -1): a 16-token prompt and a one-token decode, then their logits. The first forward pass
        of a process pays for what later ones reuse (the kernels' libraries loaded, the thread
        pool started, the allocator's pages touched: 0.25 s for a 2-token request here), so the
        engine pays it before it reports ready, not its first request (the greedy head's
        bfloat16 screen is built here too)."""
        hidden, last_rows = self._dummy_forward([16, 1], self.kv_caches)
        if get_pp_state().is_last_rank:
            self.model.compute_logits(hidden[last_rows])
            greedy_tokens = self._greedy_head()
            if greedy_tokens is not None:
                greedy_tokens(hidden[last_rows])  # builds the greedy head's screen

    def _dummy_forward(
        self, lens: list[int], kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor | IntermediateTensors, torch.Tensor]:
        """A forward pass of sequences of ``lens`` made-up tokens, each its whole context, on
        ``kv_caches`` without writing them (block 0 is read as their context); the hidden
        states (or a middle stage's activations) and each sequence's last row."""
        num_tokens = sum(lens)
        query_start_loc = torch.tensor(
            [0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32
        )
        metadata = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            query_start_loc=query_start_loc.to(self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(
                len(lens), -(-max(lens) // self.block_size), dtype=torch.int32, device=self.device
            ),
            max_query_len=max(lens),
            max_seq_len=max(lens),
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        intermediate = None
        if not get_pp_state().is_first_rank:
            # Stand-ins for the previous stage's activations: these passes run stages alone.
            zeros = torch.zeros(
                num_tokens,
                self.model.config.hidden_size,
                dtype=self.model.dtype,
                device=self.device,
            )
            intermediate = IntermediateTensors(zeros, zeros.clone())
        hidden = _forward(self.model, input_ids, positions, kv_caches, metadata, intermediate)
        return hidden, (query_start_loc[1:] - 1).long().to(self.device)


def _forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    attn_metadata: AttentionMetadata,
    intermediate: IntermediateTensors | None,
) -> torch.Tensor | IntermediateTensors:
    """The model's forward pass; the previous stage's activations are passed only when there
    are some, so models without pipeline support keep the four-argument interface."""
    if intermediate is None:
        return model(input_ids, positions, kv_caches, attn_metadata)
    return model(input_ids, positions, kv_caches, attn_metadata, intermediate)


def _logits_indices(
    attn_metadata: AttentionMetadata, rows: list[int], spec_token_ids: list[list[int]]
) -> torch.Tensor:
    """The step's token rows the LM head reads, ``[n]`` int64 on the step's device, ascending:
    each sampled request's last token, or with k draft tokens its last k + 1 (the rejection
    sampler scores every draft position and the one after).

    Args:
        attn_metadata: the step's layout (``query_start_loc``: where each request's rows start).
        rows: the indices (in the step's order) of the requests sampled this step.
        spec_token_ids: their draft tokens, one list each (empty without drafts).
    """
    last_token = attn_metadata.query_start_loc[1:].long() - 1
    if not any(spec_token_ids):
        return last_token[rows]
    return torch.cat(
        [
            torch.arange(int(last_token[i]) - len(d), int(last_token[i]) + 1)
            for i, d in zip(rows, spec_token_ids, strict=True)
        ]
    ).to(last_token.device)


def _apply_grammar_bitmask(
    logits: torch.Tensor,
    scheduler_output: SchedulerOutput,
    request_ids: list[str],
    num_rows: list[int],
) -> None:
    """Mask the logits of the step's constrained requests by their grammars' bitmask.

    Args:
        logits: ``[sum(num_rows), vocab_size]`` float32, request by request.
        scheduler_output: carries the bitmask and the constrained requests' ids.
        request_ids: the sampled requests, in logits order.
        num_rows: each request's logits rows (drafts + 1); the bitmask applies to the last,
            which is a constrained request's only row (the engine never drafts for them).
    """
    if scheduler_output.grammar_bitmask is None:
        return
    last_row = dict(
        zip(request_ids, (end - 1 for end in itertools.accumulate(num_rows)), strict=True)
    )
    rows = [last_row[request_id] for request_id in scheduler_output.structured_output_request_ids]
    apply_grammar_bitmask(logits, scheduler_output.grammar_bitmask, rows)


def build_model_inputs(
    token_ids: list[list[int]],
    num_computed_tokens: list[int],
    block_ids: list[list[int]],
    block_size: int,
    device: torch.device,
    prompt_seqs: list[bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Flatten sequences' new tokens into one batch (vLLM V1's layout).

    Args:
        token_ids: per sequence, its new tokens (at least one).
        num_computed_tokens: per sequence, the tokens already in the KV cache; the new ones
            sit at the positions after them.
        block_ids: per sequence, its block table (covering every new token's slot).
        block_size: tokens per block.
        device: where the tensors go.
        prompt_seqs: per sequence, whether its new tokens are prompt tokens
            (``AttentionMetadata.prompt_seqs``); None when not known.

    Returns:
        ``input_ids`` ``[num_tokens]`` int64, ``positions`` ``[num_tokens]`` int64 and the
        attention metadata (slot mapping, block tables, ...).
    """
    input_ids = [t for tokens in token_ids for t in tokens]
    query_lens = [len(tokens) for tokens in token_ids]
    seq_lens = [c + n for c, n in zip(num_computed_tokens, query_lens, strict=True)]
    width = max(len(b) for b in block_ids)
    block_tables = torch.tensor([b + [0] * (width - len(b)) for b in block_ids], dtype=torch.int32)
    query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    query_start_loc = torch.zeros(len(token_ids) + 1, dtype=torch.int32)
    torch.cumsum(query_lens_t, dim=0, out=query_start_loc[1:])
    seq_index = torch.repeat_interleave(torch.arange(len(token_ids)), query_lens_t)
    # Position of each new token: its sequence's start plus its offset within the chunk.
    first_position = (seq_lens_t.long() - query_lens_t)[seq_index]
    positions = first_position + (
        torch.arange(len(input_ids)) - query_start_loc[:-1].long()[seq_index]
    )
    blocks = block_tables[seq_index, positions // block_size].long()
    slot_mapping = blocks * block_size + positions % block_size
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping.to(device, non_blocking=True),
        query_start_loc=query_start_loc.to(device, non_blocking=True),
        seq_lens=seq_lens_t.to(device, non_blocking=True),
        block_tables=block_tables.to(device, non_blocking=True),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        prompt_seqs=None
        if prompt_seqs is None
        else torch.tensor(prompt_seqs, dtype=torch.bool).to(device, non_blocking=True),
    )
    return (
        torch.tensor(input_ids, dtype=torch.int64).to(device, non_blocking=True),
        positions.to(device, non_blocking=True),
        metadata,
    )


def allocate_kv_caches(
    model: torch.nn.Module,
    num_blocks: int,
    block_size: int,
    device: torch.device,
    cache_dtype: torch.dtype | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed K and V caches, one pair per layer, each
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` in ``cache_dtype`` (None: the model's
    dtype; fp8 holds one byte an element, the attention layers' scales say what it means).

    On the CPU the cache is in transparent huge pages where the system gives them
    (:mod:`kvpilot.kernels.cpu.huge_pages`). Zeroed rather than empty: attention kernels may
    read (and mask) slots past a sequence's end, and uninitialised memory could hold NaNs that
    survive a multiplication by 0.
    """
    shape = (model.num_layers, 2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    dtype = cache_dtype or model.dtype
    if torch.device(device).type == "cpu":
        # Each decode step streams the cache in use from memory: in huge pages where the system
        # gives them (fewer TLB misses, prefetchers not stopped every 4 KiB).
        cache = huge_pages.zeros(shape, dtype)
    else:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    return [(cache[layer, 0], cache[layer, 1]) for layer in range(model.num_layers)]
