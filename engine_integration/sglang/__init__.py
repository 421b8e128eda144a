"""hicache as SGLang's L3: a `HiCacheStorage` backend (`--hicache-storage-backend dynamic`).

    storage.py      HiCacheSGLangStorage: SGLang's storage calls onto hicache's L3 backends
    config.py       the extra config's settings and the rank's part of every namespace
    kv_pool.py      the registered KV host pool: its geometry, its store, its object keys
    metrics.py      the pages and GB/s of each move, for SGLang's storage metrics
    sidecars.py     the extra host pools of hybrid models (v2 API): one object per page and pool
    pages.py        where one page of an SGLang host pool lies in memory

Stands apart from the embedded engine and from the vLLM connector.
"""
