"""Per-request block tables over the block pool, with prefix caching (vLLM V1's KVCacheManager)."""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.engine.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from kvpilot.engine.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def block_extra_keys(cache_salt: str | None, lora: tuple[str, str | None] | None = None) -> tuple:
    """What besides the tokens decides the first block's K/V, from plain values (the router
    computes the engine's hashes with it).

    Args:
        cache_salt: the request's ``cache_salt``, or None.
        lora: ``(adapter name, weight digest)`` of the request's LoRA adapter, or None.
    """
    keys: tuple = () if cache_salt is None else (cache_salt,)
    if lora is not None:
        keys += (("lora", *lora),)
    return keys


def first_block_extra_keys(request: Request) -> tuple:
    """What besides the tokens decides the first block's K/V: the ``cache_salt`` and the LoRA
    adapter (name and weight digest); later blocks inherit them through the hash chain."""
    lora = request.lora_request
    return block_extra_keys(
        request.cache_salt, None if lora is None else (lora.lora_name, request.lora_digest)
    )


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    root_hash: BlockHash,
    first_extra_keys: tuple = (),
) -> list[BlockHash]:
    """Extend ``hashes`` (those of the first full blocks, possibly none) in place to every full
    block of ``token_ids`` and return it: block ``i`` is
    ``hash_block_tokens(hash of block i-1 or root_hash, its tokens, first_extra_keys if i == 0)``.

    Args:
        hashes: hashes already computed for the first ``len(hashes)`` blocks.
        token_ids: the sequence's tokens; a partial last block has no hash.
        block_size: tokens per block (> 0).
        root_hash: the parent of the first block (the engine's model identity).
        first_extra_keys: ``block_extra_keys(...)`` of the sequence.
    """
    while (len(hashes) + 1) * block_size <= len(token_ids):
        i = len(hashes)
        parent = hashes[-1] if hashes else root_hash
        extra = first_extra_keys if i == 0 else ()
        hashes.append(
            hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        )
    return hashes


class KVCacheManager:
    """Allocates blocks to requests and finds their longest cached prefix.

    A request's block table covers its first ``num_computed_tokens + num_new_tokens`` tokens.
    With prefix caching, every full block is identified by
    ``hash(parent hash, block tokens, extra keys)``; the first block's parent is ``root_hash``
    (the model's identity and revision) and its extra keys hold the request's ``cache_salt`` and
    LoRA adapter, so they reach every later block through the chain.

    Args:
        num_blocks: blocks in the cache.
        block_size: tokens per block.
        enable_caching: reuse cached full blocks across requests.
        root_hash: parent hash of every first block.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool, root_hash: BlockHash = b""
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.root_hash = root_hash
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's blocks are already indexed in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0..1)."""
        return self.block_pool.get_usage()

    def update_block_hashes(self, request: Request) -> list[BlockHash]:
        """Extend ``request.block_hashes`` to every full block of its tokens and return them."""
        return extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            self.root_hash,
            first_block_extra_keys(request),
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest chain of cached blocks that prefixes the request's tokens.

        At least one token is always left to compute (its logits give the next token), so a
        fully cached prompt reuses all its blocks but the last. A request that still needs its
        prompt logprobs reads nothing, as in vLLM: cached tokens have no logits. It still
        writes its blocks to the cache for others.

        Returns:
            ``(blocks, num_computed_tokens)``; ``([], 0)`` when caching is off or the request
            needs its prompt logprobs.
        """
        if not self.enable_caching or request.needs_prompt_logprobs:
            return [], 0
        hashes = self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Grow the request's block table to hold ``num_new_tokens`` more tokens.

        Args:
            request: the request; ``request.num_computed_tokens`` tokens are already held.
            num_new_tokens: tokens to compute this step (draft tokens included).
            new_computed_blocks: prefix-cache hits (first scheduling only).
            num_new_computed_tokens: tokens those hits cover.
            num_lookahead_tokens: further slots reserved past them (a draft model writes its
                proposals' K/V there after the step).

        Returns:
            The fresh blocks, or None (nothing changed) when too few blocks are free.
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        self.num_cached_blocks.setdefault(request.request_id, 0)
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed = (
            cdiv(num_total + num_lookahead_tokens, self.block_size)
            - len(blocks)
            - len(new_computed_blocks)
        )
        # Hits sitting in the free list are not available as fresh blocks once touched.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            if not blocks:
                self._forget(request.request_id)
            return None
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_needed, 0))
        blocks.extend(new_blocks)
        if self.enable_caching:
            # Index the blocks this step fills: their K/V are written in this step's forward
            # pass, before any later request can read them. Draft tokens are not the
            # request's tokens (yet): blocks they fill are indexed once accepted.
            num_full = min(num_total, request.num_tokens) // self.block_size
            hashes = self.update_block_hashes(request)
            self.block_pool.cache_full_blocks(
                blocks, hashes, self.num_cached_blocks[request.request_id], num_full
            )
            self.num_cached_blocks[request.request_id] = max(
                num_full, self.num_cached_blocks[request.request_id]
            )
        return new_blocks

    def free(self, request: Request) -> None:
        """Release all the request's blocks (tail first, see ``BlockPool.free_blocks_of``)."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        self.block_pool.free_blocks_of(reversed(blocks))
        self._forget(request.request_id)

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Shrink the block table to the blocks that the first ``num_tokens`` slots need
        (rejected draft tokens roll back); the freed blocks were never indexed, as they hold
        no full block of the request's tokens."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_kept = cdiv(num_tokens, self.block_size)
        if len(blocks) > num_kept:
            self.block_pool.free_blocks_of(reversed(blocks[num_kept:]))
            del blocks[num_kept:]

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (physical block ids)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def _forget(self, request_id: str) -> None:
        self.req_to_blocks.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
