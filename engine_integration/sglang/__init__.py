"""hicache as SGLang's L3: a `HiCacheStorage` backend (`--hicache-storage-backend dynamic`).

    storage.py      HiCacheSGLangStorage: SGLang's storage calls onto hicache's L3 backends
    pages.py        where one page of an SGLang host pool lies in memory

Stands apart from the embedded engine and from the vLLM connector.
"""
