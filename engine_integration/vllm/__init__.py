"""hicache inside vLLM: a KV connector (`--kv-transfer-config`, `HiCacheConnector`).

    connector.py    HiCacheConnector: vLLM's KVConnectorBase_V1, both roles
    config.py       vLLM's configs -> HiCacheConfig, KVLayout and namespaces
    plan.py         the scheduler side: matched tokens and each step's loads and saves
    lookup.py       how the scheduler asks a worker's hicache what it holds
    worker.py       the worker side: one step's loads and saves, layer by layer
    kv.py           vLLM's paged KV tensors and the copies to and from hicache's L1
    block_copy.py   the Triton kernels of those copies

Stands apart from the embedded engine and from the SGLang backend.
"""
