"""hicache's residency in vLLM's own KV event stream (`KVConnectorBase_V1.take_events`).

vLLM publishes what its GPU prefix cache stores and drops (medium "GPU"); with this
connector the same stream also says what hicache holds behind it, in vLLM's medium names,
as vLLM's OffloadingConnector does for its tiers: L2 pages are "CPU", L3 pages "STORAGE"
(L1 is hicache's staging area on the GPU, not a cache a router can use: not reported).

One `GroupEvents` listens to each KV group's cache (`HiCache.set_residency_listener`) and
turns each run that gains or loses a tier into vLLM's `BlockStored` / `BlockRemoved`: the
block hashes are hicache's page keys (16 bytes), the block size its page size, with the
group's index and spec kind. A sliding-window group's window entries (groups.py) start a
chain of their own (no parent). The events wait in a bounded queue until the scheduler's
connector takes them; only the connector in the workers' process can (vLLM's `uni`
executor): with workers elsewhere, no events.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored

from hicache.events import extra_keys_of
from radix.node import Tier

MEDIUM_OF_TIER = {Tier.L2: MEDIUM_CPU, Tier.L3: MEDIUM_STORAGE}
MAX_QUEUED_EVENTS = 100_000  # a scheduler that stops taking them loses the oldest
SPEC_KINDS = {"full": "full_attention", "mla": "mla_attention", "sliding": "sliding_window"}


def event_queue() -> deque:
    return deque(maxlen=MAX_QUEUED_EVENTS)


class GroupEvents:
    """A KV group's cache listener (`radix.residency.ResidencyListener`): vLLM events, queued.
    Called under the cache's lock: it only appends."""

    def __init__(self, queue: deque, group, page_size: int) -> None:
        self.queue = queue
        self.group = group
        self.page_size = page_size

    def pages_stored(
        self, tier: Tier, keys: list[bytes], parent_key: bytes | None, data: bytes, namespace
    ) -> None:
        medium = MEDIUM_OF_TIER.get(tier)
        if medium is None:
            return
        self.queue.append(
            BlockStored(
                block_hashes=list(keys),
                parent_block_hash=parent_key,
                token_ids=np.frombuffer(data, dtype="<u4").tolist(),
                block_size=self.page_size,
                lora_id=None,
                medium=medium,
                lora_name=None,
                extra_keys=extra_keys_of(namespace, len(keys)),
                group_idx=self.group.index,
                kv_cache_spec_kind=SPEC_KINDS[self.group.kind],
                kv_cache_spec_sliding_window=self.group.window_tokens or None,
            )
        )

    def pages_removed(self, tier: Tier, keys: list[bytes], namespace=None) -> None:
        medium = MEDIUM_OF_TIER.get(tier)
        if medium is not None:
            self.queue.append(
                BlockRemoved(block_hashes=list(keys), medium=medium, group_idx=self.group.index)
            )
