"""hicache: a tiered KV cache for LLM inference.

This package is the composition root: configuration, the HiCache controller and its
policies, metrics, the CLI, the cache-server daemon and the simulator. It imports torch
only in the real executor, so the simulator and the daemon run without it.
"""

__version__ = "0.1.0"
