"""Data parallelism: M engine replicas, each (possibly tensor-parallel) in its own engine-core process with its own
GPUs (`engine/core_client.py` runs them), and the routing of requests between them: a request whose prompt starts
like one routed before goes to that one's replica, where its prefix is likely cached, unless that replica is
busier than the least loaded by more than AFFINITY_SLACK requests; else to the least loaded.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import fields
from typing import Any

import torch

from pagellm.config import EngineConfig

AFFINITY_SLACK = 4  # unfinished requests a replica may have beyond the least loaded and still get a prefix hit
PREFIXES_PER_REPLICA = 65536  # block-prefix hashes remembered per replica (least recently routed forgotten)


class PrefixAffinity:
    """Which replica was last sent each prompt prefix (in whole KV blocks): the routing's guess at which replica
    holds it in its prefix cache."""

    def __init__(self, num_replicas: int, block_size: int) -> None:
        self.block_size = block_size
        self._seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def block_hashes(self, token_ids: list[int]) -> list[int]:
        hashes, parent = [], None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = hash((parent, tuple(token_ids[start : start + self.block_size])))
            hashes.append(parent)
        return hashes

    def matched_blocks(self, replica: int, hashes: list[int]) -> int:
        seen, count = self._seen[replica], 0
        for block_hash in hashes:
            if block_hash not in seen:
                break
            count += 1
        return count

    def record(self, replica: int, hashes: list[int]) -> None:
        seen = self._seen[replica]
        for block_hash in hashes:
            seen[block_hash] = None
            seen.move_to_end(block_hash)
        while len(seen) > PREFIXES_PER_REPLICA:
            seen.popitem(last=False)


class Router:
    """Which replica gets each request: the one likely to hold its prompt's prefix, else the one with the fewest
    unfinished requests."""

    def __init__(self, num_replicas: int, block_size: int, prefix_caching: bool) -> None:
        self.load = [0] * num_replicas  # unfinished requests per replica
        self._affinity = PrefixAffinity(num_replicas, block_size)
        self._prefix_caching = prefix_caching

    def pick(self, prompt_token_ids: list[int]) -> int:
        """The replica for a new request (counted as unfinished there until `finished`)."""
        replicas = range(len(self.load))
        least = min(replicas, key=self.load.__getitem__)
        hashes = self._affinity.block_hashes(prompt_token_ids) if self._prefix_caching and len(self.load) > 1 else []
        matched = {i: self._affinity.matched_blocks(i, hashes) for i in replicas}
        best = max(replicas, key=lambda i: (matched[i], -self.load[i]))
        index = best if matched[best] and self.load[best] <= self.load[least] + AFFINITY_SLACK else least
        self._affinity.record(index, hashes)
        self.load[index] += 1
        return index

    def finished(self, index: int) -> None:
        self.load[index] -= 1


def combine_stats(stats: list) -> Any:
    """One EngineStats for several replicas: counts summed, KV usage over all their blocks."""
    kind = type(stats[0])
    total = {f.name: sum(getattr(s, f.name) for s in stats) for f in fields(kind)}
    blocks = total["num_blocks"]
    total["kv_cache_usage"] = 1.0 - total["num_free_blocks"] / blocks if blocks else 0.0
    return kind(**total)


def check_data_parallel(config: EngineConfig) -> None:
    device = config.resolve_device()
    needed = config.data_parallel_size * config.tensor_parallel_size
    if device.type == "cuda" and needed > torch.cuda.device_count():
        raise ValueError(
            f"data_parallel_size={config.data_parallel_size} x tensor_parallel_size={config.tensor_parallel_size} "
            f"needs {needed} GPUs; {torch.cuda.device_count()} are visible"
        )
