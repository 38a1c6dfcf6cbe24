"""Block pool bookkeeping: reference counts, prefix hits on full blocks, LRU reuse, hash collisions."""

from __future__ import annotations

from pagellm.core.request import Request
from pagellm.engine.kv_cache_manager import KVCacheManager
from pagellm.sampling_params import SamplingParams


def request(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, SamplingParams(), max_tokens=4)


def run_prefill(kv: KVCacheManager, req: Request) -> list[int]:
    hits = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - len(hits) * kv.block_size, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    return hits


def test_allocation_and_free_restore_pool():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = request(list(range(10)))
    run_prefill(kv, a)
    assert len(a.block_ids) == 3 and kv.num_free_blocks == 5
    kv.free(a)
    assert kv.num_free_blocks == 8 and a.block_ids == []


def test_prefix_hit_full_blocks_only_never_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = request(list(range(12)), "a")
    run_prefill(kv, a)
    b = request(list(range(12)), "b")  # identical prompt: 3 full blocks, but the last token must be computed
    hits = run_prefill(kv, b)
    assert hits == a.block_ids[:2]
    c = request(list(range(6)) + [99, 98, 97], "c")  # diverges inside block 1
    assert kv.get_computed_blocks(c) == a.block_ids[:1]
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 16


def test_freed_blocks_keep_their_hash_until_reused():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = request(list(range(9)), "a")
    run_prefill(kv, a)
    first_blocks = list(a.block_ids)
    kv.free(a)
    b = request(list(range(9)), "b")
    hits = run_prefill(kv, b)
    assert hits == first_blocks[:2]
    kv.free(b)
    # Fill the pool with other content: the old blocks are evicted and no longer hit.
    c = request(list(range(100, 116)), "c")
    run_prefill(kv, c)
    kv.free(c)
    assert kv.get_computed_blocks(request(list(range(9)), "d")) == []


def test_pool_exhaustion_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = request(list(range(12)))
    assert not kv.allocate_slots(a, 12)
    assert kv.num_free_blocks == 2 and a.block_ids == []


def test_hash_collision_is_not_a_hit(monkeypatch):
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = request([1, 2, 3, 4, 5], "a")
    run_prefill(kv, a)
    b = request([7, 7, 7, 7, 5], "b")
    b.block_hashes.append(a.block_hashes[0])  # force the same hash for different tokens
    assert kv.get_computed_blocks(b) == []
