"""hicache as SGLang's L3: a `HiCacheStorage` backend (`--hicache-storage-backend dynamic`).

    storage.py      HiCacheSGLangStorage: SGLang's storage calls onto hicache's L3 backends
    sidecars.py     the extra host pools of hybrid models (v2 API): one object per page and pool
    pages.py        where one page of an SGLang host pool lies in memory

Stands apart from the embedded engine and from the vLLM connector.
"""
