"""radix: the pure index of KV pages (tokens -> pages, residency per tier, eviction order).

Depends on the standard library, xxhash and numpy only; never on torch.
"""
