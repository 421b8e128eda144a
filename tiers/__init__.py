"""tiers: the memory of L1 (device) and L2 (pinned host), and the kernels that move pages.

Knows page ids and tensors; never tokens or page keys.
"""
