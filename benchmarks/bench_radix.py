"""Replay a Mooncake trace through the radix index: hit tokens and index time per request.

Each request is expanded into tokens as the trace README says (token j of block h is
h*512 + j; the last block is cut to the request's length), then matched and inserted, with
LRU eviction first when `--capacity-pages` would be exceeded. Only the index calls are
timed; expanding tokens is not.

    python benchmarks/bench_radix.py [--trace T] [--page-size 64] [--capacity-pages 0] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import DEFAULT_TRACE, device_name, emit  # noqa: E402
from hicache.simulate.trace import open_text  # noqa: E402
from radix.keys import TOKEN_BYTES, Namespace, encode_tokens  # noqa: E402
from radix.node import Tier  # noqa: E402
from radix.tree import RadixTree  # noqa: E402

NS = Namespace(model_id="bench-radix", layout="bench")

BLOCK_TOKENS = 512


def load_requests(path: Path, limit: int | None) -> list[np.ndarray]:
    """Token arrays of the trace's requests (uint32, the index's own encoding)."""
    offsets = np.arange(BLOCK_TOKENS, dtype=np.uint32)
    requests = []
    with open_text(path) as trace:
        for line in trace:
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            record = json.loads(line)
            blocks = np.asarray(record["hash_ids"], dtype=np.uint32) * BLOCK_TOKENS
            tokens = (blocks[:, None] + offsets[None, :]).reshape(-1)
            requests.append(tokens[: record["input_length"]])
    return requests


def replay(requests: list[np.ndarray], page_size: int, capacity_pages: int) -> dict:
    tree = RadixTree(page_size=page_size, eviction_policy="lru")
    free_ids: list[int] = []
    next_id = 0
    hit_tokens = 0
    elapsed = 0.0
    for tokens in requests:
        num_pages = len(tokens) // page_size
        start = time.perf_counter()
        data = encode_tokens(tokens)  # once per request, as the controller does
        match = tree.match_prefix(data, NS)
        needed = num_pages - match.matched_pages
        if capacity_pages:
            over = tree.num_pages(Tier.L1) + needed - capacity_pages
            if over > 0:
                tree.lock(match.last_node)
                free_ids.extend(tree.evict(Tier.L1, over))
                tree.unlock(match.last_node)
            needed = min(needed, capacity_pages - tree.num_pages(Tier.L1))
        elapsed += time.perf_counter() - start
        # The page allocator is the caller's, not the index's: not timed.
        new_ids = [free_ids.pop() for _ in range(min(needed, len(free_ids)))]
        while len(new_ids) < needed:
            new_ids.append(next_id)
            next_id += 1
        start = time.perf_counter()
        if needed > 0:
            keep = (match.matched_pages + needed) * page_size
            result = tree.insert(data[: keep * TOKEN_BYTES], match.device_page_ids + new_ids, NS)
            free_ids.extend(result.duplicate_device_page_ids)
        elapsed += time.perf_counter() - start
        hit_tokens += match.matched_tokens
    total_tokens = int(sum(len(tokens) for tokens in requests))
    return {
        "page_size": page_size,
        "capacity_pages": capacity_pages,
        "requests": len(requests),
        "total_tokens": total_tokens,
        "hit_tokens": hit_tokens,
        "hit_rate": round(hit_tokens / total_tokens, 6) if total_tokens else 0.0,
        "seconds": round(elapsed, 4),
        "us_per_request": round(elapsed / len(requests) * 1e6, 2),
        "us_per_1k_tokens": round(elapsed / total_tokens * 1e9, 3),
        "nodes": tree.num_nodes,
        "l1_pages": tree.num_pages(Tier.L1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--capacity-pages", type=int, default=0, help="0 = unbounded")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    args = parser.parse_args()
    if not args.trace.exists():
        parser.error(f"trace not found: {args.trace} (pass --trace)")
    requests = load_requests(args.trace, args.limit)
    replay(requests[: min(50, len(requests))], args.page_size, args.capacity_pages)  # warm-up
    result = replay(requests, args.page_size, args.capacity_pages)
    emit({"bench": "radix", "device": device_name(), **result})


if __name__ == "__main__":
    main()
