"""KVCacheManager: the paged block pool with reference counts and hash-based prefix caching.

It hands out block ids and never touches tensors. A full block is identified by the hash of its parent
block's hash and its own token ids; the token ids are stored too, since hashes can collide. Freed blocks keep
their hash until they are reused (least recently freed first), so a later request can still hit them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagellm.config import cdiv
from pagellm.core.request import Request


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up, once per request
    hits: int = 0  # of which served from cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the first is reused first. Values unused (an ordered set).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def _can_hit(self, request: Request) -> bool:
        # Prompt logprobs need every prompt position's logits, so such a request computes its whole prompt.
        return self.enable_prefix_caching and not request.wants_prompt_logprobs

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Blocks holding a cached prefix of this request's tokens; never the whole prompt (its last token
        must be computed for the first output token's logits). Counts nothing: see `record_prefix_query`."""
        if not self._can_hit(request):
            return []
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        self._hash_full_blocks(request, max_blocks)
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = self._cached.get(request.block_hashes[i])
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            if block_id is None or self._blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
        return hits

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        """Count a request's prompt lookup in the hit rate: once, when it is admitted (the scheduler retries
        lookups after a failed allocation, and recomputes after a preemption)."""
        if self._can_hit(request):
            self.stats.queries += request.num_prompt_tokens
            self.stats.hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after taking `computed_blocks`).
        Returns False, changing nothing, when the pool is short."""
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(request.block_ids) - len(computed_blocks)
        if needed <= 0 and not computed_blocks:  # most decode steps: the last block still has room
            return True
        reusable_free = sum(1 for b in computed_blocks if self._blocks[b].ref_count == 0)
        if needed > self.num_free_blocks - reusable_free:
            return False
        for block_id in computed_blocks:
            self._take(block_id)
        request.block_ids.extend(computed_blocks)
        for _ in range(max(needed, 0)):
            block_id = next(iter(self._free))
            self._forget_hash(block_id)
            self._take(block_id)
            request.block_ids.append(block_id)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's computed, full blocks in the prefix cache (called after the forward pass).
        Only blocks whose tokens are known count: a step in flight may have computed a token not back yet."""
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if not self.enable_prefix_caching or num_full <= request.num_registered_blocks:
            return
        self._hash_full_blocks(request, num_full)
        for i in range(request.num_registered_blocks, num_full):
            block = self._blocks[request.block_ids[i]]
            if block.block_hash is not None:
                continue
            block_hash = request.block_hashes[i]
            if block_hash in self._cached:  # same content computed twice (e.g. two requests in one step)
                continue
            block.block_hash = block_hash
            block.token_ids = tuple(request.token_slice(i * self.block_size, (i + 1) * self.block_size))
            self._cached[block_hash] = block.block_id
        request.num_registered_blocks = num_full

    def free(self, request: Request) -> None:
        """Drop the request's hold on its blocks. Tail blocks go to the free list first, so shared
        prefixes are the last to be evicted."""
        for block_id in reversed(request.block_ids):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        request.block_ids = []
        request.num_registered_blocks = 0

    def _take(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _forget_hash(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.block_hash is not None and self._cached.get(block.block_hash) == block_id:
            del self._cached[block.block_hash]
        block.block_hash, block.token_ids = None, None

    def _hash_full_blocks(self, request: Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else None
            hashes.append(hash((parent, tuple(request.token_slice(i * self.block_size, (i + 1) * self.block_size)))))
