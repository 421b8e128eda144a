"""hicache inside vLLM: a KV connector (`--kv-transfer-config`, `HiCacheConnector`).

    connector.py    HiCacheConnector: vLLM's KVConnectorBase_V1, both roles
    config.py       vLLM's configs -> HiCacheConfig, KVLayout and namespaces
    groups.py       vLLM's KV cache groups (full, MLA, sliding window): what each stores
    plan.py         the scheduler side: matched tokens and each step's loads and saves
    lookup.py       how the scheduler asks a worker's hicache what it holds
    worker.py       the worker side: one step's loads and saves, layer by layer
    kv.py           vLLM's paged KV tensors and the copies to and from hicache's L1
    block_copy.py   the Triton kernels of those copies
    events.py       hicache's L2/L3 residency as vLLM's KV events
    metrics.py      the connector's stats and Prometheus counters in vLLM's registry

Stands apart from the embedded engine and from the SGLang backend.
"""
